"""torch's index ops: gather, scatter (and scatter_add), index_select/add/copy/fill, masked_fill,
masked_select, take, take_along_dim, select; with their gradients and torch's checks.

An index is an int64 tensor (torch refuses others for gather/scatter) holding positions inside
the dim's size; an out-of-range position is torch's RuntimeError naming it, before any write.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.core.ops import shape as _shape
from shoal.core.ops._util import needs_grad, result, unbroadcast, val, wrap, xp_of
from shoal.core.tensor import Tensor


def dim_of(dim: int, ndim: int) -> int:
    """A dim in [0, ndim), or torch's IndexError ("Dimension out of range")."""
    top = max(ndim, 1)
    if not -top <= dim < top:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-top}, "
                         f"{top - 1}], but got {dim})")
    return dim % top


def _index_array(index: Any, op: str, int64_only: bool = True) -> Any:
    idx = val(index) if not isinstance(index, (list, tuple)) else np.asarray(index)
    if not hasattr(idx, "dtype"):
        idx = np.asarray(idx)
    if idx.dtype.kind not in "iu" or (int64_only and idx.dtype != np.int64):
        raise RuntimeError(f"{op}(): Expected dtype int64 for index")
    return idx


def _check_bounds(idx: Any, size: int, dim: int) -> None:
    if idx.size and (idx.min() < 0 or idx.max() >= size):
        bad = int(idx.max() if idx.max() >= size else idx.min())
        raise RuntimeError(f"index {bad} is out of bounds for dimension {dim} with size {size}")


def _full_index(idx: Any, dim: int) -> tuple:
    """Advanced-index tuple addressing input[..., idx[...], ...] element by element."""
    xp = xp_of(idx)
    grids = list(xp.indices(idx.shape, sparse=True))
    grids[dim] = idx
    return tuple(grids)


def _check_gather_shapes(op: str, xd: Any, idx: Any, dim: int) -> None:
    if idx.ndim != xd.ndim and not (idx.ndim <= 1 and xd.ndim <= 1):
        raise RuntimeError("Index tensor must have the same number of dimensions as input "
                           "tensor")
    for d in range(idx.ndim):
        if d != dim and idx.shape[d] > xd.shape[d]:
            raise RuntimeError(f"Size does not match at dimension {d} expected index "
                               f"{list(idx.shape)} to be no larger than self "
                               f"{list(xd.shape)} apart from dimension {dim}")


def gather(input: Tensor, dim: int, index: Any, *, sparse_grad: bool = False) -> Tensor:  # noqa: A002
    """out[i][j] = input[index[i][j]][j] for dim 0 (and so on)."""
    xd = input.array
    dim = dim_of(dim, xd.ndim)
    idx = _index_array(index, "gather")
    _check_gather_shapes("gather", xd, idx, dim)
    _check_bounds(idx, xd.shape[dim] if xd.ndim else 1, dim)
    where = _full_index(idx, dim) if xd.ndim else ()
    out = xd[where] if xd.ndim else xd.copy()

    def backward(g: Any) -> tuple:
        grad = xp_of(g).zeros(xd.shape, g.dtype)
        xp_of(g).add.at(grad, where, g) if xd.ndim else None
        return (grad if xd.ndim else g, None)

    return result(out, "GatherBackward", backward, (input, None))


def scatter(input: Tensor, dim: int, index: Any, src: Any = None, *, value: Any = None,  # noqa: A002
            reduce: str | None = None) -> Tensor:
    """A copy of input with src's (or value's) elements written at index along dim."""
    if src is None and value is None:
        raise TypeError("scatter() missing 1 required argument: 'src' or 'value'")
    if reduce is not None:
        return _scatter_reduce(input, dim, index, src if src is not None else value, reduce)
    xd = input.array
    dim = dim_of(dim, xd.ndim)
    idx = _index_array(index, "scatter")
    _check_gather_shapes("scatter", xd, idx, dim)
    _check_bounds(idx, xd.shape[dim], dim)
    where = _full_index(idx, dim)
    source = src if src is not None else value
    sd = val(source)
    out = xd.copy()
    out[where] = sd[tuple(slice(0, n) for n in idx.shape)] if getattr(sd, "ndim", 0) else sd

    def backward(g: Any) -> tuple:
        gi = g.copy()
        gi[where] = 0
        gs = None
        if needs_grad(source):
            gs = xp_of(g).zeros(sd.shape, g.dtype)
            gs[tuple(slice(0, n) for n in idx.shape)] = g[where]
        return (gi, None, gs)

    return result(out, "ScatterBackward", backward, (input, None, source))


