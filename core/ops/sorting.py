"""torch's sorting and searching ops: sort, argsort, topk, kthvalue, median, mode, unique,
searchsorted, bucketize, histc, bincount, isin, count_nonzero, argwhere.

Ops that return values and positions give torch's named pairs ((values, indices)); the values'
gradient flows back to the positions they came from. Sorting is stable (equal elements keep
their order, descending too) and NaN sorts as the largest value, as in torch.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import numpy as np

from shoal.core.ops._util import result, val, wrap, xp_of
from shoal.core.ops.indexing import dim_of
from shoal.core.tensor import Tensor

SortResult = namedtuple("sort", ["values", "indices"])
TopkResult = namedtuple("topk", ["values", "indices"])
KthvalueResult = namedtuple("kthvalue", ["values", "indices"])
MedianResult = namedtuple("median", ["values", "indices"])
ModeResult = namedtuple("mode", ["values", "indices"])


def _order(xd: Any, dim: int, descending: bool) -> Any:
    """Stable positions that sort xd along dim (NaN last ascending, first descending)."""
    xp = xp_of(xd)
    if xd.ndim == 0:
        return xp.zeros((), np.int64)
    if not descending:
        return xp.argsort(xd, axis=dim, kind="stable")
    # Stable descending: sort the reversed axis ascending, reverse the result, and map the
    # positions back, so equal elements keep their original order.
    n = xd.shape[dim]
    rev = xp.flip(xd, axis=dim)
    return (n - 1 - xp.flip(xp.argsort(rev, axis=dim, kind="stable"), axis=dim)).astype(np.int64)


def _values_at(x: Tensor, dim: int, positions: Any, name: str, keep_shape: Any = None) -> Tensor:
    """x's elements at `positions` along dim, with the gradient scattered back to them."""
    xd = x.array
    xp = xp_of(xd)
    out = xp.take_along_axis(xd, positions, axis=dim) if xd.ndim else xd.copy()
    shape = keep_shape

    def backward(g: Any) -> tuple:
        grad = xp.zeros(xd.shape, g.dtype)
        if not xd.ndim:
            return (g,)
        gg = g.reshape(positions.shape) if shape is not None else g
        where = list(xp.indices(positions.shape, sparse=True))
        where[dim] = positions
        xp.add.at(grad, tuple(where), gg)
        return (grad,)

    if shape is not None:
        out = out.reshape(shape)
    return result(out, name, backward, (x,))


def sort(input: Tensor, dim: int = -1, descending: bool = False, *, stable: bool = False) -> Any:  # noqa: A002
    """(values, indices) of input sorted along dim."""
    d = dim_of(dim, input.ndim)
    positions = _order(input.array, d, descending)
    return SortResult(_values_at(input, d, positions, "SortBackward"), wrap(positions))


def argsort(input: Tensor, dim: int = -1, descending: bool = False, *, stable: bool = False) -> Tensor:  # noqa: A002
    """The positions that sort input along dim."""
    return wrap(_order(input.array, dim_of(dim, input.ndim), descending))


