"""pinv, matrix_rank and lstsq: the SVD-based (minimum-norm) answers, batched, with torch's
tolerance rules and gradients."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from shoal.core.linalg._common import check_matrix, lapack, mh, xp_of
from shoal.core.ops import linalg as ops_linalg
from shoal.core.ops import shape as shape_ops
from shoal.core.ops._util import result
from shoal.core.tensor import Tensor, wrap


def _tolerance(s: Any, m: int, n: int, atol: Any, rtol: Any) -> Any:
    """torch's cutoff: max(atol, rtol * largest singular value); rtol defaults to
    eps * max(m, n) when neither is given, to 0 when only atol is."""
    xp = xp_of(s)
    eps = np.finfo(s.dtype).eps
    atol_v = 0.0 if atol is None else (atol.array if isinstance(atol, Tensor) else atol)
    if rtol is None:  # torch: atol > 0 alone means rtol = 0
        rtol_v = eps * max(m, n) if atol is None or (np.ndim(atol) == 0 and atol == 0) else 0.0
    else:
        rtol_v = rtol.array if isinstance(rtol, Tensor) else rtol
    smax = s[..., :1] if s.shape[-1] else xp.zeros((*s.shape[:-1], 1), s.dtype)
    return xp.maximum(xp.asarray(atol_v)[..., None] if xp.ndim(atol_v) else atol_v,
                      (xp.asarray(rtol_v)[..., None] if xp.ndim(rtol_v) else rtol_v) * smax)


def _singular_values(arr: Any, hermitian: bool) -> tuple:
    """(U, s, Vh) with s descending: eigh for Hermitian input (|eigenvalues|), else gesdd."""
    xp = xp_of(arr)
    if not hermitian:
        return lapack(arr).svd(arr, full_matrices=False)
    w, v = lapack(arr).eigh(arr)
    order = xp.argsort(-xp.abs(w), axis=-1)
    w = xp.take_along_axis(w, order, -1)
    v = xp.take_along_axis(v, order[..., None, :], -1)
    return v * xp.sign(w)[..., None, :], xp.abs(w), mh(v)


def pinv(A: Tensor, *, atol: Any = None, rtol: Any = None, hermitian: bool = False) -> Tensor:
    """The Moore-Penrose pseudo-inverse, dropping singular values at or below the tolerance."""
    arr = check_matrix(A, "linalg.pinv")
    m, n = arr.shape[-2:]
    u, s, vh = _singular_values(arr, hermitian)
    keep = s > _tolerance(s, m, n, atol, rtol)
    inv_s = xp_of(s).where(keep, 1 / xp_of(s).where(keep, s, 1), 0).astype(arr.dtype)
    out = (mh(vh) * inv_s[..., None, :]) @ mh(u)

    def backward(g: Any) -> tuple:
        return (_pinv_grad(arr, out, g),)

    return result(out, "LinalgPinvBackward", backward, (A,))


def _pinv_grad(a: Any, p: Any, g: Any) -> Any:
    """The gradient of <G, pinv(A)> from dP = -P dA P + P P^H dA^H (I - A P)
    + (I - P A) dA^H P^H P (Golub and Pereyra): three terms, any shape and rank."""
    ph, gh = mh(p), mh(g)
    term1 = -(ph @ g @ ph)
    # (I - A P) G^H P P^H  (the component outside A's column space)
    x = gh @ p @ ph
    term2 = x - a @ (p @ x)
    # P^H P G^H (I - P A)  (the component outside A's row space)
    y = ph @ p @ gh
    term3 = y - (y @ p) @ a
    return term1 + term2 + term3


def matrix_rank(A: Tensor, *, atol: Any = None, rtol: Any = None, hermitian: bool = False) -> Tensor:
    """The number of singular values above the tolerance (int64)."""
    arr = check_matrix(A, "linalg.matrix_rank")
    m, n = arr.shape[-2:]
    xp = xp_of(arr)
    if hermitian:
        s = xp.sort(xp.abs(lapack(arr).eigvalsh(arr)), axis=-1)[..., ::-1]
    else:
        s = lapack(arr).svd(arr, compute_uv=False)
    return wrap(xp.asarray((s > _tolerance(s, m, n, atol, rtol)).sum(axis=-1), dtype=np.int64))


class LstsqResult(NamedTuple):
    """torch.return_types.linalg_lstsq."""

    solution: Tensor
    residuals: Tensor
    rank: Tensor
    singular_values: Tensor


_DRIVERS = ("gels", "gelsy", "gelsd", "gelss")


def lstsq(A: Tensor, B: Tensor, rcond: float | None = None, *,
          driver: str | None = None) -> LstsqResult:
    """The least-squares (minimum-norm) solution of A X = B, with torch's result fields per
    driver (gelsy by default on cpu: rank, no residuals or singular values)."""
    arr = check_matrix(A, "linalg.lstsq")
    driver = "gelsy" if driver is None else driver
    if driver not in _DRIVERS:
        raise RuntimeError(f"torch.linalg.lstsq: parameter `driver` should be one of "
                           f"(gels, gelsy, gelsd, gelss). Got {driver}")
    vector = B.ndim == A.ndim - 1
    rhs = shape_ops.unsqueeze(B, -1) if vector else B
    if rhs.shape[-2] != arr.shape[-2]:
        raise RuntimeError(f"torch.linalg.lstsq: input.size(-2) should match other.size(-2). "
                           f"Got {arr.shape[-2]} and {rhs.shape[-2]}")
    m, n = arr.shape[-2:]
    xp = xp_of(arr)
    s = lapack(arr).svd(arr, compute_uv=False)
    tol = _tolerance(s, m, n, None, rcond) if rcond is not None else _tolerance(
        s, m, n, None, None)
    rank = (s > tol).sum(axis=-1)
    solution = ops_linalg.matmul(pinv(A, rtol=rcond), rhs)
    empty = wrap(xp.zeros((0,), dtype=arr.dtype))
    residuals = empty
    if driver != "gelsy" and m > n and bool((rank == n).all()):
        diff = ops_linalg.matmul(A, solution) - rhs
        residuals = (diff * diff).sum(-2)
    out_rank = wrap(xp.zeros((0,), dtype=np.int64)) if driver == "gels" else wrap(
        xp.asarray(rank, dtype=np.int64))
    sv = wrap(s) if driver in ("gelsd", "gelss") else empty
    if vector:
        solution = shape_ops.squeeze(solution, -1)
    return LstsqResult(solution, residuals, out_rank, sv)
