"""The few process-group calls DDP makes, in one place: rank, size, all_reduce, broadcast.

Arrays passed here are numpy (or cupy) arrays, reduced or overwritten in place.
"""

from __future__ import annotations

from typing import Any, Optional

from shoal.collectives import world
from shoal.collectives.types import ReduceOp


def default_group() -> Any:
    """The process group init_process_group created."""
    return world.get_default_group()


def resolve(group: Optional[Any]) -> Any:
    """`group`, or the default group when None."""
    return default_group() if group is None else group


def rank(group: Any) -> int:
    """This process's rank in `group`."""
    return group.rank()


def size(group: Any) -> int:
    """The number of ranks in `group`."""
    return group.size()


def all_reduce(group: Any, array: Any, op: ReduceOp = ReduceOp.SUM, async_op: bool = False):
    """Reduce `array` in place across `group`; returns the Work when async_op."""
    # A synchronous call on an idle tcp group runs inline in this thread: cheaper than a hand-off.
    work = group.all_reduce(array, op=op, async_op=async_op)
    if not async_op:
        work.wait()
    return work


def broadcast(group: Any, array: Any, src: int, async_op: bool = False):
    """Overwrite `array` with rank `src`'s copy; returns the Work when async_op."""
    work = group.broadcast(array, src=src, async_op=async_op)
    if not async_op:
        work.wait()
    return work
