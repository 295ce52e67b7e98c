"""torch's scans and the reductions core lacked: cumsum, cumprod, cummax, cummin,
logcumsumexp, diff, std, std_mean, var_mean, aminmax, nansum, nanmean (prod is in reduce.py).

Integer inputs of cumsum/cumprod/nansum accumulate in int64 as torch's do; std and the
means compose core's differentiable ops, so their gradients are those ops' gradients.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import numpy as np

from shoal.core import dtypes
from shoal.core.ops import arith, reduce, shape as _shape, unary
from shoal.core.ops._util import norm_dims, result, wrap, xp_of
from shoal.core.ops.indexing import dim_of
from shoal.core.tensor import Tensor

CumResult = namedtuple("cummax", ["values", "indices"])
AminmaxResult = namedtuple("aminmax", ["min", "max"])


def _acc_dtype(xd: Any, dtype: Any) -> Any:
    if dtype is not None:
        return dtypes.get(dtype).np
    return np.int64 if xd.dtype.kind in "biu" else None


def _reverse_cumsum(xp: Any, g: Any, axis: int) -> Any:
    return xp.flip(xp.cumsum(xp.flip(g, axis), axis), axis)


def cumsum(input: Tensor, dim: int, *, dtype: Any = None) -> Tensor:  # noqa: A002
    """Running sum along dim."""
    xd = input.array
    d = dim_of(dim, xd.ndim)
    xp = xp_of(xd)
    out = xp.cumsum(xd, axis=d, dtype=_acc_dtype(xd, dtype)) if xd.ndim else xd.copy()

    def backward(g: Any) -> tuple:
        return (_reverse_cumsum(xp, g, d) if xd.ndim else g,)

    return result(out, "CumsumBackward", backward, (input,), exact_dtype=True)


def cumprod(input: Tensor, dim: int, *, dtype: Any = None) -> Tensor:  # noqa: A002
    """Running product along dim."""
    xd = input.array
    d = dim_of(dim, xd.ndim)
    xp = xp_of(xd)
    out = xp.cumprod(xd, axis=d, dtype=_acc_dtype(xd, dtype)) if xd.ndim else xd.copy()

    def backward(g: Any) -> tuple:
        if not xd.ndim:
            return (g,)
        # d out_k / d x_i = prod_{j<=k, j!=i} x_j: the product of x with x_i left out, taken
        # prefix by prefix, which stays exact where x has zeros (no division by x_i).
        moved = xp.moveaxis(xd, d, -1)
        gm = xp.moveaxis(g, d, -1)
        n = moved.shape[-1]
        grad = xp.zeros_like(gm)
        for i in range(n):  # n dot products of length n: the scan's own size, not the batch's
            left = xp.prod(moved[..., :i], axis=-1, keepdims=True)
            right = xp.cumprod(moved[..., i + 1:], axis=-1)
            terms = xp.concatenate([xp.ones_like(left), right], axis=-1) * left
            grad[..., i] = (gm[..., i:] * terms).sum(axis=-1)
        return (xp.moveaxis(grad, -1, d),)

    return result(out, "CumprodBackward", backward, (input,), exact_dtype=True)


def _cum_extreme(input: Tensor, dim: int, largest: bool) -> Any:  # noqa: A002
    xd = input.array
    d = dim_of(dim, xd.ndim)
    xp = xp_of(xd)
    if not xd.ndim:
        return CumResult(result(xd.copy(), "CummaxBackward", lambda g: (g,), (input,)),
                         wrap(xp.zeros((), np.int64)))
    moved = xp.moveaxis(xd, d, -1)
    n = moved.shape[-1]
    positions = xp.broadcast_to(xp.arange(n), moved.shape)
    better = xp.greater_equal if largest else xp.less_equal
    best_val, best_pos = moved[..., :1].copy(), xp.zeros(moved.shape[:-1] + (1,), np.int64)
    picks = xp.empty(moved.shape, np.int64)
    for i in range(n):  # a scan: each step depends on the last (torch's kernel loops too)
        cur = moved[..., i:i + 1]
        take = better(cur, best_val) | xp.isnan(cur)
        take &= ~xp.isnan(best_val) | xp.isnan(cur)
        best_val = xp.where(take, cur, best_val)
        best_pos = xp.where(take, positions[..., i:i + 1], best_pos)
        picks[..., i] = best_pos[..., 0]
    picks = xp.moveaxis(picks, -1, d)
    values = xp.take_along_axis(xd, picks, axis=d)

    def backward(g: Any) -> tuple:
        grad = xp.zeros(xd.shape, g.dtype)
        where = list(xp.indices(picks.shape, sparse=True))
        where[d] = picks
        xp.add.at(grad, tuple(where), g)
        return (grad,)

    name = "CummaxBackward" if largest else "CumminBackward"
    cls = CumResult if largest else namedtuple("cummin", ["values", "indices"])
    return cls(result(values, name, backward, (input,)), wrap(picks))


def cummax(input: Tensor, dim: int) -> Any:  # noqa: A002
    """(running maximum, its position) along dim; the latest position wins ties, as in torch."""
    return _cum_extreme(input, dim, True)


def cummin(input: Tensor, dim: int) -> Any:  # noqa: A002
    """(running minimum, its position) along dim."""
    return _cum_extreme(input, dim, False)


def logcumsumexp(input: Tensor, dim: int) -> Tensor:  # noqa: A002
    """log(cumsum(exp(input))) along dim, computed without overflow."""
    xd = input.array
    d = dim_of(dim, xd.ndim)
    xp = xp_of(xd)
    out = xp.logaddexp.accumulate(xd, axis=d) if xd.ndim else xd.copy()

    def backward(g: Any) -> tuple:
        if not xd.ndim:
            return (g,)
        # grad_i = sum_{k>=i} g_k exp(x_i - out_k), shifted by the largest out for range.
        top = out.max(axis=d, keepdims=True) if out.size else 0
        scaled = _reverse_cumsum(xp, g * xp.exp(top - out), d)
        return (scaled * xp.exp(xd - top),)

    return result(out, "LogcumsumexpBackward", backward, (input,))


def diff(input: Tensor, n: int = 1, dim: int = -1, prepend: Any = None,  # noqa: A002
         append: Any = None) -> Tensor:
    """The n-th forward difference along dim, with optional tensors joined before/after."""
    if n < 0:
        raise RuntimeError(f"order must be non-negative but got {n}")
    d = dim_of(dim, input.ndim)
    x = input
    parts = [p for p in (prepend, x, append) if p is not None]
    if len(parts) > 1:
        x = _shape.cat(parts, d)
    for _ in range(n):
        size = x.shape[d]
        if size == 0:
            break
        hi = _shape.getitem(x, (slice(None),) * d + (slice(1, None),))
        lo = _shape.getitem(x, (slice(None),) * d + (slice(0, size - 1),))
        x = hi.logical_xor(lo) if x.array.dtype == np.bool_ else arith.sub(hi, lo)
    return x


def _correction(unbiased: Any, correction: Any) -> float:
    if correction is not None and unbiased is not None:
        raise RuntimeError("std/var: cannot take both unbiased and correction")
    if correction is not None:
        return float(correction)
    return 0.0 if unbiased is False else 1.0


def _dim_args(dim: Any, unbiased: Any) -> tuple:
    """torch's std(x, True) means unbiased=True, not dim=True."""
    if isinstance(dim, bool):
        return None, dim
    return dim, unbiased


