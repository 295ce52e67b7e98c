"""det, slogdet, inv, solve and matrix_power: LU-based functions, with torch's errors for
singular input and gradients (each op's forward and backward side by side)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import scipy.linalg

from shoal.core.linalg._common import (
    LinAlgError, check_square, first_failure, lapack, mh, prefix, xp_of,
)
from shoal.core.ops import linalg as ops_linalg
from shoal.core.ops import shape as shape_ops
from shoal.core.ops._util import result, unbroadcast
from shoal.core.tensor import Tensor


def _zero_pivot(m: Any) -> int:
    """1-based index of LU's first zero diagonal element (LAPACK getrf's info), 0 if none."""
    if not isinstance(m, np.ndarray):
        m = m.get()
    (getrf,) = scipy.linalg.lapack.get_lapack_funcs(("getrf",), (m,))
    _, _, info = getrf(m)
    return int(info)


def _singular(op: str, arr: Any, what: str) -> LinAlgError:
    index, pivot = first_failure(arr, _zero_pivot)
    where = prefix(index, arr.shape[:-2])
    if what == "inv":
        return LinAlgError(f"{op}: {where}The diagonal element {pivot} is zero, the inversion "
                           "could not be completed because the input matrix is singular.")
    return LinAlgError(f"{op}: {where}The solver failed because the input matrix is singular.")


def _inverse(arr: Any, op: str) -> Any:
    """inv on arrays, with torch's error for a singular matrix (cupy: a non-finite result)."""
    try:
        out = lapack(arr).inv(arr)
    except np.linalg.LinAlgError as exc:
        raise _singular(op, arr, "inv") from exc
    if not isinstance(arr, np.ndarray) and not bool(xp_of(out).isfinite(out).all()):
        raise LinAlgError(f"{op}: the input matrix is singular (the inverse is not finite).")
    return out


def inv(A: Tensor) -> Tensor:
    """The inverse of each square matrix; LinAlgError when one is singular."""
    arr = check_square(A, "linalg.inv")
    out = _inverse(arr, "linalg.inv")

    def backward(g: Any) -> tuple:
        xh = mh(out)
        return (-(xh @ g @ xh),)

    return result(out, "LinalgInvExBackward", backward, (A,))


def det(A: Tensor) -> Tensor:
    """The determinant of each square matrix."""
    arr = check_square(A, "linalg.det")
    out = lapack(arr).det(arr)

    def backward(g: Any) -> tuple:
        return (g[..., None, None] * mh(_adjugate(arr, out)),)

    return result(xp_of(arr).asarray(out, dtype=arr.dtype), "LinalgDetBackward", backward, (A,))


def _adjugate(arr: Any, d: Any) -> Any:
    """adj(A) = det(A) A^-1, also for singular A (through the SVD, as torch's backward does)."""
    xp = xp_of(arr)
    if bool((d != 0).all()):
        return d[..., None, None] * lapack(arr).inv(arr)
    u, s, vh = lapack(arr).svd(arr)
    n = s.shape[-1]
    others = xp.stack([xp.prod(xp.delete(s, i, axis=-1), axis=-1) for i in range(n)], axis=-1)
    phase = lapack(arr).det(u) * lapack(arr).det(vh)
    return phase[..., None, None] * ((mh(vh) * others[..., None, :]) @ mh(u))


class SlogdetResult(NamedTuple):
    """torch.return_types.linalg_slogdet."""

    sign: Tensor
    logabsdet: Tensor


def slogdet(A: Tensor) -> SlogdetResult:
    """(sign, log|det|) of each square matrix; the gradient flows through logabsdet (and, for
    complex input, through the sign's phase)."""
    arr = check_square(A, "linalg.slogdet")
    sign, logabs = lapack(arr).slogdet(arr)
    xp = xp_of(arr)

    def back_logabs(g: Any) -> tuple:
        return (g[..., None, None] * mh(_inverse(arr, "linalg.slogdet")),)

    def back_sign(g: Any) -> tuple:
        if arr.dtype.kind != "c":
            return (None,)  # a real sign is piecewise constant: torch gives no gradient
        # sign = det/|det| moves with the phase of det: d(sign) = i sign Im(tr(A^-1 dA)),
        # so the gradient is i Im(conj(sign) g) A^-H (torch's slogdet_backward).
        phase = 1j * (xp.conj(sign) * g).imag
        return (phase[..., None, None] * mh(_inverse(arr, "linalg.slogdet")),)

    return SlogdetResult(result(xp.asarray(sign), "LinalgSlogdetBackward", back_sign, (A,),
                                exact_dtype=True),
                         result(xp.asarray(logabs), "LinalgSlogdetBackward", back_logabs, (A,),
                                exact_dtype=True))


