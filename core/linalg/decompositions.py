"""cholesky, qr, eigh, eigvalsh, svd and svdvals on LAPACK (numpy on cpu, cupy on cuda), with
torch's backward formulas (FunctionsManual.cpp's, written on arrays) and torch's errors."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import scipy.linalg

from shoal.core.autograd_function import Function, once_differentiable
from shoal.core.grad_mode import grad_mode
from shoal.core.linalg._common import (
    LinAlgError, check_matrix, check_square, first_failure, lapack, mh, prefix, xp_of,
)
from shoal.core.ops._util import result
from shoal.core.tensor import Tensor, wrap


def _refuse_complex_grad(A: Tensor, op: str) -> None:
    """Multi-output functions' complex outputs carry no gradient in core's autograd.Function
    yet: refuse rather than return vectors that silently do not differentiate."""
    if A.array.dtype.kind == "c" and A.requires_grad and grad_mode.enabled:
        raise NotImplementedError(
            f"{op}: gradients of complex input are not supported yet (the real-valued "
            "eigvalsh, svdvals and matrix norms do support them).")


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


class _QR(Function):
    @staticmethod
    def forward(ctx: Any, A: Tensor, mode: str) -> tuple:
        arr = A.array
        q, r = lapack(arr).qr(arr, mode="complete" if mode == "complete" else "reduced")
        ctx.mode = mode
        ctx.q, ctx.r = q, r
        if mode == "r":
            return wrap(xp_of(arr).zeros((0,), dtype=arr.dtype)), wrap(r)
        return wrap(q), wrap(r)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gq: Tensor, gr: Tensor) -> Any:
        q, r = ctx.q, ctx.r
        m, n = q.shape[-2], r.shape[-1]
        if ctx.mode == "r":
            raise RuntimeError("The derivative of linalg.qr depends on Q, which is not computed "
                               "when mode='r'. Please use linalg.qr(A, mode='reduced') if you "
                               "are going to differentiate through linalg.qr.")
        if ctx.mode == "complete" and m > n:
            raise RuntimeError("The QR decomposition is not differentiable when mode='complete' "
                               "and nrows > ncols.")
        if m < n:
            raise NotImplementedError("linalg.qr: the gradient for wide matrices (nrows < ncols) "
                                      "is not supported yet.")
        xp = xp_of(q)
        gq_a, gr_a = gq.array, gr.array
        # torch's formula for m >= n: gA = (gQ + Q copyltu(M)) R^-H, M = R gR^H - gQ^H Q.
        big_m = r @ mh(gr_a) - mh(gq_a) @ q
        low = _tril(xp, big_m, -1)
        copyltu = low + mh(low) + _diag_embed(xp, xp.diagonal(big_m, 0, -2, -1).real)
        b = gq_a + q @ copyltu
        return wrap(mh(lapack(r).solve(r, mh(b)))), None


def qr(A: Tensor, mode: str = "reduced") -> QRResult:
    """(Q, R) with A = Q R; mode 'reduced', 'complete' or 'r' (Q empty), as torch."""
    check_matrix(A, "linalg.qr")
    _refuse_complex_grad(A, "linalg.qr")
    if mode not in ("reduced", "complete", "r"):
        raise RuntimeError(f"qr received unrecognized mode '{mode}' but expected one of "
                           "'reduced' (default), 'r', or 'complete'")
    return QRResult(*_QR.apply(A, mode))


class EighResult(NamedTuple):
    """torch.return_types.linalg_eigh."""

    eigenvalues: Tensor
    eigenvectors: Tensor


def _check_uplo(uplo: str) -> None:
    if uplo not in ("L", "U"):
        raise RuntimeError(f"Expected UPLO argument to be 'L' or 'U', but got {uplo}")


class _Eigh(Function):
    @staticmethod
    def forward(ctx: Any, A: Tensor, uplo: str) -> tuple:
        w, v = lapack(A.array).eigh(A.array, UPLO=uplo)
        ctx.w, ctx.v = w, v
        return wrap(w), wrap(v)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gw: Tensor, gv: Tensor) -> Any:
        return wrap(_eigh_grad(ctx.w, ctx.v, gw.array, gv.array)), None


def _eigh_grad(w: Any, v: Any, gw: Any, gv: Any) -> Any:
    """torch's Hermitian case: gA = V (skew(V^H gV) / E + diag(gL)) V^H, E_ij = L_j - L_i."""
    xp = xp_of(v)
    vhgv = mh(v) @ gv
    vhgv = 0.5 * (vhgv - mh(vhgv))
    e = w[..., None, :] - w[..., :, None]
    idx = xp.arange(w.shape[-1])
    e[..., idx, idx] = 1
    inner = vhgv / e
    inner[..., idx, idx] = gw
    return v @ inner @ mh(v)


def eigh(A: Tensor, UPLO: str = "L") -> EighResult:
    """Eigenvalues (ascending) and eigenvectors of Hermitian matrices, from one triangle."""
    check_square(A, "linalg.eigh")
    _refuse_complex_grad(A, "linalg.eigh")
    _check_uplo(UPLO)
    return EighResult(*_Eigh.apply(A, UPLO))


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


class _SVD(Function):
    @staticmethod
    def forward(ctx: Any, A: Tensor, full_matrices: bool) -> tuple:
        u, s, vh = lapack(A.array).svd(A.array, full_matrices=full_matrices)
        ctx.usv = u, s, vh
        return wrap(u), wrap(s), wrap(vh)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gu: Tensor, gs: Tensor, gvh: Tensor) -> Any:
        return wrap(svd_grad(*ctx.usv, gu.array, gs.array, gvh.array)), None


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
    check_matrix(A, "linalg.svd")
    _refuse_complex_grad(A, "linalg.svd")
    if driver is not None:
        raise RuntimeError("torch.linalg.svd: keyword argument `driver=` is only supported on "
                           "CUDA inputs with cuSOLVER backend.")
    return SVDResult(*_SVD.apply(A, full_matrices))


def svdvals(A: Tensor, *, driver: str | None = None) -> Tensor:
    """The singular values, descending."""
    arr = check_matrix(A, "linalg.svdvals")
    if not A.requires_grad:
        return wrap(lapack(arr).svd(arr, compute_uv=False))
    u, s, vh = lapack(arr).svd(arr, full_matrices=False)

    def backward(g: Any) -> tuple:
        return ((u * g[..., None, :]) @ vh,)

    return result(s, "LinalgSvdBackward", backward, (A,))
