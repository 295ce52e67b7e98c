"""cholesky, qr, eigh, eigvalsh, svd and svdvals on LAPACK (numpy on cpu, cupy on cuda), with
torch's backward formulas (FunctionsManual.cpp's, written on arrays) and torch's errors."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import scipy.linalg

from shoal.core.linalg._common import (
    LinAlgError, check_matrix, check_square, first_failure, lapack, mh, prefix, xp_of,
)
from shoal.core.ops._util import result
from shoal.core.tensor import Tensor, wrap


def _not_positive_definite(m: Any) -> int:
    """The order of the first leading minor that is not positive-definite (potrf's info)."""
    if not isinstance(m, np.ndarray):
        m = m.get()
    (potrf,) = scipy.linalg.lapack.get_lapack_funcs(("potrf",), (m,))
    _, info = potrf(m, lower=True)
    return int(info)


def _tril(xp: Any, a: Any, k: int = 0) -> Any:
    return xp.tril(a, k) if a.ndim == 2 else a * xp.tri(a.shape[-2], a.shape[-1], k, dtype=bool)


def _diag_embed(xp: Any, d: Any) -> Any:
    n = d.shape[-1]
    out = xp.zeros((*d.shape, n), dtype=d.dtype)
    idx = xp.arange(n)
    out[..., idx, idx] = d
    return out


def cholesky(A: Tensor, *, upper: bool = False) -> Tensor:
    """L with A = L L^H for Hermitian positive-definite A (U = L^H with upper=True)."""
    arr = check_square(A, "linalg.cholesky")
    try:
        low = lapack(arr).cholesky(arr)
    except np.linalg.LinAlgError as exc:
        index, order = first_failure(arr, _not_positive_definite)
        raise LinAlgError(
            f"linalg.cholesky: {prefix(index, arr.shape[:-2])}The factorization could not be "
            "completed because the input is not positive-definite (the leading minor of order "
            f"{order} is not positive-definite).") from exc
    xp = xp_of(arr)

    def backward(g: Any) -> tuple:
        gl = mh(g) if upper else g
        phi = _tril(xp, mh(low) @ gl)
        idx = xp.arange(phi.shape[-1])
        phi[..., idx, idx] *= 0.5
        # gA = L^-H phi L^-1, symmetrised: two triangular solves written as general ones.
        left = lapack(arr).solve(mh(low), phi)
        ga = mh(lapack(arr).solve(mh(low), mh(left)))
        return (0.5 * (ga + mh(ga)),)

    return result(mh(low) if upper else low, "LinalgCholeskyExBackward", backward, (A,))


class QRResult(NamedTuple):
    """torch.return_types.linalg_qr."""

    Q: Tensor
    R: Tensor


def _qr_grad(q: Any, r: Any, gq: Any, gr: Any) -> Any:
    """torch's formula for m >= n: gA = (gQ + Q copyltu(M)) R^-H, M = R gR^H - gQ^H Q. It is
    linear in (gQ, gR), so Q's and R's nodes each apply it with the other's gradient at 0."""
    xp = xp_of(q)
    big_m = (r @ mh(gr) if gr is not None else 0) - (mh(gq) @ q if gq is not None else 0)
    low = _tril(xp, big_m, -1)
    copyltu = low + mh(low) + _diag_embed(xp, xp.diagonal(big_m, 0, -2, -1).real)
    b = q @ copyltu if gq is None else gq + q @ copyltu
    return mh(lapack(r).solve(r, mh(b)))


def _qr_check(mode: str, m: int, n: int) -> None:
    """torch's refusals, raised by backward as torch raises them."""
    if mode == "r":
        raise RuntimeError("The derivative of linalg.qr depends on Q, which is not computed "
                           "when mode='r'. Please use linalg.qr(A, mode='reduced') if you "
                           "are going to differentiate through linalg.qr.")
    if mode == "complete" and m > n:
        raise RuntimeError("The QR decomposition is not differentiable when mode='complete' "
                           "and nrows > ncols.")
    if m < n:
        raise NotImplementedError("linalg.qr: the gradient for wide matrices (nrows < ncols) "
                                  "is not supported yet.")


def qr(A: Tensor, mode: str = "reduced") -> QRResult:
    """(Q, R) with A = Q R; mode 'reduced', 'complete' or 'r' (Q empty), as torch."""
    arr = check_matrix(A, "linalg.qr")
    if mode not in ("reduced", "complete", "r"):
        raise RuntimeError(f"qr received unrecognized mode '{mode}' but expected one of "
                           "'reduced' (default), 'r', or 'complete'")
    q, r = lapack(arr).qr(arr, mode="complete" if mode == "complete" else "reduced")
    m, n = arr.shape[-2], arr.shape[-1]

    def back_q(g: Any) -> tuple:
        _qr_check(mode, m, n)
        return (_qr_grad(q, r, g, None),)

    def back_r(g: Any) -> tuple:
        _qr_check(mode, m, n)
        return (_qr_grad(q, r, None, g),)

    q_out = xp_of(arr).zeros((0,), dtype=arr.dtype) if mode == "r" else q
    return QRResult(result(q_out, "LinalgQrBackward", back_q, (A,)),
                    result(r, "LinalgQrBackward", back_r, (A,)))


class EighResult(NamedTuple):
    """torch.return_types.linalg_eigh."""

    eigenvalues: Tensor
    eigenvectors: Tensor


def _check_uplo(uplo: str) -> None:
    if uplo not in ("L", "U"):
        raise RuntimeError(f"Expected UPLO argument to be 'L' or 'U', but got {uplo}")


def _eigh_vector_grad(w: Any, v: Any, gv: Any) -> Any:
    """torch's Hermitian case for V's gradient: V (skew(V^H gV) / E) V^H, E_ij = L_j - L_i
    (the eigenvalues' part, V diag(gL) V^H, is their own node's)."""
    xp = xp_of(v)
    vhgv = mh(v) @ gv
    vhgv = 0.5 * (vhgv - mh(vhgv))
    e = w[..., None, :] - w[..., :, None]
    idx = xp.arange(w.shape[-1])
    e[..., idx, idx] = 1
    inner = vhgv / e
    inner[..., idx, idx] = 0
    return v @ inner @ mh(v)


def eigh(A: Tensor, UPLO: str = "L") -> EighResult:
    """Eigenvalues (ascending) and eigenvectors of Hermitian matrices, from one triangle."""
    arr = check_square(A, "linalg.eigh")
    _check_uplo(UPLO)
    w, v = lapack(arr).eigh(arr, UPLO=UPLO)

    def back_w(g: Any) -> tuple:
        return ((v * g[..., None, :]) @ mh(v),)

    def back_v(g: Any) -> tuple:
        return (_eigh_vector_grad(w, v, g),)

    return EighResult(result(w, "LinalgEighBackward", back_w, (A,), exact_dtype=True),
                      result(v, "LinalgEighBackward", back_v, (A,)))


def eigvalsh(A: Tensor, UPLO: str = "L") -> Tensor:
    """Eigenvalues (ascending) of Hermitian matrices."""
    arr = check_square(A, "linalg.eigvalsh")
    _check_uplo(UPLO)
    if not A.requires_grad:
        return wrap(lapack(arr).eigvalsh(arr, UPLO=UPLO))
    w, v = lapack(arr).eigh(arr, UPLO=UPLO)

    def backward(g: Any) -> tuple:
        return ((v * g[..., None, :]) @ mh(v),)

    return result(w, "LinalgEighBackward", backward, (A,))


class SVDResult(NamedTuple):
    """torch.return_types.linalg_svd."""

    U: Tensor
    S: Tensor
    Vh: Tensor


def svd_grad(u: Any, s: Any, vh: Any, gu: Any, gs: Any, gvh: Any) -> Any:
    """torch's svd_backward (real and complex without the phase term): full matrices are
    narrowed to the k = min(m, n) singular vectors first, as torch does."""
    xp = xp_of(s)
    k = s.shape[-1]
    u, vh = u[..., :k], vh[..., :k, :]
    gu, gvh = gu[..., :k], gvh[..., :k, :]
    m, n = u.shape[-2], vh.shape[-1]
    idx = xp.arange(k)
    uhgu = mh(u) @ gu
    uhgu = uhgu - mh(uhgu)
    vhgv = vh @ mh(gvh)
    vhgv = vhgv - mh(vhgv)
    s2 = s * s
    e = s2[..., None, :] - s2[..., :, None]
    e[..., idx, idx] = 1
    inner = (uhgu * s[..., None, :] + s[..., :, None] * vhgv) / e
    inner[..., idx, idx] = gs
    if m > n:
        gus = gu / s[..., None, :]
        return (u @ inner + gus - u @ (mh(u) @ gus)) @ vh
    if m < n:
        gvs = mh(gvh) / s[..., None, :]
        return u @ (inner @ vh + mh(gvs) - (mh(gvs) @ mh(vh)) @ vh)
    return u @ inner @ vh


def svd(A: Tensor, full_matrices: bool = True, *, driver: str | None = None) -> SVDResult:
    """(U, S, Vh) with A = U diag(S) Vh, singular values descending (LAPACK gesdd)."""
    arr = check_matrix(A, "linalg.svd")
    if driver is not None:
        raise RuntimeError("torch.linalg.svd: keyword argument `driver=` is only supported on "
                           "CUDA inputs with cuSOLVER backend.")
    u, s, vh = lapack(arr).svd(arr, full_matrices=full_matrices)
    zero_u, zero_s, zero_vh = (xp_of(arr).zeros_like(t) for t in (u, s, vh))

    # svd_grad is linear in (gU, gS, gVh): each output's node applies it with the others at 0.
    def back_u(g: Any) -> tuple:
        return (svd_grad(u, s, vh, g, zero_s, zero_vh),)

    def back_s(g: Any) -> tuple:
        return (svd_grad(u, s, vh, zero_u, g, zero_vh),)

    def back_vh(g: Any) -> tuple:
        return (svd_grad(u, s, vh, zero_u, zero_s, g),)

    return SVDResult(result(u, "LinalgSvdBackward", back_u, (A,)),
                     result(s, "LinalgSvdBackward", back_s, (A,), exact_dtype=True),
                     result(vh, "LinalgSvdBackward", back_vh, (A,)))


def svdvals(A: Tensor, *, driver: str | None = None) -> Tensor:
    """The singular values, descending."""
    arr = check_matrix(A, "linalg.svdvals")
    if not A.requires_grad:
        return wrap(lapack(arr).svd(arr, compute_uv=False))
    u, s, vh = lapack(arr).svd(arr, full_matrices=False)

    def backward(g: Any) -> tuple:
        return ((u * g[..., None, :]) @ vh,)

    return result(s, "LinalgSvdBackward", backward, (A,))
