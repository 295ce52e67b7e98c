"""Shape ops (views where numpy allows): reshape, transpose, permute, indexing, cat, stack, where."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from shoal.core import backend
from shoal.core import dtypes
from shoal.core.determinism import alert_not_deterministic
from shoal.core.errors import DeviceError, ShapeError
from shoal.core.ops._promote import as_dtype, promote
from shoal.core.ops._util import (
    broadcast_error,
    needs_grad,
    norm_dims,
    real_grad,
    result,
    unbroadcast,
    val,
    wrap,
    xp_of,
)
from shoal.core.tensor import Tensor, check_inplace


def _shape_args(shape: Sequence) -> tuple:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        return tuple(shape[0])
    return tuple(shape)


def reshape(x: Tensor, *shape: Any) -> Tensor:
    """The same elements in a new shape (a view when the layout allows, as numpy reshape)."""
    xd = x.array
    new = _shape_args(shape)
    try:
        out = xd.reshape(new)
    except ValueError as exc:
        raise ShapeError(
            f"reshape: cannot reshape a tensor of shape {tuple(xd.shape)} ({xd.size} elements) "
            f"into shape {new}."
        ) from exc

    def backward(g: Any) -> tuple:
        return (g.reshape(xd.shape),)

    return result(out, "ReshapeBackward", backward, (x,))


view = reshape


def flatten(x: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    """Merge dims start_dim..end_dim into one."""
    shp = x.array.shape
    if not shp:
        return reshape(x, (1,))
    s, e = norm_dims((start_dim, end_dim), len(shp), "flatten")
    n = 1
    for d in shp[s : e + 1]:
        n *= d
    return reshape(x, shp[:s] + (n,) + shp[e + 1 :])


def unsqueeze(x: Tensor, dim: int) -> Tensor:
    """Insert a dim of size 1 at `dim`."""
    shp = x.array.shape
    (d,) = norm_dims(dim, len(shp) + 1, "unsqueeze")
    return reshape(x, shp[:d] + (1,) + shp[d:])


def squeeze(x: Tensor, dim: Any = None) -> Tensor:
    """Drop dims of size 1 (only `dim` when given)."""
    shp = x.array.shape
    if dim is None:
        return reshape(x, tuple(n for n in shp if n != 1))
    dims = norm_dims(dim, len(shp), "squeeze")
    return reshape(x, tuple(n for i, n in enumerate(shp) if not (i in dims and n == 1)))


def transpose(x: Tensor, dim0: int, dim1: int) -> Tensor:
    """Swap two dims (a view)."""
    xd = x.array
    if xd.ndim < 2 and dim0 in (0, -1) and dim1 in (0, -1):
        return reshape(x, xd.shape)
    a, b = norm_dims((dim0, dim1), xd.ndim, "transpose")
    out = xd.swapaxes(a, b)

    def backward(g: Any) -> tuple:
        return (g.swapaxes(a, b),)

    return result(out, "TransposeBackward", backward, (x,))


def permute(x: Tensor, *dims: Any) -> Tensor:
    """Reorder dims (a view)."""
    xd = x.array
    order = norm_dims(_shape_args(dims), xd.ndim, "permute")
    if sorted(order) != list(range(xd.ndim)):
        raise ShapeError(
            f"permute: {tuple(_shape_args(dims))} is not a permutation of the "
            f"{xd.ndim} dims of shape {tuple(xd.shape)}."
        )
    out = xd.transpose(order)
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i

    def backward(g: Any) -> tuple:
        return (g.transpose(inverse),)

    return result(out, "PermuteBackward", backward, (x,))


def T(x: Tensor) -> Tensor:  # noqa: N802 - torch's name
    """All dims reversed (the matrix transpose for 2-D)."""
    xd = x.array
    if xd.ndim < 2:
        return x
    if xd.ndim == 2:
        return transpose(x, 0, 1)
    return permute(x, tuple(range(xd.ndim - 1, -1, -1)))


def t(x: Tensor) -> Tensor:
    """The transpose of a matrix; vectors and scalars unchanged; more than 2 dims refused."""
    if x.array.ndim > 2:
        raise ShapeError(
            f"t: expects a tensor with <= 2 dimensions, got {x.array.ndim} (shape "
            f"{tuple(x.array.shape)}); use transpose(dim0, dim1) or permute."
        )
    return T(x)


def expand(x: Tensor, *sizes: Any) -> Tensor:
    """Broadcast to a larger shape (-1 keeps a dim), as a read-only view."""
    xd = x.array
    new = list(_shape_args(sizes))
    lead = len(new) - xd.ndim
    for i in range(lead, len(new)):
        if new[i] == -1:
            new[i] = xd.shape[i - lead]
    try:
        out = xp_of(xd).broadcast_to(xd, tuple(new))
    except ValueError as exc:
        raise ShapeError(f"expand: cannot expand shape {tuple(xd.shape)} to {tuple(new)}.") from exc

    def backward(g: Any) -> tuple:
        return (unbroadcast(g, xd.shape),)

    return result(out, "ExpandBackward", backward, (x,))


def contiguous(x: Tensor) -> Tensor:
    """A C-contiguous tensor (self when already contiguous)."""
    xd = x.array
    if xd.flags.c_contiguous:
        return x
    out = xp_of(xd).ascontiguousarray(xd)

    def backward(g: Any) -> tuple:
        return (g,)

    return result(out, "CloneBackward", backward, (x,))


def clone(x: Tensor) -> Tensor:
    """A copy of the data that stays in the graph."""
    out = x.array.copy()

    def backward(g: Any) -> tuple:
        return (g,)

    return result(out, "CloneBackward", backward, (x,))


def _norm_index(idx: Any) -> tuple[Any, bool]:
    """Convert tensors/lists in an index to arrays; say whether it is basic indexing only."""
    items = idx if isinstance(idx, tuple) else (idx,)
    out = []
    basic = True
    for it in items:
        if isinstance(it, Tensor):
            it = it.array
        elif isinstance(it, list):
            it = np.asarray(it)
        if backend.is_array(it):
            basic = False
        out.append(it)
    return (tuple(out) if isinstance(idx, tuple) else out[0]), basic


def getitem(x: Tensor, idx: Any) -> Tensor:
    """Indexing and slicing as numpy: ints, slices, None, Ellipsis, int arrays, bool masks."""
    xd = x.array
    index, basic = _norm_index(idx)
    if not basic and not isinstance(xd, np.ndarray):
        index = _index_to_device(index, xd)
    try:
        out = xd[index]
    except IndexError as exc:
        raise ShapeError(
            f"getitem: index {idx!r} is out of range for a tensor of shape {tuple(xd.shape)}: {exc}"
        ) from exc

    def backward(g: Any) -> tuple:
        xp = xp_of(g)
        grad = xp.zeros(xd.shape, dtype=g.dtype)
        single_mask = backend.is_array(index) and index.dtype == bool
        if basic or single_mask:
            grad[index] = g  # no index repeats, so assignment is exact
        else:
            _scatter_add(xp, grad, index, g)
        return (grad,)

    return result(out, "IndexBackward", backward, (x,))


def _index_to_device(index: Any, like: Any) -> Any:
    xp = xp_of(like)
    if isinstance(index, tuple):
        return tuple(xp.asarray(i) if backend.is_array(i) else i for i in index)
    return xp.asarray(index) if backend.is_array(index) else index


def _scatter_add(xp: Any, target: Any, index: Any, values: Any) -> None:
    """target[index] += values, adding repeated indices up (np.add.at / cupyx.scatter_add)."""
    if xp is np:
        np.add.at(target, index, values)
    else:
        if target.dtype.kind == "f":  # atomics add floats in an unspecified order
            alert_not_deterministic("scatter_add on cuda (the backward of indexing and embedding)")
        import cupyx  # noqa: PLC0415 - cuda only

        cupyx.scatter_add(target, index, values)


def setitem(x: Tensor, idx: Any, value: Any) -> None:
    """In-place assignment into the data (refused on tensors that are part of a graph)."""
    check_inplace(x, "__setitem__")
    index, basic = _norm_index(idx)
    x.array[index] = val(value)


def cat(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Concatenate along an existing dim."""
    tensors = list(tensors)
    if not tensors:
        raise ShapeError("cat: expected a non-empty sequence of tensors.")
    dt, *datas = promote(*(t.array for t in tensors))
    (axis,) = norm_dims(dim, datas[0].ndim, "cat")
    xp = xp_of(datas[0])
    try:
        out = xp.concatenate(datas, axis=axis)
    except ValueError as exc:
        raise ShapeError(
            f"cat: shapes {[tuple(d.shape) for d in datas]} do not match outside dim {dim}."
        ) from exc
    bounds = []
    pos = 0
    for d in datas:
        bounds.append((pos, pos + d.shape[axis]))
        pos += d.shape[axis]

    def backward(g: Any) -> tuple:
        lead = (slice(None),) * axis
        return tuple(as_dtype(g[lead + (slice(a, b),)], t.array.dtype)
                     for (a, b), t in zip(bounds, tensors))

    return result(out, "CatBackward", backward, tuple(tensors), exact_dtype=True)


