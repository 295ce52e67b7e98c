"""torch's ops that move elements without arithmetic: flip, roll, rot90, movedim, swapaxes,
unbind, tensor_split and the h/v/dsplits, tile, repeat_interleave, unflatten, ravel,
broadcast_to/broadcast_tensors, meshgrid, atleast_Nd, the stacks, block_diag, cartesian_prod.

flip and roll carry their own backward (the inverse move); the rest compose core's reshape,
permute, expand, getitem, cat and index_select, so their gradients are those ops'.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from shoal.core.ops import shape as _shape
from shoal.core.ops._util import result, wrap, xp_of
from shoal.core.ops.indexing import dim_of, index_select
from shoal.core.tensor import Tensor


def _dims(dims: Any, ndim: int) -> tuple:
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    out = tuple(dim_of(d, ndim) for d in dims)
    if len(set(out)) != len(out):
        raise RuntimeError(f"dims has duplicates, original flip dims size={len(dims)}, but "
                           f"unique flip dims size={len(set(out))}")
    return out


def flip(input: Tensor, dims: Any) -> Tensor:  # noqa: A002
    """input with the order of elements reversed along each of dims."""
    xd = input.array
    axes = _dims(dims, xd.ndim)
    xp = xp_of(xd)
    out = xp.flip(xd, axes).copy() if xd.ndim else xd.copy()
    return result(out, "FlipBackward",
                  lambda g: (xp.flip(g, axes) if xd.ndim else g,), (input,))


def fliplr(input: Tensor) -> Tensor:  # noqa: A002
    """Flip along dim 1 (left and right)."""
    if input.ndim < 2:
        raise RuntimeError("Input must be >= 2-d.")
    return flip(input, (1,))


def flipud(input: Tensor) -> Tensor:  # noqa: A002
    """Flip along dim 0 (up and down)."""
    if input.ndim < 1:
        raise RuntimeError("Input must be >= 1-d.")
    return flip(input, (0,))


def roll(input: Tensor, shifts: Any, dims: Any = None) -> Tensor:  # noqa: A002
    """Rotate elements by shifts along dims (the flattened tensor when dims is None)."""
    xd = input.array
    xp = xp_of(xd)
    if dims is None:
        if not isinstance(shifts, int) and len(shifts) != 1:
            raise RuntimeError("roll: shifts and dimensions must align.")
        axes = None
    else:
        axes = _dims(dims, xd.ndim)
        shifts_t = (shifts,) if isinstance(shifts, int) else tuple(shifts)
        if len(shifts_t) != len(axes):
            raise RuntimeError(f"shifts and dimensions must align. shifts: {len(shifts_t)}, "
                               f"dims:{len(axes)}")
        shifts = shifts_t
    out = xp.roll(xd, shifts, axes)
    back = tuple(-s for s in shifts) if isinstance(shifts, tuple) else -shifts
    return result(out, "RollBackward", lambda g: (xp.roll(g, back, axes),), (input,))


def rot90(input: Tensor, k: int = 1, dims: Sequence[int] = (0, 1)) -> Tensor:  # noqa: A002
    """Rotate by 90 degrees k times in the plane of dims (from the first toward the second)."""
    if len(dims) != 2:
        raise RuntimeError(f"expected total rotation dims == 2, but got dims = {len(dims)}")
    d0, d1 = _dims(dims, input.ndim)
    k %= 4
    if k == 0:
        return _shape.clone(input)
    if k == 1:
        return swapaxes(flip(input, (d1,)), d0, d1)
    if k == 2:
        return flip(input, (d0, d1))
    return flip(swapaxes(input, d0, d1), (d1,))


def movedim(input: Tensor, source: Any, destination: Any) -> Tensor:  # noqa: A002
    """input with the dims at source moved to destination (the others keep their order)."""
    src = _dims(source, input.ndim)
    dst = _dims(destination, input.ndim)
    if len(src) != len(dst):
        raise RuntimeError(f"movedim: Invalid source or destination dims: source ({list(src)} "
                           f"dims) should contain the same number of dims as destination "
                           f"({list(dst)} dims)")
    order = [d for d in range(input.ndim) if d not in src]
    for d, s in sorted(zip(dst, src)):
        order.insert(d, s)
    return _shape.permute(input, *order)


moveaxis = movedim


def swapaxes(input: Tensor, axis0: int, axis1: int) -> Tensor:  # noqa: A002
    """transpose under NumPy's name."""
    return _shape.transpose(input, axis0, axis1)


