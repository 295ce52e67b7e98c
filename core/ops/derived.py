"""torch's everyday ops that core lacked: sin/cos/tan, mm/bmm, norm, narrow, repeat, multi_dot.

sin, cos and tan carry their own backward; the rest check torch's argument rules and then
compose core's ops, so their gradients are those ops' gradients.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from shoal.core.ops import arith, linalg, reduce, shape, unary
from shoal.core.ops._promote import floating
from shoal.core.ops._opmath import narrow as _round, widen_bf16
from shoal.core.ops._util import cj, result, xp_of
from shoal.core.tensor import Tensor


def sin(x: Tensor) -> Tensor:
    """Elementwise sine."""
    xd = floating(x.array)
    dt = xd.dtype
    out = _round(xp_of(xd).sin(widen_bf16(xd)), dt)

    def backward(g: Any) -> tuple:
        return (_round(widen_bf16(g) * cj(xp_of(xd).cos(widen_bf16(xd))), dt),)

    return result(out, "SinBackward", backward, (x,))


def cos(x: Tensor) -> Tensor:
    """Elementwise cosine."""
    xd = floating(x.array)
    dt = xd.dtype
    out = _round(xp_of(xd).cos(widen_bf16(xd)), dt)

    def backward(g: Any) -> tuple:
        return (_round(-widen_bf16(g) * cj(xp_of(xd).sin(widen_bf16(xd))), dt),)

    return result(out, "CosBackward", backward, (x,))


def tan(x: Tensor) -> Tensor:
    """Elementwise tangent."""
    xd = floating(x.array)
    dt = xd.dtype
    out = _round(xp_of(xd).tan(widen_bf16(xd)), dt)

    def backward(g: Any) -> tuple:
        t = cj(widen_bf16(out))
        return (_round(widen_bf16(g) * (1 + t * t), dt),)

    return result(out, "TanBackward", backward, (x,))


def mm(x: Tensor, y: Tensor) -> Tensor:
    """Matrix product of two 2-D tensors."""
    if x.ndim != 2:
        raise RuntimeError("self must be a matrix")
    if y.ndim != 2:
        raise RuntimeError("mat2 must be a matrix")
    if x.shape[1] != y.shape[0]:
        raise RuntimeError(
            f"mat1 and mat2 shapes cannot be multiplied ({x.shape[0]}x{x.shape[1]} and "
            f"{y.shape[0]}x{y.shape[1]})"
        )
    return linalg.matmul(x, y)


def bmm(x: Tensor, y: Tensor) -> Tensor:
    """Batched matrix product of two 3-D tensors."""
    if x.ndim != 3:
        raise RuntimeError("batch1 must be a 3D tensor")
    if y.ndim != 3:
        raise RuntimeError("batch2 must be a 3D tensor")
    return linalg.matmul(x, y)


def norm(x: Tensor, p: Any = "fro", dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Tensor:
    """torch.norm: the p-norm over dim (all elements when None); 'fro' is the 2-norm."""
    if dtype is not None:
        x = x.to(dtype)
    if p in ("fro", 2, 2.0):
        return unary.sqrt(reduce.sum(arith.mul(x, x), dim, keepdim))
    if p == math.inf:
        return reduce.amax(unary.abs(x), dim, keepdim)
    if p == -math.inf:
        return reduce.amin(unary.abs(x), dim, keepdim)
    if p in (1, 1.0):
        return reduce.sum(unary.abs(x), dim, keepdim)
    if isinstance(p, str):
        raise RuntimeError(f"norm(): unsupported p {p!r} (shoal has 'fro' and numbers).")
    return arith.pow(reduce.sum(arith.pow(unary.abs(x), p), dim, keepdim), 1.0 / p)


def narrow(x: Tensor, dim: int, start: Any, length: int) -> Tensor:
    """The view x[..., start:start + length, ...] along dim."""
    ndim = x.ndim
    if not -ndim <= dim < ndim:
        raise IndexError(
            f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {dim})"
        )
    dim %= ndim
    start = int(start)
    size = x.shape[dim]
    if start < 0:
        start += size
    if not 0 <= start <= size or length < 0 or start + length > size:
        raise RuntimeError(f"start ({start}) + length ({length}) exceeds dimension size ({size}).")
    index = (slice(None),) * dim + (slice(start, start + length),)
    return shape.getitem(x, index)


def repeat(x: Tensor, *sizes: Any) -> Tensor:
    """Tile x: sizes[i] copies along dim i (leading new dims when sizes outnumber dims)."""
    reps = tuple(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)) else sizes
    if len(reps) < x.ndim:
        raise RuntimeError(
            "Number of dimensions of repeat dims can not be smaller than number of dimensions "
            "of tensor"
        )
    lead = len(reps) - x.ndim
    src = shape.reshape(x, (1,) * lead + tuple(x.shape))
    xd = src.array
    out = xp_of(xd).tile(xd, reps)

    def backward(g: Any) -> tuple:
        # Split every dim into (copy, original) and sum the copies away.
        split = tuple(n for r, s in zip(reps, xd.shape) for n in (r, s))
        return (g.reshape(split).sum(axis=tuple(range(0, 2 * len(reps), 2))),)

    return result(out, "RepeatBackward", backward, (src,))


def multi_dot(tensors: Sequence[Tensor]) -> Tensor:
    """torch.linalg.multi_dot: the product of a chain of matrices (1-D ends as vectors)."""
    if len(tensors) < 2:
        raise RuntimeError(
            f"multi_dot(): expected at least 2 tensors but got {len(tensors)}"
        )
    for i, t in enumerate(tensors):
        wanted = (1, 2) if i in (0, len(tensors) - 1) else (2,)
        if t.ndim not in wanted:
            raise RuntimeError(
                f"multi_dot(): tensor {i} must be {' or '.join(f'{w}D' for w in wanted)} "
                f"but got {t.ndim}D"
            )
    out = tensors[0]
    for t in tensors[1:]:
        out = linalg.matmul(out, t)
    return out
