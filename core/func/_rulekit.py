"""Helpers the batching rules share: lifting arguments to a level, moving dims, wrapping results."""

from __future__ import annotations

from typing import Any

from shoal.core.func.batched import BatchedTensor, batched
from shoal.core.func.dispatch import wrapper_for
from shoal.core.ops import shape as shape_ops
from shoal.core.tensor import Tensor


def at_level(x: Any, level: int) -> bool:
    """Whether x is batched at exactly `level` (other values are constants there)."""
    return isinstance(x, BatchedTensor) and x._level == level  # noqa: SLF001


def value(x: BatchedTensor) -> Any:
    """The value under a wrapper (batch dim in front)."""
    return x._value  # noqa: SLF001


def batch_size(level: int, args: tuple, kwargs: dict) -> int:
    """The level's batch size, read from the first argument batched at it."""
    for a in (*args, *kwargs.values()):
        for b in (a if isinstance(a, (list, tuple)) else (a,)):
            if at_level(b, level):
                return value(b).shape[0]
    raise AssertionError("a rule ran without an argument at its level")


def physical_dim(d: int, ndim: int, op: str) -> int:
    """A logical dim (negative allowed) as the dim of the value, whose dim 0 is the batch."""
    n = max(ndim, 1)
    if not -n <= d < n:
        raise IndexError(f"{op}: Dimension out of range (expected to be in range of "
                         f"[{-n}, {n - 1}], but got {d})")
    return d % n + 1


def physical_dims(dim: Any, ndim: int, op: str) -> Any:
    """An int or a tuple of logical dims, as the value's dims."""
    if isinstance(dim, (tuple, list)):
        return tuple(physical_dim(d, ndim, op) for d in dim)
    return physical_dim(dim, ndim, op)


def moved_to_front(x: Any, level: int, size: int) -> Any:
    """x's value at `level`: its own when batched there, else x broadcast along a new dim 0."""
    if at_level(x, level):
        return value(x)
    call = wrapper_for(shape_ops.expand)
    return call(wrapper_for(shape_ops.unsqueeze)(x, 0), (size, *x.shape))


def padded(x: Any, level: int, rank: int) -> Any:
    """x's value with 1s inserted after the batch dim up to `rank` logical dims (so that it
    broadcasts against other values right-aligned, as its logical shape does)."""
    v = value(x)
    k = x.ndim
    if k >= rank:
        return v
    return wrapper_for(shape_ops.reshape)(v, (v.shape[0], *([1] * (rank - k)), *x.shape))


def wrap_out(out: Any, level: int) -> Any:
    """An op's output as batched at `level` (tuples and namedtuples elementwise)."""
    if isinstance(out, Tensor):
        return batched(out, level)
    if isinstance(out, tuple):
        items = [wrap_out(o, level) for o in out]
        return type(out)(*items) if hasattr(out, "_fields") else tuple(items)
    if isinstance(out, list):
        return [wrap_out(o, level) for o in out]
    return out