def scatter_add(input: Tensor, dim: int, index: Any, src: Tensor) -> Tensor:  # noqa: A002
    """A copy of input with src's elements added at index along dim (repeats accumulate)."""
    xd = input.array
    dim = dim_of(dim, xd.ndim)
    idx = _index_array(index, "scatter_add")
    _check_gather_shapes("scatter_add", xd, idx, dim)
    _check_bounds(idx, xd.shape[dim], dim)
    where = _full_index(idx, dim)
    sd = src.array
    part = tuple(slice(0, n) for n in idx.shape)
    out = xd.copy()
    xp_of(xd).add.at(out, where, sd[part].astype(xd.dtype, copy=False))

    def backward(g: Any) -> tuple:
        gs = None
        if needs_grad(src):
            gs = xp_of(g).zeros(sd.shape, g.dtype)
            gs[part] = g[where]
        return (g, None, gs)

    return result(out, "ScatterAddBackward", backward, (input, None, src))


_REDUCERS = {"sum": "add", "add": "add", "prod": "multiply", "multiply": "multiply",
             "amax": "maximum", "amin": "minimum"}


def _scatter_reduce(input: Tensor, dim: int, index: Any, src: Any, reduce: str) -> Tensor:  # noqa: A002
    """scatter(..., reduce='add'|'multiply'): no gradient, as torch has none for it."""
    if reduce not in _REDUCERS:
        raise RuntimeError(f"reduce argument must be either add or multiply, got {reduce!r}")
    xd = input.array
    dim = dim_of(dim, xd.ndim)
    idx = _index_array(index, "scatter")
    _check_bounds(idx, xd.shape[dim], dim)
    out = xd.copy()
    sd = val(src)
    part = sd[tuple(slice(0, n) for n in idx.shape)] if getattr(sd, "ndim", 0) else sd
    getattr(xp_of(xd), _REDUCERS[reduce]).at(out, _full_index(idx, dim), part)
    return wrap(out)


def index_select(input: Tensor, dim: int, index: Any) -> Tensor:  # noqa: A002
    """The slices of input at `index` (a 1-D int tensor) along dim."""
    xd = input.array
    dim = dim_of(dim, xd.ndim)
    idx = _index_array(index, "index_select", int64_only=False).reshape(-1)
    _check_bounds(idx, xd.shape[dim] if xd.ndim else 1, dim)
    xp = xp_of(xd)
    out = xp.take(xd, idx, axis=dim) if xd.ndim else xd.copy()

    def backward(g: Any) -> tuple:
        grad = xp.zeros(xd.shape, g.dtype)
        if xd.ndim:
            xp.add.at(xp.moveaxis(grad, dim, 0), idx, xp.moveaxis(g, dim, 0))
        else:
            grad = g
        return (grad, None, None)

    return result(out, "IndexSelectBackward", backward, (input, None, None))


def index_add(input: Tensor, dim: int, index: Any, source: Tensor, *, alpha: Any = 1) -> Tensor:  # noqa: A002
    """A copy of input with alpha * source's slices added at index along dim."""
    xd = input.array
    dim = dim_of(dim, xd.ndim)
    idx = _index_array(index, "index_add", int64_only=False).reshape(-1)
    _check_bounds(idx, xd.shape[dim], dim)
    xp = xp_of(xd)
    out = xd.copy()
    sd = source.array
    xp.add.at(xp.moveaxis(out, dim, 0), idx, xp.moveaxis((sd * alpha).astype(xd.dtype), dim, 0))

    def backward(g: Any) -> tuple:
        gs = xp.take(g, idx, axis=dim) * alpha if needs_grad(source) else None
        return (g, None, None, gs)

    return result(out, "IndexAddBackward", backward, (input, None, None, source))


def index_copy(input: Tensor, dim: int, index: Any, source: Tensor) -> Tensor:  # noqa: A002
    """A copy of input with source's slices written at index along dim."""
    xd = input.array
    dim = dim_of(dim, xd.ndim)
    idx = _index_array(index, "index_copy").reshape(-1)
    _check_bounds(idx, xd.shape[dim], dim)
    xp = xp_of(xd)
    out = xd.copy()
    xp.moveaxis(out, dim, 0)[idx] = xp.moveaxis(source.array, dim, 0)

    def backward(g: Any) -> tuple:
        gi = g.copy()
        xp.moveaxis(gi, dim, 0)[idx] = 0
        gs = xp.take(g, idx, axis=dim) if needs_grad(source) else None
        return (gi, None, None, gs)

    return result(out, "IndexCopyBackward", backward, (input, None, None, source))


def index_fill(input: Tensor, dim: int, index: Any, value: Any) -> Tensor:  # noqa: A002
    """A copy of input with the slices at index along dim set to value."""
    xd = input.array
    dim = dim_of(dim, xd.ndim)
    idx = _index_array(index, "index_fill").reshape(-1)
    _check_bounds(idx, xd.shape[dim], dim)
    xp = xp_of(xd)
    out = xd.copy()
    xp.moveaxis(out, dim, 0)[idx] = val(value)

    def backward(g: Any) -> tuple:
        gi = g.copy()
        xp.moveaxis(gi, dim, 0)[idx] = 0
        return (gi, None, None, None)

    return result(out, "IndexFillBackward", backward, (input, None, None, None))