def stack(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Join along a new dim."""
    tensors = list(tensors)
    if not tensors:
        raise ShapeError("stack: expected a non-empty sequence of tensors.")
    dt, *datas = promote(*(t.array for t in tensors))
    (axis,) = norm_dims(dim, datas[0].ndim + 1, "stack")
    xp = xp_of(datas[0])
    try:
        out = xp.stack(datas, axis=axis)
    except ValueError as exc:
        raise ShapeError(
            f"stack: all tensors must have one shape, got {[tuple(d.shape) for d in datas]}."
        ) from exc

    def backward(g: Any) -> tuple:
        lead = (slice(None),) * axis
        return tuple(as_dtype(g[lead + (i,)], t.array.dtype) for i, t in enumerate(tensors))

    return result(out, "StackBackward", backward, tuple(tensors), exact_dtype=True)


def where(cond: Any, x: Any, y: Any) -> Tensor:
    """Elements of x where cond holds, else of y (x, y may be Python numbers, which do not
    widen a tensor's dtype: where(c, bfloat16, 0.0) is bfloat16, as in torch)."""
    cd = val(cond)
    dt, xd, yd = promote(val(x), val(y))
    xp = xp_of(cd)
    try:
        out = as_dtype(xp.where(cd, xd, yd), dt)
    except ValueError as exc:
        raise ShapeError(
            f"where: cannot broadcast condition {tuple(getattr(cd, 'shape', ()))} with "
            f"{tuple(getattr(xd, 'shape', ()))} and {tuple(getattr(yd, 'shape', ()))}."
        ) from exc

    def backward(g: Any) -> tuple:
        return (
            None,
            as_dtype(unbroadcast(xp.where(cd, g, 0), xd.shape), x.array.dtype)
            if needs_grad(x) else None,
            as_dtype(unbroadcast(xp.where(cd, 0, g), yd.shape), y.array.dtype)
            if needs_grad(y) else None,
        )

    return result(out, "WhereBackward", backward, (cond, x, y), exact_dtype=True)


def maximum(x: Any, y: Any) -> Tensor:
    """Elementwise maximum; ties split the gradient evenly."""
    return _pairwise_extreme(x, y, True)


def minimum(x: Any, y: Any) -> Tensor:
    """Elementwise minimum; ties split the gradient evenly."""
    return _pairwise_extreme(x, y, False)


def _pairwise_extreme(x: Any, y: Any, largest: bool) -> Tensor:
    dt, xd, yd = promote(val(x), val(y))
    xp = xp_of(xd if backend.is_array(xd) else yd)
    op = "maximum" if largest else "minimum"
    try:
        out = as_dtype((xp.maximum if largest else xp.minimum)(xd, yd), dt)
    except ValueError as exc:
        raise broadcast_error(op, xd, yd, exc) from exc

    def backward(g: Any) -> tuple:
        wx = (xd > yd) if largest else (xd < yd)
        wx = wx + 0.5 * (xd == yd)
        return (
            as_dtype(unbroadcast(g * wx, xd.shape), x.array.dtype) if needs_grad(x) else None,
            as_dtype(unbroadcast(g * (1 - wx), yd.shape), y.array.dtype)
            if needs_grad(y) else None,
        )

    return result(out, op.capitalize() + "Backward", backward, (x, y), exact_dtype=True)


def split(x: Tensor, split_size: Any, dim: int = 0) -> tuple:
    """Split into chunks of split_size (or the listed sizes) along dim; each is a view."""
    n = x.array.shape[dim]
    if isinstance(split_size, int):
        sizes = [split_size] * (n // split_size) + ([n % split_size] if n % split_size else [])
    else:
        sizes = list(split_size)
        if sum(sizes) != n:
            raise ShapeError(f"split: sizes {sizes} do not add up to dim {dim} of length {n}.")
    (axis,) = norm_dims(dim, x.array.ndim, "split")
    out = []
    pos = 0
    for s in sizes:
        out.append(getitem(x, (slice(None),) * axis + (slice(pos, pos + s),)))
        pos += s
    return tuple(out)


def chunk(x: Tensor, chunks: int, dim: int = 0) -> tuple:
    """Split into `chunks` nearly equal pieces along dim."""
    n = x.array.shape[dim]
    return split(x, -(-n // chunks), dim)


def to(x: Tensor, device: Any, dtype: Any, copy: bool = False) -> Tensor:
    """Move and/or cast; returns x itself when nothing changes (unless copy)."""
    xd = x.array
    out = xd
    src_dev = backend.device_of(xd)
    if device is not None:
        dev = backend.device(device)
        if dev != src_dev:
            if dtype is not None:
                dtypes.to_np(dtype, dev.type)  # refuse bfloat16 on cuda before moving
            elif dev.type == "cuda" and xd.dtype == dtypes.bfloat16.np:
                raise dtypes.DTypeError(
                    "cupy has no bfloat16 type; cast to float16 or float32 before moving to cuda."
                )
            try:
                out = backend.to_device(xd, dev)
            except Exception as exc:  # cupy raises its own types for bad devices
                raise DeviceError(f"to(): could not move a tensor from {src_dev} to {dev}: {exc}") from exc
    if dtype is not None:
        target = dtypes.to_np(dtype, backend.device_of(out).type)
        if out.dtype != target:
            out = out.astype(target)
    if out is xd:
        if not copy:
            return x
        out = xd.copy()
    src_dtype = xd.dtype

    def backward(g: Any) -> tuple:
        back = real_grad(backend.to_device(g, src_dev), xd)  # complex to real: the real part
        return (back.astype(src_dtype) if back.dtype != src_dtype else back,)

    return result(out, "ToCopyBackward", backward, (x,), exact_dtype=True)


def detach_like(x: Tensor) -> Tensor:
    """A graph-free tensor sharing x's data."""
    return wrap(x.array)
