"""Truth tests with torch's names: all, any, equal, isclose, allclose, nonzero (no gradients)."""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.core import dtypes
from shoal.core.errors import ShapeError
from shoal.core.ops._util import norm_dims, val, xp_of
from shoal.core.tensor import Tensor, wrap

_UINT8 = np.dtype(np.uint8)


def _truth(x: Tensor, dim: Any, keepdim: bool, op: str) -> Tensor:
    xd = x.array
    dims = norm_dims(dim, xd.ndim, op)
    fn = np.all if op == "all" else np.any
    if xd.ndim == 0:
        dims = None  # a 0-d tensor's dim 0 / -1 is itself, as in torch
    out = xp_of(xd).asarray(fn(xd, axis=dims, keepdims=keepdim and xd.ndim > 0))
    # torch keeps uint8 for uint8 inputs (a legacy of byte masks); every other dtype gives bool.
    return wrap(out.astype(_UINT8) if xd.dtype == _UINT8 else out)


def all(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:  # noqa: A001 - torch's name
    """True where every element along `dim` (all dims when None) is non-zero."""
    return _truth(x, dim, keepdim, "all")


def any(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:  # noqa: A001 - torch's name
    """True where some element along `dim` (all dims when None) is non-zero."""
    return _truth(x, dim, keepdim, "any")


def equal(x: Tensor, y: Tensor) -> bool:
    """True when both tensors have the same shape and elements (NaN is never equal)."""
    xd, yd = val(x), val(y)
    if tuple(xd.shape) != tuple(yd.shape):
        return False
    if xp_of(xd) is not xp_of(yd):
        raise ShapeError(f"equal: tensors on different devices ({x.device} and {y.device}).")
    return bool(xp_of(xd).array_equal(xd, yd))


def _same_dtype(x: Tensor, y: Tensor, op: str) -> None:
    # torch refuses to compare tolerances across dtypes rather than silently promoting.
    if x.array.dtype != y.array.dtype:
        raise dtypes.DTypeError(
            f"{op}: both tensors must have the same dtype, got {x.dtype!r} and {y.dtype!r}."
        )


def isclose(
    x: Tensor, y: Tensor, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False
) -> Tensor:
    """Elementwise |x - y| <= atol + rtol * |y| (broadcasting), as a bool tensor."""
    _same_dtype(x, y, "isclose")
    xd, yd = x.array, y.array
    try:
        out = xp_of(xd).isclose(xd, yd, rtol=rtol, atol=atol, equal_nan=equal_nan)
    except ValueError as exc:
        raise ShapeError(
            f"isclose: cannot broadcast shapes {tuple(xd.shape)} and {tuple(yd.shape)}."
        ) from exc
    return wrap(xp_of(xd).asarray(out))


def allclose(
    x: Tensor, y: Tensor, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False
) -> bool:
    """True when isclose holds everywhere (shapes broadcast, dtypes must match)."""
    _same_dtype(x, y, "allclose")
    return bool(isclose(x, y, rtol, atol, equal_nan).array.all())


def nonzero(x: Tensor, *, as_tuple: bool = False) -> Any:
    """Indices of non-zero elements: an int64 (n, ndim) tensor, or a tuple of 1-D index tensors."""
    xd = x.array
    xp = xp_of(xd)
    # numpy's nonzero of a 0-d array is deprecated; torch treats it as a 1-element vector for
    # as_tuple and as a (n, 0) matrix otherwise.
    idx = xp.nonzero(xd.reshape(1) if xd.ndim == 0 else xd)
    if as_tuple:
        return tuple(wrap(i.astype(np.int64)) for i in idx)
    if xd.ndim == 0:
        return wrap(xp.zeros((int(idx[0].size), 0), dtype=np.int64))
    return wrap(xp.stack(idx, axis=1).astype(np.int64))
