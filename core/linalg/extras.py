"""The rest of torch.linalg's everyday surface: matmul, vecdot, diagonal, cond, solve_triangular,
matrix_exp, eigvals/eig, and the *_ex forms that report failures in `info` instead of raising."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import scipy.linalg

from shoal.core.grad_mode import grad_mode
from shoal.core.linalg._common import LinAlgError, check_float, check_square, lapack, mh, xp_of
from shoal.core.linalg.decompositions import _not_positive_definite, cholesky, svdvals
from shoal.core.linalg.inverse import _zero_pivot, inv, solve
from shoal.core.linalg.norms import matrix_norm
from shoal.core.ops import arith, products, reduce
from shoal.core.ops._util import result, unbroadcast
from shoal.core.tensor import Tensor, wrap


def vecdot(x: Tensor, y: Tensor, *, dim: int = -1) -> Tensor:
    """sum(conj(x) * y) along dim, broadcasting the other dims."""
    xc = x.conj() if x.dtype.is_complex else x
    return reduce.sum(arith.mul(xc, y), dim)


def diagonal(A: Tensor, *, offset: int = 0, dim1: int = -2, dim2: int = -1) -> Tensor:
    """The diagonal of each matrix over (dim1, dim2), last in the result (a view)."""
    return products.diagonal(A, offset, dim1, dim2)


def cond(A: Tensor, p: Any = None) -> Tensor:
    """The condition number: largest over smallest singular value for p None/2 (-2: the
    inverse), else norm(A, p) * norm(inv(A), p) for square A."""
    check_float(A, "linalg.cond")
    if p in (None, 2, -2):
        s = svdvals(A)
        big, small = reduce.amax(s, -1), reduce.amin(s, -1)
        return arith.div(big, small) if p != -2 else arith.div(small, big)
    check_square(A, "linalg.cond")
    return arith.mul(matrix_norm(A, p), matrix_norm(inv(A), p))


def _triangle(a: Any, upper: bool, unit: bool) -> Any:
    xp = xp_of(a)
    t = xp.triu(a) if upper else xp.tril(a)
    if unit:
        idx = xp.arange(a.shape[-1])
        t = t.copy()
        t[..., idx, idx] = 1
    return t


def solve_triangular(A: Tensor, B: Tensor, *, upper: bool, left: bool = True,
                     unitriangular: bool = False) -> Tensor:
    """X with A X = B (X A = B when left=False) for triangular A; only A's triangle is read."""
    check_square(A, "linalg.solve_triangular")
    a = _triangle(A.array, upper, unitriangular)
    b = B.array
    if not left:  # X A = B is A^T X^T = B^T, whose matrix is the other triangle
        a, b = a.swapaxes(-1, -2), b.swapaxes(-1, -2)
    upper_eff = upper if left else not upper
    xp = xp_of(a)
    if a.ndim == 2 and b.ndim == 2 and isinstance(a, np.ndarray):
        x = scipy.linalg.solve_triangular(a, b, lower=not upper_eff, check_finite=False)
    else:
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        x = lapack(a).solve(xp.broadcast_to(a, (*batch, *a.shape[-2:])),
                            xp.broadcast_to(b, (*batch, *b.shape[-2:])))

    def backward(g: Any) -> tuple:
        gb = np.linalg.solve(mh(a), g.swapaxes(-1, -2) if not left else g) if isinstance(
            a, np.ndarray) else lapack(a).solve(mh(a), g.swapaxes(-1, -2) if not left else g)
        ga = _triangle(unbroadcast(-(gb @ mh(x)), a.shape), upper_eff, False)
        if unitriangular:
            idx = xp.arange(ga.shape[-1])
            ga[..., idx, idx] = 0
        gb = unbroadcast(gb, b.shape)
        if not left:
            ga, gb = ga.swapaxes(-1, -2), gb.swapaxes(-1, -2)
        return ga, gb

    return result(x.swapaxes(-1, -2) if not left else x, "LinalgSolveTriangularBackward",
                  backward, (A, B))


def matrix_exp(A: Tensor) -> Tensor:
    """The matrix exponential (scipy's Pade approximation with scaling and squaring)."""
    arr = check_square(A, "linalg.matrix_exp")
    out = _expm(arr)

    def backward(g: Any) -> tuple:
        # torch's: the top-right block of exp([[A^H, G], [0, A^H]]) is the gradient.
        n = arr.shape[-1]
        xp = xp_of(arr)
        big = xp.zeros((*np.broadcast_shapes(arr.shape, g.shape)[:-2], 2 * n, 2 * n),
                       dtype=np.result_type(arr, g))
        big[..., :n, :n] = mh(arr)
        big[..., n:, n:] = mh(arr)
        big[..., :n, n:] = g
        return (_expm(big)[..., :n, n:],)

    return result(out, "LinalgMatrixExpBackward", backward, (A,))


