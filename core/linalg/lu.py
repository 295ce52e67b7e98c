"""lu_factor, lu_factor_ex, lu and lu_solve: LAPACK's getrf/getrs through scipy, with torch's
1-based int32 pivots. No gradients yet: a call that would need one is refused, not silent."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import numpy as np
import scipy.linalg

from shoal.core.grad_mode import grad_mode
from shoal.core.linalg._common import check_matrix, check_square, prefix, xp_of
from shoal.core.tensor import Tensor, wrap


class LUFactorResult(NamedTuple):
    """torch.return_types.linalg_lu_factor."""

    LU: Tensor
    pivots: Tensor


class LUFactorExResult(NamedTuple):
    """torch.return_types.linalg_lu_factor_ex."""

    LU: Tensor
    pivots: Tensor
    info: Tensor


class LUResult(NamedTuple):
    """torch.return_types.linalg_lu."""

    P: Tensor
    L: Tensor
    U: Tensor


def _no_grad(op: str, *tensors: Tensor) -> None:
    if grad_mode.enabled and any(t.requires_grad for t in tensors):
        raise NotImplementedError(f"{op}: gradients are not supported yet; call it under "
                                  "core.no_grad() or on detached tensors.")


def _cpu(arr: Any, op: str) -> Any:
    if not isinstance(arr, np.ndarray):
        raise NotImplementedError(f"{op}: cuda tensors are not supported yet; use the cpu.")
    return arr


def _factor(arr: Any, pivot: bool, op: str) -> tuple[Any, Any, Any]:
    """(LU, 1-based int32 pivots, info) for every matrix of the batch."""
    if not pivot:
        raise NotImplementedError(f"{op}: LU without pivoting is only available on cuda in "
                                  "torch, and not in shoal.")
    m, n = arr.shape[-2:]
    lu = np.empty_like(arr)
    piv = np.empty((*arr.shape[:-2], min(m, n)), dtype=np.int32)
    info = np.zeros(arr.shape[:-2], dtype=np.int32)
    for index in np.ndindex(*arr.shape[:-2]):
        with warnings.catch_warnings():  # a singular matrix factors fine; info reports it
            warnings.simplefilter("ignore", scipy.linalg.LinAlgWarning)
            lu[index], p = scipy.linalg.lu_factor(arr[index], check_finite=False)
        piv[index] = p + 1
        zeros = np.flatnonzero(np.diagonal(lu[index]) == 0)
        info[index] = zeros[0] + 1 if zeros.size else 0
    return lu, piv, info


def _check_info(info: Any, batch: tuple, op: str) -> None:
    """torch's refusal of a factorisation with a zero pivot."""
    if info.any():
        index = tuple(int(i) for i in np.argwhere(info)[0]) if batch else ()
        k = int(info[index])
        raise RuntimeError(f"{op}: {prefix(index, batch)}U[{k},{k}] is zero and using it on "
                           "lu_solve would result in a division by zero. If you still want to "
                           "perform the factorization, consider calling linalg.lu(A, pivot) or "
                           "linalg.lu_factor_ex(A, pivot)")


def lu_factor(A: Tensor, *, pivot: bool = True) -> LUFactorResult:
    """The packed LU factorisation with partial pivoting (LAPACK getrf) and its pivots; a zero
    pivot raises, as torch's."""
    arr = _cpu(check_matrix(A, "linalg.lu_factor"), "linalg.lu_factor")
    _no_grad("linalg.lu_factor", A)
    lu, piv, info = _factor(arr, pivot, "linalg.lu_factor")
    _check_info(info, arr.shape[:-2], "torch.linalg.lu_factor")
    return LUFactorResult(wrap(lu), wrap(piv))


def lu_factor_ex(A: Tensor, *, pivot: bool = True,
                 check_errors: bool = False) -> LUFactorExResult:
    """lu_factor plus `info` (the first zero pivot, 1-based; 0 when none)."""
    arr = _cpu(check_matrix(A, "linalg.lu_factor_ex"), "linalg.lu_factor_ex")
    _no_grad("linalg.lu_factor_ex", A)
    lu, piv, info = _factor(arr, pivot, "linalg.lu_factor_ex")
    if check_errors:
        _check_info(info, arr.shape[:-2], "torch.linalg.lu_factor_ex")
    return LUFactorExResult(wrap(lu), wrap(piv), wrap(info))


def lu(A: Tensor, *, pivot: bool = True) -> LUResult:
    """(P, L, U) with A = P L U: P a permutation, L unit lower, U upper (trapezoidal)."""
    arr = _cpu(check_matrix(A, "linalg.lu"), "linalg.lu")
    _no_grad("linalg.lu", A)
    if not pivot:
        raise NotImplementedError("linalg.lu: LU without pivoting is not available in shoal.")
    m, n = arr.shape[-2:]
    k = min(m, n)
    p = np.empty((*arr.shape[:-2], m, m), dtype=arr.dtype)
    low = np.empty((*arr.shape[:-2], m, k), dtype=arr.dtype)
    up = np.empty((*arr.shape[:-2], k, n), dtype=arr.dtype)
    for index in np.ndindex(*arr.shape[:-2]):
        p[index], low[index], up[index] = scipy.linalg.lu(arr[index], check_finite=False)
    return LUResult(wrap(p), wrap(low), wrap(up))


def lu_solve(LU: Tensor, pivots: Tensor, B: Tensor, *, left: bool = True,
             adjoint: bool = False) -> Tensor:
    """X with A X = B from lu_factor's (LU, pivots); A^H with adjoint, X A = B with left=False."""
    lu_arr = _cpu(check_square(LU, "linalg.lu_solve"), "linalg.lu_solve")
    _no_grad("linalg.lu_solve", LU, B)
    piv = np.asarray(pivots.array) - 1
    b = B.array
    batch = np.broadcast_shapes(lu_arr.shape[:-2], piv.shape[:-1], b.shape[:-2])
    lu_b = np.broadcast_to(lu_arr, (*batch, *lu_arr.shape[-2:]))
    piv_b = np.broadcast_to(piv, (*batch, piv.shape[-1]))
    b_b = np.broadcast_to(b, (*batch, *b.shape[-2:]))
    complex_ = np.iscomplexobj(lu_arr)
    out = np.empty(np.broadcast_shapes(b_b.shape), dtype=np.result_type(lu_arr, b))
    for index in np.ndindex(*batch):
        rhs = b_b[index]
        if left:
            trans = 2 if adjoint else 0
        else:  # X op(A) = B is op(A)^T X^T = B^T
            rhs = rhs.T
            trans = 1 if not adjoint else 0
            if adjoint and complex_:  # X A^H = B: A conj(X)^T = conj(B)^T
                rhs = rhs.conj()
        x = scipy.linalg.lu_solve((lu_b[index], piv_b[index]), rhs, trans=trans,
                                  check_finite=False)
        if not left:
            x = (x.conj() if adjoint and complex_ else x).T
        out[index] = x
    return wrap(xp_of(lu_arr).asarray(out))
