"""Built-in DDP communication hooks, as torch.distributed.algorithms.ddp_comm_hooks.default_hooks.

A hook is `hook(state, bucket) -> Future`: it reduces one GradBucket's flat buffer and returns
a Future whose value is the averaged buffer. For these hooks `state` is the process group
(None: the default group). Register one with `ddp.register_comm_hook(state, hook)`.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Optional

from shoal.collectives.ddp import comm
from shoal.collectives.ddp.future import Future, future_from_work
from shoal.collectives.ddp.buckets import GradBucket
from shoal.collectives.types import ReduceOp
from shoal.core import backend
from shoal.core import dtypes
from shoal.core import kernels
from shoal.core.tensor import Tensor

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "BuiltinCommHookType",
           "builtin_hook"]


def allreduce_hook(process_group: Optional[Any], bucket: GradBucket) -> Future:
    """Average the bucket with one all_reduce (what DDP does without a hook)."""
    group = comm.resolve(process_group)
    buffer = bucket.buffer()
    data = buffer.array
    backend.array_module(data).divide(data, comm.size(group), out=data)
    work = comm.all_reduce(group, data, ReduceOp.SUM, async_op=True)
    return future_from_work(work, buffer)


def _compress_hook(process_group: Optional[Any], bucket: GradBucket, np_dtype: Any) -> Future:
    group = comm.resolve(process_group)
    buffer = bucket.buffer()
    compressed = buffer.array.astype(np_dtype)
    backend.array_module(compressed).divide(compressed, comm.size(group), out=compressed)
    work = comm.all_reduce(group, compressed, ReduceOp.SUM, async_op=True)

    def decompress(fut: Future) -> Tensor:
        reduced = fut.value()
        # Into the bucket's own buffer, so that the reducer needs no further copy.
        backend.array_module(buffer.array).copyto(buffer.array, reduced, casting="unsafe")
        return buffer

    return future_from_work(work, compressed).then(decompress)


def fp16_compress_hook(process_group: Optional[Any], bucket: GradBucket) -> Future:
    """Cast the bucket to float16, average it with all_reduce, and cast back (half the bytes).

    The cast runs core.kernels' fp16 compression (one fused kernel on CUDA buffers): it scales
    by 1/world in the bucket's precision and rounds once, so sums of large gradients cannot
    overflow float16, and the decompression widens straight into the bucket's buffer.
    """
    group = comm.resolve(process_group)
    buffer = bucket.buffer()
    compressed = kernels.compress(buffer.array, scale=1.0 / comm.size(group))
    work = comm.all_reduce(group, compressed, ReduceOp.SUM, async_op=True)

    def decompress(fut: Future) -> Tensor:
        kernels.decompress(fut.value(), buffer.array)
        return buffer

    return future_from_work(work, compressed).then(decompress)


def bf16_compress_hook(process_group: Optional[Any], bucket: GradBucket) -> Future:
    """Cast the bucket to bfloat16, average it with all_reduce, and cast back (half the bytes)."""
    return _compress_hook(process_group, bucket, dtypes.bfloat16.np)


class BuiltinCommHookType(enum.Enum):
    """torch's names of the hooks `DDP._register_builtin_comm_hook` installs."""

    ALLREDUCE = "allreduce"
    FP16_COMPRESS = "fp16_compress"


def builtin_hook(kind: BuiltinCommHookType) -> Callable:
    """The hook function of a built-in hook type."""
    return {BuiltinCommHookType.ALLREDUCE: allreduce_hook,
            BuiltinCommHookType.FP16_COMPRESS: fp16_compress_hook}[kind]