def _as_matrix_rhs(a: Any, b: Any, op: str) -> tuple[Any, bool]:
    """B as (..., n, k): torch takes B as a vector when B.ndim == 1, or B's shape is A's
    minus its last dim."""
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])
    rhs = b[..., None] if vector else b
    if rhs.shape[-2] != a.shape[-1]:
        raise RuntimeError(f"{op}: Incompatible shapes of A and B for the equation AX = B "
                           f"({a.shape[-2]}x{a.shape[-1]} and {rhs.shape[-2]}x{rhs.shape[-1]})")
    return rhs, vector


def _solve(a: Any, rhs: Any, op: str) -> Any:
    xp = xp_of(a)
    batch = np.broadcast_shapes(a.shape[:-2], rhs.shape[:-2])
    a_b = xp.broadcast_to(a, (*batch, *a.shape[-2:]))
    r_b = xp.broadcast_to(rhs, (*batch, *rhs.shape[-2:]))
    try:
        out = lapack(a).solve(a_b, r_b)
    except np.linalg.LinAlgError as exc:
        raise _singular(op, a_b, "solve") from exc
    if not isinstance(a, np.ndarray) and not bool(xp.isfinite(out).all()):
        raise LinAlgError(f"{op}: The solver failed because the input matrix is singular.")
    return out


def solve(A: Tensor, B: Tensor, *, left: bool = True) -> Tensor:
    """X with A X = B (X A = B when left=False) for square A; LinAlgError when A is singular."""
    a = check_square(A, "linalg.solve")
    b = B.array
    if not left:
        a, b = a.swapaxes(-1, -2), b.swapaxes(-1, -2)  # X A = B is A^T X^T = B^T
    rhs, vector = _as_matrix_rhs(a, b, "linalg.solve")
    x = _solve(a, rhs.astype(np.result_type(a, rhs), copy=False), "torch.linalg.solve")

    def backward(g: Any) -> tuple:
        gm = g.swapaxes(-1, -2) if not left else g
        gm = gm[..., None] if vector else gm
        gb = _solve(mh(a), gm, "torch.linalg.solve")
        ga = -(gb @ mh(x))
        ga = unbroadcast(ga, a.shape)
        gb = unbroadcast(gb[..., 0] if vector else gb, b.shape)
        if not left:
            ga, gb = ga.swapaxes(-1, -2), gb.swapaxes(-1, -2)
        return ga, gb

    out = x[..., 0] if vector else x
    return result(out.swapaxes(-1, -2) if not left else out, "LinalgSolveExBackward", backward,
                  (A, B))


def matrix_power(A: Tensor, n: int) -> Tensor:
    """A to the integer power n (n < 0 inverts first), by repeated squaring of matmuls."""
    arr = check_square(A, "linalg.matrix_power")
    if not isinstance(n, int):
        raise TypeError(f"matrix_power(): argument 'n' must be int, not {type(n).__name__}")
    if n == 0:  # the identity, recorded with a zero gradient as torch's
        xp = xp_of(arr)
        eye = xp.broadcast_to(xp.eye(arr.shape[-1], dtype=arr.dtype), arr.shape).copy()
        return result(eye, "LinalgMatrixPowerBackward", lambda g: (xp.zeros_like(g),), (A,))
    base = inv(A) if n < 0 else A
    n = abs(n)
    out = None
    while n:
        if n & 1:
            out = base if out is None else ops_linalg.matmul(out, base)
        n >>= 1
        if n:
            base = ops_linalg.matmul(base, base)
    return out if out is not A else shape_ops.clone(out)