def _bool_mask(mask: Any, op: str) -> Any:
    m = val(mask)
    if not hasattr(m, "dtype") or m.dtype != np.bool_:
        raise RuntimeError(f"{op} only supports boolean masks, but got mask with dtype "
                           f"{getattr(m, 'dtype', type(m).__name__)}")
    return m


def masked_fill(input: Tensor, mask: Any, value: Any) -> Tensor:  # noqa: A002
    """A copy of input with value where mask (broadcast to input's shape) is True."""
    xd = input.array
    m = _bool_mask(mask, "masked_fill_")
    xp = xp_of(xd)
    try:
        full = xp.broadcast_to(m, xd.shape)
    except ValueError as exc:
        raise RuntimeError(f"The size of tensor a ({xd.shape[-1] if xd.ndim else 1}) must "
                           f"match the size of tensor b ({m.shape[-1]}) at non-singleton "
                           f"dimension") from exc
    if isinstance(value, Tensor) and value.ndim != 0:
        raise RuntimeError("masked_fill_ only supports a 0-dimensional value tensor, but got "
                           f"tensor with {value.ndim} dimension(s).")
    out = xp.where(full, xp.asarray(val(value)).astype(xd.dtype), xd)

    def backward(g: Any) -> tuple:
        gv = g[full].sum().reshape(()) if needs_grad(value) else None
        return (xp.where(full, 0, g).astype(g.dtype), None, gv)

    return result(out, "MaskedFillBackward", backward, (input, None, value), exact_dtype=True)


def masked_select(input: Tensor, mask: Any) -> Tensor:  # noqa: A002
    """A 1-D tensor of input's elements where mask (broadcast with input) is True."""
    xd = input.array
    m = _bool_mask(mask, "masked_select:")
    xp = xp_of(xd)
    shape = np.broadcast_shapes(xd.shape, m.shape)
    full_x, full_m = xp.broadcast_to(xd, shape), xp.broadcast_to(m, shape)
    out = full_x[full_m]

    def backward(g: Any) -> tuple:
        grad = xp.zeros(shape, g.dtype)
        grad[full_m] = g
        return (unbroadcast(grad, xd.shape), None)

    return result(out, "MaskedSelectBackward", backward, (input, None))


def take(input: Tensor, index: Any) -> Tensor:  # noqa: A002
    """input's elements at flat positions `index` (negative positions count from the end)."""
    xd = input.array
    idx = _index_array(index, "take")
    n = xd.size
    if idx.size and (idx.max() >= n or idx.min() < -n):
        bad = int(idx.max() if idx.max() >= n else idx.min())
        raise IndexError(f"out of range: tried to access index {bad} on a tensor of {n} "
                         f"elements.")
    flat = idx % max(n, 1)
    xp = xp_of(xd)
    out = xd.reshape(-1)[flat]

    def backward(g: Any) -> tuple:
        grad = xp.zeros(n, g.dtype)
        xp.add.at(grad, flat, g)
        return (grad.reshape(xd.shape), None)

    return result(out, "TakeBackward", backward, (input, None))


def take_along_dim(input: Tensor, indices: Any, dim: int | None = None) -> Tensor:  # noqa: A002
    """gather with broadcasting; dim None gathers from the flattened input."""
    if dim is None:
        return take(_shape.reshape(input, -1), _shape.reshape(wrap(val(indices)), -1))
    xd = input.array
    idx = _index_array(indices, "take_along_dim")
    d = dim_of(dim, xd.ndim)
    shape_x, shape_i = list(xd.shape), list(idx.shape)
    shape_x[d] = shape_i[d] = 1
    common = np.broadcast_shapes(tuple(shape_x), tuple(shape_i))
    xs, is_ = list(common), list(common)
    xs[d], is_[d] = xd.shape[d], idx.shape[d]
    xb = _shape.expand(input, *xs) if tuple(xs) != xd.shape else input
    ib = xp_of(idx).broadcast_to(idx, tuple(is_))
    return gather(xb, d, wrap(xp_of(idx).ascontiguousarray(ib)))


def select(input: Tensor, dim: int, index: int) -> Tensor:  # noqa: A002
    """The slice of input at `index` along dim (dim removed)."""
    d = dim_of(dim, input.ndim)
    size = input.shape[d]
    if not -size <= index < size:
        raise IndexError(f"select(): index {index} out of range for tensor of size "
                         f"{list(input.shape)} at dimension {dim}")
    return _shape.getitem(input, (slice(None),) * d + (index,))