def topk(input: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:  # noqa: A002
    """The k largest (or smallest) elements along dim and their positions."""
    d = dim_of(dim, input.ndim)
    size = input.shape[d] if input.ndim else 1
    if not 0 <= k <= size:
        raise RuntimeError("selected index k out of range")
    positions = _order(input.array, d, largest)
    positions = positions[(slice(None),) * d + (slice(0, k),)] if input.ndim else positions
    return TopkResult(_values_at(input, d, positions, "TopkBackward"), wrap(positions))


def _reduced(input: Tensor, d: int, pick: Any, keepdim: bool, name: str, cls: Any) -> Any:  # noqa: A002
    """(values, indices) at one position per slice along d (pick: positions with d kept)."""
    shape = None if keepdim else tuple(n for i, n in enumerate(input.shape) if i != d)
    values = _values_at(input, d, pick, name, keep_shape=shape)
    return cls(values, wrap(pick if keepdim else pick.reshape(shape)))


def kthvalue(input: Tensor, k: int, dim: int = -1, keepdim: bool = False) -> Any:  # noqa: A002
    """The k-th smallest element along dim (k from 1) and its position."""
    d = dim_of(dim, input.ndim)
    size = input.shape[d] if input.ndim else 1
    if not 1 <= k <= size:
        raise RuntimeError(f"kthvalue(): selected number k out of range for dimension {dim}")
    positions = _order(input.array, d, False)
    if not input.ndim:
        return KthvalueResult(_values_at(input, 0, positions, "KthvalueBackward"), wrap(positions))
    pick = positions[(slice(None),) * d + (slice(k - 1, k),)]
    return _reduced(input, d, pick, keepdim, "KthvalueBackward", KthvalueResult)


def median(input: Tensor, dim: int | None = None, keepdim: bool = False) -> Any:  # noqa: A002
    """The lower median (torch's: the ((n-1)//2)-th smallest); with dim, (values, indices)."""
    if dim is None:
        flat = input.reshape(-1)
        if flat.numel() == 0:
            return wrap(xp_of(input.array).asarray(np.nan, input.array.dtype))
        positions = _order(flat.array, 0, False)
        xd = flat.array
        if xp_of(xd).isnan(xd).any():  # torch: any NaN makes the median NaN
            pick = positions[-1:]
        else:
            pick = positions[(xd.size - 1) // 2:(xd.size - 1) // 2 + 1]
        return _values_at(flat, 0, pick, "MedianBackward", keep_shape=())
    d = dim_of(dim, input.ndim)
    positions = _order(input.array, d, False)
    if not input.ndim:
        return MedianResult(_values_at(input, 0, positions, "MedianBackward"), wrap(positions))
    n = input.shape[d]
    xp = xp_of(positions)
    nan_rows = xp.isnan(input.array).any(axis=d, keepdims=True)
    mid = xp.where(nan_rows, n - 1, (n - 1) // 2)
    pick = xp.take_along_axis(positions, xp.broadcast_to(mid, nan_rows.shape), axis=d)
    return _reduced(input, d, pick, keepdim, "MedianBackward", MedianResult)


def mode(input: Tensor, dim: int = -1, keepdim: bool = False) -> Any:  # noqa: A002
    """The most frequent value along dim (the smallest among ties) and its last position."""
    d = dim_of(dim, input.ndim)
    xd = input.array
    xp = xp_of(xd)
    moved = xp.moveaxis(xd, d, -1) if xd.ndim else xd.reshape(1)
    rows = moved.reshape(-1, moved.shape[-1])
    picks = np.empty(rows.shape[0], np.int64)
    for r, row in enumerate(xp.asnumpy(rows) if xp is not np else rows):  # per slice: np.unique
        values, counts = np.unique(row, return_counts=True)
        best = values[np.argmax(counts)]
        picks[r] = np.flatnonzero(row == best)[-1]
    pick = xp.asarray(picks).reshape(moved.shape[:-1] + (1,))
    pick = xp.moveaxis(pick, -1, d) if xd.ndim else pick.reshape(())
    if not xd.ndim:
        return ModeResult(_values_at(input, 0, pick, "ModeBackward"), wrap(pick))
    return _reduced(input, d, pick, keepdim, "ModeBackward", ModeResult)


def unique(input: Tensor, sorted: bool = True, return_inverse: bool = False,  # noqa: A002
           return_counts: bool = False, dim: int | None = None) -> Any:
    """The distinct elements (sorted), optionally with inverse positions and counts."""
    xd = input.array
    xp = xp_of(xd)
    axis = None if dim is None else dim_of(dim, xd.ndim)
    values, inverse, counts = xp.unique(xd, return_inverse=True, return_counts=True, axis=axis)
    if axis is None:
        inverse = inverse.reshape(xd.shape)
    out = [wrap(values)]
    if return_inverse:
        out.append(wrap(inverse.astype(np.int64)))
    if return_counts:
        out.append(wrap(counts.astype(np.int64)))
    return out[0] if len(out) == 1 else tuple(out)


def searchsorted(sorted_sequence: Any, input: Any, *, out_int32: bool = False,  # noqa: A002
                 right: bool = False, side: str | None = None, sorter: Any = None) -> Tensor:
    """Positions where input's values would go in the innermost sorted dim of sorted_sequence."""
    seq, values = val(sorted_sequence), val(input)
    if side is not None:
        if side not in ("left", "right"):
            raise RuntimeError(f"torch.searchsorted(): side can only be 'left' or 'right' but "
                               f"got {side}")
        right = side == "right"
    xp = xp_of(seq)
    how = "right" if right else "left"
    if sorter is not None:
        seq = xp.take_along_axis(seq, val(sorter), axis=-1)
    scalar = not hasattr(values, "shape")
    values = xp.asarray(values)
    if seq.ndim <= 1:
        out = xp.searchsorted(seq, values, side=how)
    else:
        if seq.shape[:-1] != values.shape[:-1]:
            raise RuntimeError("torch.searchsorted(): boundaries tensor should be 1 dimension or "
                               "the first N-1 dimensions of boundaries tensor and input value "
                               "tensor must match")
        rows_s = seq.reshape(-1, seq.shape[-1])
        rows_v = values.reshape(-1, values.shape[-1])
        out = xp.stack([xp.searchsorted(s, v, side=how) for s, v in zip(rows_s, rows_v)])
        out = out.reshape(values.shape)
    out = out.astype(np.int32 if out_int32 else np.int64)
    return wrap(out.reshape(()) if scalar else out)


def bucketize(input: Any, boundaries: Tensor, *, out_int32: bool = False,  # noqa: A002
              right: bool = False) -> Tensor:
    """The bucket of each element for 1-D sorted boundaries (torch's `right` rule)."""
    if boundaries.ndim != 1:
        raise RuntimeError(f"boundaries tensor must be 1 dimension, but got dim("
                           f"{boundaries.ndim})")
    # torch's bucketize(right=False) is searchsorted(right=False): boundaries[i-1] < x <= b[i]
    return searchsorted(boundaries, input, out_int32=out_int32, right=right)


def histc(input: Tensor, bins: int = 100, min: float = 0, max: float = 0) -> Tensor:  # noqa: A002
    """A histogram of `bins` equal bins over [min, max] (the data's range when both are 0)."""
    xd = input.array
    if xd.dtype.kind not in "fV":
        raise RuntimeError(f"\"histogram_cpu\" not implemented for '{xd.dtype.name}'")
    if bins <= 0:
        raise RuntimeError("torch.histc: bins must be > 0")
    xp = xp_of(xd)
    lo, hi = float(min), float(max)
    if lo == hi and xd.size:
        lo, hi = float(xd.min()), float(xd.max())
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    if lo > hi:
        raise RuntimeError("torch.histc: max must be larger than min")
    counts, _ = xp.histogram(xd.astype(np.float64), bins=bins, range=(lo, hi))
    return wrap(counts.astype(xd.dtype))


def bincount(input: Tensor, weights: Any = None, minlength: int = 0) -> Tensor:  # noqa: A002
    """Counts of each non-negative integer in a 1-D input (weighted sums with weights)."""
    xd = input.array
    if xd.ndim != 1 or xd.dtype.kind not in "iu":
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    if xd.size and xd.min() < 0:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    xp = xp_of(xd)
    w = None if weights is None else val(weights)
    out = xp.bincount(xd, weights=w, minlength=minlength)
    if w is None:
        return wrap(out.astype(np.int64))
    return wrap(out.astype(w.dtype if w.dtype.kind == "f" else np.float64))


def isin(elements: Any, test_elements: Any, *, assume_unique: bool = False,
         invert: bool = False) -> Tensor:
    """Whether each of `elements` occurs in `test_elements`."""
    e, t = val(elements), val(test_elements)
    xp = xp_of(e if hasattr(e, "dtype") else t)
    return wrap(xp.isin(xp.asarray(e), xp.asarray(t), invert=invert))


def count_nonzero(input: Tensor, dim: Any = None) -> Tensor:  # noqa: A002
    """The number of non-zero elements over dim (all when None), as int64."""
    xd = input.array
    axis = None if dim is None else (
        tuple(dim_of(d, xd.ndim) for d in dim) if isinstance(dim, (tuple, list))
        else dim_of(dim, xd.ndim))
    return wrap(xp_of(xd).asarray(xp_of(xd).count_nonzero(xd, axis=axis)).astype(np.int64))


def argwhere(input: Tensor) -> Tensor:  # noqa: A002
    """The positions of non-zero elements, one row each (an (n, ndim) int64 tensor)."""
    xd = input.array
    return wrap(xp_of(xd).argwhere(xd).astype(np.int64))