def _expm(arr: Any) -> Any:
    if isinstance(arr, np.ndarray):
        return scipy.linalg.expm(arr)
    import cupyx.scipy.linalg  # noqa: PLC0415 - only with cupy arrays, an optional extra

    return cupyx.scipy.linalg.expm(arr)


class EigResult(NamedTuple):
    """torch.return_types.linalg_eig."""

    eigenvalues: Tensor
    eigenvectors: Tensor


def _complex_out(A: Tensor, op: str) -> Any:
    arr = check_square(A, op)
    if A.requires_grad and grad_mode.enabled:
        raise NotImplementedError(f"{op}: gradients are not supported yet (its outputs are "
                                  "complex, and core's autograd.Function gives them no node).")
    if not isinstance(arr, np.ndarray):
        raise NotImplementedError(f"{op}: cupy has no general eigensolver; use the cpu.")
    return arr


def eig(A: Tensor) -> EigResult:
    """Eigenvalues and eigenvectors of general square matrices (complex, LAPACK geev)."""
    arr = _complex_out(A, "linalg.eig")
    w, v = np.linalg.eig(arr)
    dt = np.result_type(arr.dtype, np.complex64)
    return EigResult(wrap(w.astype(dt, copy=False)), wrap(v.astype(dt, copy=False)))


def eigvals(A: Tensor) -> Tensor:
    """Eigenvalues of general square matrices (complex)."""
    arr = _complex_out(A, "linalg.eigvals")
    return wrap(np.linalg.eigvals(arr).astype(np.result_type(arr.dtype, np.complex64),
                                              copy=False))


class InvExResult(NamedTuple):
    """torch.return_types.linalg_inv_ex."""

    inverse: Tensor
    info: Tensor


class SolveExResult(NamedTuple):
    """torch.return_types.linalg_solve_ex."""

    result: Tensor
    info: Tensor


class CholeskyExResult(NamedTuple):
    """torch.return_types.linalg_cholesky_ex."""

    L: Tensor
    info: Tensor


def _infos(arr: Any, failure: Any) -> Any:
    """LAPACK's info per matrix (0 for success), int32, shaped as the batch."""
    flat = arr.reshape(-1, *arr.shape[-2:])
    infos = np.array([failure(m) for m in flat], dtype=np.int32).reshape(arr.shape[:-2])
    return xp_of(arr).asarray(infos)


def _nan_like(arr: Any) -> Tensor:
    return wrap(xp_of(arr).full(arr.shape, np.nan, dtype=arr.dtype))


def _each(arr: Any, fn: Any, shape: tuple) -> Any:
    """fn per matrix of the batch, NaN where LAPACK refuses one (the *_ex forms' failure path:
    the other matrices keep their results, as torch's batched LAPACK calls give)."""
    xp = xp_of(arr)
    out = xp.full(shape, np.nan, dtype=arr.dtype)
    for index in np.ndindex(*arr.shape[:-2]):
        try:
            out[index] = fn(index)
        except np.linalg.LinAlgError:
            continue
    return out


def inv_ex(A: Tensor, *, check_errors: bool = False) -> InvExResult:
    """(inverse, info): info > 0 names the zero pivot of a singular matrix; raises only with
    check_errors=True."""
    arr = check_square(A, "linalg.inv_ex")
    try:
        return InvExResult(inv(A), wrap(xp_of(arr).zeros(arr.shape[:-2], dtype=np.int32)))
    except LinAlgError:
        if check_errors:
            raise
        out = _each(arr, lambda i: lapack(arr).inv(arr[i]), arr.shape)
        return InvExResult(wrap(out), wrap(_infos(arr, _zero_pivot)))


def solve_ex(A: Tensor, B: Tensor, *, left: bool = True,
             check_errors: bool = False) -> SolveExResult:
    """(solution, info), as inv_ex for solve."""
    arr = check_square(A, "linalg.solve_ex")
    try:
        return SolveExResult(solve(A, B, left=left),
                             wrap(xp_of(arr).zeros(arr.shape[:-2], dtype=np.int32)))
    except LinAlgError:
        if check_errors:
            raise
        shape = np.broadcast_shapes(arr.shape[:-1], B.shape[:-1] if B.ndim == A.ndim else
                                    B.shape)
        return SolveExResult(_nan_like(xp_of(arr).empty(shape, arr.dtype)),
                             wrap(_infos(arr, _zero_pivot)))


def cholesky_ex(A: Tensor, *, upper: bool = False,
                check_errors: bool = False) -> CholeskyExResult:
    """(L, info): info > 0 is the order of the leading minor that is not positive-definite."""
    arr = check_square(A, "linalg.cholesky_ex")
    try:
        return CholeskyExResult(cholesky(A, upper=upper),
                                wrap(xp_of(arr).zeros(arr.shape[:-2], dtype=np.int32)))
    except LinAlgError:
        if check_errors:
            raise
        low = _each(arr, lambda i: lapack(arr).cholesky(arr[i]), arr.shape)
        low = mh(low) if upper else low
        return CholeskyExResult(wrap(low), wrap(_infos(arr, _not_positive_definite)))
