"""What every core.linalg function shares: torch's input checks and errors, the LAPACK module
of the input's device, and small matrix helpers on raw arrays."""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.linalg

from shoal.core import backend
from shoal.core.errors import ShoalError
from shoal.core.tensor import Tensor

_TORCH_NAMES = {"float16": "Half", "bfloat16": "BFloat16", "float32": "Float",
                "float64": "Double", "int64": "Long", "int32": "Int", "int16": "Short",
                "int8": "Char", "uint8": "Byte", "bool": "Bool"}


class LinAlgError(ShoalError, RuntimeError):
    """A matrix the operation cannot handle (singular, not positive-definite): torch's
    torch.linalg.LinAlgError, a RuntimeError."""


def torch_dtype_name(dt: np.dtype) -> str:
    """torch's name for a dtype in its messages ('Long', 'Half')."""
    return _TORCH_NAMES.get(np.dtype(dt).name, np.dtype(dt).name)


def check_float(x: Tensor, op: str) -> Any:
    """x's array, refused unless float32/float64/complex, with torch's messages."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}(): argument 'A' must be Tensor, not {type(x).__name__}")
    arr = x.array
    kind = arr.dtype.kind
    if kind not in "fcV":
        raise RuntimeError(f"{op}: Expected a floating point or complex tensor as input. Got "
                           f"{torch_dtype_name(arr.dtype)}")
    if kind == "V" or arr.dtype.itemsize < 4:
        raise RuntimeError(f"{op}: Low precision dtypes not supported. Got "
                           f"{torch_dtype_name(arr.dtype)}")
    return arr


def check_square(x: Tensor, op: str, what: str = "A") -> Any:
    """x's array, refused unless a (batch of) square float matrices."""
    arr = check_float(x, op)
    if arr.ndim < 2:
        raise RuntimeError(f"{op}: The input tensor {what} must have at least 2 dimensions.")
    if arr.shape[-1] != arr.shape[-2]:
        raise RuntimeError(f"{op}: {what} must be batches of square matrices, but they are "
                           f"{arr.shape[-2]} by {arr.shape[-1]} matrices")
    return arr


def check_matrix(x: Tensor, op: str, what: str = "A") -> Any:
    """x's array, refused unless a (batch of) float matrices."""
    arr = check_float(x, op)
    if arr.ndim < 2:
        raise RuntimeError(f"{op}: The input tensor {what} must have at least 2 dimensions.")
    return arr


class _ScipyLinalg:
    """numpy.linalg's signatures over scipy.linalg, for one cpu matrix.

    scipy's LAPACK wrappers run the 512 x 512 decompositions about twice as fast as numpy's
    gufuncs on the same OpenBLAS (measured: bench/func_linalg.py); numpy's stay for batches,
    which its gufuncs loop over in C. Anything not listed here is numpy's.
    """

    @staticmethod
    def svd(a: Any, full_matrices: bool = True, compute_uv: bool = True) -> Any:
        return scipy.linalg.svd(a, full_matrices=full_matrices, compute_uv=compute_uv,
                                check_finite=False, lapack_driver="gesdd")

    @staticmethod
    def eigh(a: Any, UPLO: str = "L") -> Any:
        return scipy.linalg.eigh(a, lower=UPLO == "L", driver="evd", check_finite=False)

    @staticmethod
    def eigvalsh(a: Any, UPLO: str = "L") -> Any:
        return scipy.linalg.eigh(a, lower=UPLO == "L", eigvals_only=True, driver="evd",
                                 check_finite=False)

    @staticmethod
    def qr(a: Any, mode: str = "reduced") -> Any:
        return scipy.linalg.qr(a, mode="full" if mode == "complete" else "economic",
                               check_finite=False)

    @staticmethod
    def inv(a: Any) -> Any:
        return scipy.linalg.inv(a, check_finite=False)

    @staticmethod
    def cholesky(a: Any) -> Any:
        return scipy.linalg.cholesky(a, lower=True, check_finite=False)

    def __getattr__(self, name: str) -> Any:
        return getattr(np.linalg, name)


_SCIPY = _ScipyLinalg()


def lapack(arr: Any) -> Any:
    """The LAPACK front end for arr: scipy's for one cpu matrix, numpy.linalg for a cpu batch,
    cupy.linalg for cuda arrays."""
    if isinstance(arr, np.ndarray):
        return _SCIPY if arr.ndim == 2 else np.linalg
    return backend.array_module(arr).linalg


def xp_of(arr: Any) -> Any:
    """numpy or cupy."""
    return np if isinstance(arr, np.ndarray) else backend.array_module(arr)


def mh(a: Any) -> Any:
    """The conjugate transpose of the last two dims."""
    t = a.swapaxes(-1, -2)
    return t.conj() if t.dtype.kind == "c" else t


def prefix(index: tuple, batch: tuple) -> str:
    """torch's '(Batch element i): ' for an error in one matrix of a batch ('' when unbatched)."""
    if not batch:
        return ""
    return f"(Batch element {int(np.ravel_multi_index(index, batch))}): "


def first_failure(arr: Any, failure: Any) -> tuple[tuple, Any]:
    """(batch index, what `failure(matrix)` said) of the first bad matrix, ((), None) if none:
    only called once LAPACK refused the batch, to word the error as torch does."""
    for index in np.ndindex(*arr.shape[:-2]):
        found = failure(arr[index])
        if found:
            return index, found
    return (), None


def eye_like(a: Any, n: int) -> Any:
    """An n x n identity in a's dtype and module."""
    return xp_of(a).eye(n, dtype=a.dtype)
