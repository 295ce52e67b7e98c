"""vector_norm, matrix_norm, norm and cross, with torch's argument rules and gradients."""

from __future__ import annotations

import math
from typing import Any

from shoal.core import dtypes
from shoal.core.linalg._common import check_float, torch_dtype_name, xp_of
from shoal.core.linalg.decompositions import svdvals
from shoal.core.ops import reduce, unary
from shoal.core.ops import shape as shape_ops
from shoal.core.ops._util import norm_dims, result
from shoal.core.tensor import Tensor


def _cast(x: Tensor, dtype: Any, op: str) -> Tensor:
    check_float(x, op)
    if dtype is None:
        return x
    want = dtypes.get(dtype)
    if want.np.kind not in "fc" or (x.array.dtype.kind == "c") != (want.np.kind == "c"):
        raise RuntimeError(f"{op}: dtype should be {'complex' if x.array.dtype.kind == 'c' else 'floating point'}"
                           f", but got {torch_dtype_name(want.np)}")
    return x.to(want)


def vector_norm(x: Tensor, ord: float = 2, dim: Any = None, keepdim: bool = False,  # noqa: A002
                *, dtype: Any = None) -> Tensor:
    """The ord-norm of the elements over dim (all of them when None), as torch.linalg."""
    x = _cast(x, dtype, "linalg.vector_norm")
    if isinstance(ord, str):
        raise RuntimeError(f"linalg.vector_norm: ord must be a number, got {ord!r}")
    if ord in (math.inf, -math.inf):
        return (reduce.amax if ord > 0 else reduce.amin)(unary.abs(x), dim, keepdim)
    xd = x.array
    xp = xp_of(xd)
    axes = norm_dims(dim, xd.ndim, "linalg.vector_norm") if dim is not None else None
    if axes == ():
        axes = None
    mag = xp.abs(xd)
    if ord == 0:  # a count: recorded, with no gradient, as torch's
        count = xp.asarray((mag != 0).sum(axis=axes, keepdims=keepdim), dtype=mag.dtype)
        return result(count, "LinalgVectorNormBackward", lambda g: (None,), (x,))
    if ord == 2:
        out = xp.sqrt((mag * mag).sum(axis=axes, keepdims=keepdim))
    elif ord == 1:
        out = mag.sum(axis=axes, keepdims=keepdim)
    else:
        out = (mag ** ord).sum(axis=axes, keepdims=keepdim) ** (1.0 / ord)
    out = xp.asarray(out, dtype=mag.dtype)

    def backward(g: Any) -> tuple:
        gk = g if keepdim or axes is None else xp.expand_dims(g, axes)
        nk = out if keepdim or axes is None else xp.expand_dims(out, axes)
        sgn = xd / xp.where(mag == 0, 1, mag)  # x/|x|, 0 at 0 (torch's sgn)
        if ord == 1:
            return (sgn * gk,)
        with_zero = nk == 0
        scale = gk / xp.where(with_zero, 1, nk ** (ord - 1))
        grad = sgn * mag ** (ord - 1) * xp.where(with_zero, 0, scale)
        return (grad.astype(xd.dtype, copy=False),)

    return result(out, "LinalgVectorNormBackward", backward, (x,))


def _move_to_end(x: Tensor, d0: int, d1: int) -> Tensor:
    nd = x.ndim
    d0, d1 = d0 % nd, d1 % nd
    order = [i for i in range(nd) if i not in (d0, d1)] + [d0, d1]
    return shape_ops.permute(x, order)


def matrix_norm(A: Tensor, ord: Any = "fro", dim: tuple = (-2, -1), keepdim: bool = False,  # noqa: A002
                *, dtype: Any = None) -> Tensor:
    """'fro', 'nuc', inf, -inf, 1, -1, 2 or -2 matrix norm over the two dims `dim`."""
    A = _cast(A, dtype, "linalg.matrix_norm")
    if A.ndim < 2:
        raise RuntimeError("linalg.matrix_norm: The input tensor A must have at least 2 "
                           "dimensions.")
    d0, d1 = norm_dims(tuple(dim), A.ndim, "linalg.matrix_norm")
    if d0 == d1:
        raise RuntimeError(f"linalg.matrix_norm: dims must be different. Got ({dim[0]}, "
                           f"{dim[1]})")
    if ord == "fro":
        return vector_norm(A, 2, (d0, d1), keepdim)
    if ord in ("nuc", 2, -2):
        s = svdvals(_move_to_end(A, d0, d1))
        out = reduce.sum(s, -1) if ord == "nuc" else (
            reduce.amax(s, -1) if ord == 2 else reduce.amin(s, -1))
        if keepdim:
            out = shape_ops.unsqueeze(shape_ops.unsqueeze(out, min(d0, d1)), max(d0, d1))
        return out
    if ord in (1, -1, math.inf, -math.inf):
        sum_dim, max_dim = (d0, d1) if ord in (1, -1) else (d1, d0)
        sums = reduce.sum(unary.abs(A), sum_dim, True)
        out = (reduce.amax if ord > 0 else reduce.amin)(sums, max_dim, True)
        return out if keepdim else shape_ops.squeeze(out, (d0, d1))
    raise RuntimeError(f"linalg.matrix_norm: Order {ord} not supported.")


def norm(A: Tensor, ord: Any = None, dim: Any = None, keepdim: bool = False, *,  # noqa: A002
         dtype: Any = None) -> Tensor:
    """torch.linalg.norm: a vector norm, or a matrix norm for 2-D input or a 2-tuple dim."""
    if isinstance(dim, int):
        dim = (dim,)
    if dim is not None and len(dim) == 2:
        return matrix_norm(A, "fro" if ord is None else ord, dim, keepdim, dtype=dtype)
    if dim is None and ord is not None:
        if A.ndim not in (1, 2):
            raise RuntimeError("linalg.norm: If dim is not specified but ord is, the input must "
                               f"be 1D or 2D. Got {A.ndim}D.")
        if A.ndim == 2:
            return matrix_norm(A, ord, (-2, -1), keepdim, dtype=dtype)
    if isinstance(ord, str):
        raise RuntimeError(f"linalg.vector_norm: ord {ord!r} is a matrix norm; pass a 2-tuple "
                           "dim.")
    return vector_norm(A, 2 if ord is None else ord, dim, keepdim, dtype=dtype)


def cross(input: Tensor, other: Tensor, *, dim: int = -1) -> Tensor:  # noqa: A002
    """The cross product of 3-vectors along dim (broadcasting the other dims)."""
    a, b = input, other
    if a.ndim != b.ndim:
        raise RuntimeError(f"linalg.cross: inputs must have the same number of dimensions. "
                           f"Got {a.ndim} and {b.ndim}")
    if a.shape[dim] != 3 or b.shape[dim] != 3:
        raise RuntimeError(f"linalg.cross: inputs dimension {dim} must have length 3. Got "
                           f"{a.shape[dim]} and {b.shape[dim]}")
    d = dim % a.ndim
    lead = (slice(None),) * d

    def part(t: Tensor, i: int) -> Tensor:
        return shape_ops.getitem(t, (*lead, i))

    a0, a1, a2 = (part(a, i) for i in range(3))
    b0, b1, b2 = (part(b, i) for i in range(3))
    comps = [a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0]
    return shape_ops.stack(comps, d)