swapdims = swapaxes


def unbind(input: Tensor, dim: int = 0) -> tuple:  # noqa: A002
    """The slices along dim, dim removed."""
    d = dim_of(dim, input.ndim)
    return tuple(_shape.getitem(input, (slice(None),) * d + (i,)) for i in range(input.shape[d]))


def tensor_split(input: Tensor, indices_or_sections: Any, dim: int = 0) -> tuple:  # noqa: A002
    """Split into n near-equal parts (an int) or at the given indices (a sequence)."""
    d = dim_of(dim, input.ndim)
    size = input.shape[d]
    if isinstance(indices_or_sections, Tensor):
        indices_or_sections = indices_or_sections.tolist()
    if isinstance(indices_or_sections, int):
        n = indices_or_sections
        if n <= 0:
            raise RuntimeError(f"number of sections must be larger than 0, got {n}")
        bounds = [0] + [size // n * i + min(i, size % n) for i in range(1, n)] + [size]
    else:
        bounds = [0] + [min(max(int(i), 0), size) for i in indices_or_sections] + [size]
    return tuple(_shape.getitem(input, (slice(None),) * d + (slice(lo, max(lo, hi)),))
                 for lo, hi in zip(bounds, bounds[1:]))


def _split_on(input: Tensor, sections: Any, dim: int, name: str) -> tuple:  # noqa: A002
    if isinstance(sections, int) and input.shape[dim] % sections:
        raise RuntimeError(f"torch.{name} attempted to split along dimension {dim}, but the "
                           f"size of the dimension {input.shape[dim]} is not divisible by the "
                           f"split_size {sections}!")
    return tensor_split(input, sections, dim)


def hsplit(input: Tensor, sections: Any) -> tuple:  # noqa: A002
    """Split along dim 1 (dim 0 for 1-D)."""
    return _split_on(input, sections, 1 if input.ndim > 1 else 0, "hsplit")


def vsplit(input: Tensor, sections: Any) -> tuple:  # noqa: A002
    """Split along dim 0."""
    return _split_on(input, sections, 0, "vsplit")


def dsplit(input: Tensor, sections: Any) -> tuple:  # noqa: A002
    """Split along dim 2."""
    return _split_on(input, sections, 2, "dsplit")


def tile(input: Tensor, dims: Sequence[int]) -> Tensor:  # noqa: A002
    """repeat, with missing leading repeats taken as 1."""
    dims = tuple(dims)
    reps = (1,) * (input.ndim - len(dims)) + dims
    return input.repeat(*reps)


def repeat_interleave(input: Any, repeats: Any = None, dim: int | None = None, *,  # noqa: A002
                      output_size: int | None = None) -> Tensor:
    """Each element (or slice along dim) repeated `repeats` times in place."""
    if repeats is None:  # torch.repeat_interleave(repeats): positions repeated by count
        counts = input.array
        return wrap(np.repeat(np.arange(counts.shape[0]), counts).astype(np.int64))
    x = input if dim is not None else _shape.reshape(input, -1)
    d = 0 if dim is None else dim_of(dim, input.ndim)
    counts = repeats.array if isinstance(repeats, Tensor) else repeats
    if getattr(counts, "ndim", 0) and counts.shape[0] not in (1, x.shape[d]):
        raise RuntimeError("repeats must have the same size as input along dim")
    picks = np.repeat(np.arange(x.shape[d]), np.asarray(counts).reshape(-1)
                      if getattr(counts, "ndim", 0) else int(counts))
    return index_select(x, d, wrap(picks.astype(np.int64)))


def unflatten(input: Tensor, dim: int, sizes: Sequence[int]) -> Tensor:  # noqa: A002
    """dim split into `sizes` (one -1 allowed)."""
    d = dim_of(dim, input.ndim)
    shape = tuple(input.shape)
    return _shape.reshape(input, shape[:d] + tuple(sizes) + shape[d + 1:])


def ravel(input: Tensor) -> Tensor:  # noqa: A002
    """A 1-D tensor of input's elements."""
    return _shape.reshape(input, -1)


def broadcast_to(input: Tensor, size: Sequence[int]) -> Tensor:  # noqa: A002
    """expand under NumPy's name."""
    return _shape.expand(input, *size)


def broadcast_shapes(*shapes: Any) -> tuple:
    """The shape the given shapes broadcast to."""
    try:
        return tuple(np.broadcast_shapes(*[(s,) if isinstance(s, int) else tuple(s)
                                           for s in shapes]))
    except ValueError as exc:
        raise RuntimeError(f"Shape mismatch: objects cannot be broadcast to a single shape: "
                           f"{exc}") from exc


def broadcast_tensors(*tensors: Tensor) -> tuple:
    """The tensors expanded to their common shape."""
    shape = broadcast_shapes(*[t.shape for t in tensors])
    return tuple(_shape.expand(t, *shape) for t in tensors)


def meshgrid(*tensors: Any, indexing: str = "ij") -> tuple:
    """Coordinate grids from 1-D tensors ('ij': matrix indexing, 'xy': Cartesian)."""
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = tuple(tensors[0])
    if indexing not in ("ij", "xy"):
        raise RuntimeError(f"torch.meshgrid: indexing must be one of \"xy\" or \"ij\", but "
                           f"received: {indexing}")
    n = len(tensors)
    flat = [_shape.reshape(t, -1) for t in tensors]
    if indexing == "xy" and n >= 2:
        flat[0], flat[1] = flat[1], flat[0]
    shape = tuple(t.shape[0] for t in flat)
    grids = [_shape.expand(_shape.reshape(t, tuple(-1 if i == j else 1 for j in range(n))),
                           *shape) for i, t in enumerate(flat)]
    if indexing == "xy" and n >= 2:
        grids[0], grids[1] = grids[1], grids[0]
    return tuple(grids)


def _at_least(t: Tensor, n: int) -> Tensor:
    if t.ndim >= n:
        return t
    if n == 3 and t.ndim == 2:
        return _shape.reshape(t, tuple(t.shape) + (1,))
    if n == 3 and t.ndim == 1:
        return _shape.reshape(t, (1, t.shape[0], 1))
    return _shape.reshape(t, (1,) * (n - t.ndim) + tuple(t.shape))


def atleast_1d(*tensors: Any) -> Any:
    """Each tensor with at least one dim."""
    return _each(tensors, 1)


def atleast_2d(*tensors: Any) -> Any:
    """Each tensor with at least two dims (new leading dims)."""
    return _each(tensors, 2)


def atleast_3d(*tensors: Any) -> Any:
    """Each tensor with at least three dims (NumPy's placement)."""
    return _each(tensors, 3)


def _each(tensors: tuple, n: int) -> Any:
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        return tuple(_at_least(t, n) for t in tensors[0])
    out = tuple(_at_least(t, n) for t in tensors)
    return out[0] if len(out) == 1 else out


def hstack(tensors: Sequence[Tensor]) -> Tensor:
    """Join along dim 1 (dim 0 for 1-D tensors)."""
    ts = [_at_least(t, 1) for t in tensors]
    return _shape.cat(ts, 0 if ts[0].ndim == 1 else 1)


def vstack(tensors: Sequence[Tensor]) -> Tensor:
    """Join along dim 0 after making each at least 2-D."""
    return _shape.cat([_at_least(t, 2) for t in tensors], 0)


row_stack = vstack


def dstack(tensors: Sequence[Tensor]) -> Tensor:
    """Join along dim 2 after making each at least 3-D."""
    return _shape.cat([_at_least(t, 3) for t in tensors], 2)


def column_stack(tensors: Sequence[Tensor]) -> Tensor:
    """Join as columns: 0-D and 1-D tensors become columns first."""
    cols = [_shape.reshape(t, (t.numel(), 1)) if t.ndim <= 1 else t for t in tensors]
    return _shape.cat(cols, 1)


def block_diag(*tensors: Tensor) -> Tensor:
    """A block-diagonal matrix of the given 0-, 1- or 2-D tensors."""
    from shoal.core.ops.creation import zeros  # noqa: PLC0415 - creation imports shape ops

    blocks = [_shape.reshape(t, (1, -1)) if t.ndim < 2 else t for t in tensors]
    width = sum(b.shape[1] for b in blocks)
    rows, left = [], 0
    for b in blocks:
        parts = [p for p in (zeros(b.shape[0], left, dtype=b.dtype), b,
                             zeros(b.shape[0], width - left - b.shape[1], dtype=b.dtype))]
        rows.append(_shape.cat(parts, 1))
        left += b.shape[1]
    return _shape.cat(rows, 0)


def cartesian_prod(*tensors: Tensor) -> Tensor:
    """Every combination of the 1-D tensors' elements, one row each."""
    if len(tensors) == 1:
        return tensors[0]
    grids = meshgrid(*tensors, indexing="ij")
    return _shape.stack([_shape.reshape(g, -1) for g in grids], 1)
