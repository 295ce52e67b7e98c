"""What DDP asks of a communication hook: `hook(state, GradBucket)` returns a Future whose value
is the bucket's reduced flat buffer. `call_hook` checks what a hook returned, `take_hook_result`
what its Future produced, each with an error that names the hook's mistake."""

from __future__ import annotations

from typing import Any, Callable

from shoal.collectives.ddp.buckets import Bucket, GradBucket
from shoal.collectives.ddp.errors import DDPError
from shoal.collectives.ddp.future import missing_future_methods
from shoal.collectives.ddp.graph import same_memory
from shoal.core import backend
from shoal.core.tensor import Tensor


def call_hook(hook: Callable, state: Any, bucket: Bucket) -> Any:
    """Start reducing `bucket` with `hook(state, GradBucket)`; returns the hook's Future.

    Raises:
        DDPError: the hook returned something that is not a Future.
    """
    fut = hook(state, GradBucket(bucket, bucket.is_last))
    missing = missing_future_methods(fut)
    if missing:
        raise DDPError(
            f"The communication hook {getattr(hook, '__name__', hook)!r} "
            f"returned {type(fut).__name__} for bucket {bucket.index}; it must return a "
            "Future (an object with wait() and value(), e.g. collectives.Future or "
            "Work.get_future()) whose value is the reduced buffer; it has no "
            f"{' and no '.join(missing)}."
        )
    return fut


def take_hook_result(bucket: Bucket, result: Any) -> None:
    """Make `result`, a hook's reduced buffer, the bucket's contents (copied unless it is the
    bucket's own buffer).

    Raises:
        DDPError: `result` is not an array, or not of the bucket's size.
    """
    if isinstance(result, (list, tuple)) and len(result) == 1:
        result = result[0]
    if isinstance(result, Tensor):
        result = result.array
    if result is None or not hasattr(result, "shape"):
        raise DDPError(
            f"The communication hook's Future for bucket {bucket.index} produced "
            f"{type(result).__name__}; its value must be the reduced flat buffer."
        )
    if result.size != bucket.buffer.size:
        raise DDPError(
            f"The communication hook's result for bucket {bucket.index} has "
            f"{result.size} elements but the bucket holds {bucket.buffer.size}."
        )
    if not same_memory(result.reshape(-1), bucket.buffer):
        xp = backend.array_module(bucket.buffer)
        xp.copyto(bucket.buffer, result.reshape(-1), casting="unsafe")