def var(input: Tensor, dim: Any = None, unbiased: Any = None, keepdim: bool = False, *,  # noqa: A002
        correction: Any = None) -> Tensor:
    """Variance over dim with Bessel's correction unless told otherwise."""
    dim, unbiased = _dim_args(dim, unbiased)
    if dim is not None:  # torch's IndexError for a dim out of range, before any arithmetic
        for d in (dim,) if isinstance(dim, int) else dim:
            dim_of(d, input.ndim)
    return reduce.var(input, dim, keepdim, _correction(unbiased, correction))


def std(input: Tensor, dim: Any = None, unbiased: Any = None, keepdim: bool = False, *,  # noqa: A002
        correction: Any = None) -> Tensor:
    """Standard deviation over dim with Bessel's correction unless told otherwise."""
    return unary.sqrt(var(input, dim, unbiased, keepdim, correction=correction))


def var_mean(input: Tensor, dim: Any = None, unbiased: Any = None, keepdim: bool = False, *,  # noqa: A002
             correction: Any = None) -> tuple:
    """(var, mean) over dim."""
    d, _ = _dim_args(dim, unbiased)
    return (var(input, dim, unbiased, keepdim, correction=correction),
            reduce.mean(input, d, keepdim))


def std_mean(input: Tensor, dim: Any = None, unbiased: Any = None, keepdim: bool = False, *,  # noqa: A002
             correction: Any = None) -> tuple:
    """(std, mean) over dim."""
    d, _ = _dim_args(dim, unbiased)
    return (std(input, dim, unbiased, keepdim, correction=correction),
            reduce.mean(input, d, keepdim))


def aminmax(input: Tensor, *, dim: int | None = None, keepdim: bool = False) -> Any:  # noqa: A002
    """(amin, amax) over dim (all elements when None)."""
    if input.numel() == 0:
        raise RuntimeError("aminmax(): cannot compute aminmax over an empty dimension as the "
                           "operation has no identity.")
    return AminmaxResult(reduce.amin(input, dim, keepdim), reduce.amax(input, dim, keepdim))


def nansum(input: Tensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Tensor:  # noqa: A002
    """The sum over dim with NaN counted as zero."""
    xd = input.array
    mask = xp_of(xd).isnan(xd) if xd.dtype.kind in "fV" else None
    clean = input if mask is None else _masked_zero(input, mask)
    return reduce.sum(clean, dim, keepdim, dtype)


def nanmean(input: Tensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Tensor:  # noqa: A002
    """The mean over dim of the elements that are not NaN."""
    xd = input.array
    if xd.dtype.kind not in "fV":
        raise RuntimeError(f"nanmean(): expected input to have floating point dtype but got "
                           f"{xd.dtype.name}")
    mask = xp_of(xd).isnan(xd)
    dims = norm_dims(dim, xd.ndim, "nanmean")
    count = (~mask).sum(axis=dims, keepdims=keepdim).astype(xd.dtype)
    return arith.div(nansum(input, dim, keepdim, dtype=dtype), wrap(count))


def _masked_zero(x: Tensor, mask: Any) -> Tensor:
    from shoal.core.ops.indexing import masked_fill  # noqa: PLC0415 - sibling op module
    return masked_fill(x, wrap(mask), 0.0)
