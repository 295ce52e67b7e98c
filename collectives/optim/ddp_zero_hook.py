"""`hook_with_zero_step`: DDP's communication hook that runs ZeroRedundancyOptimizer's step as
the buckets arrive (torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook).

The wrapped hook (allreduce_hook, a compression hook) reduces a bucket; when its all_reduce
finishes, in the collectives' own thread, this rank steps its own parameters of that bucket
with the reduced gradients, while backward goes on in the main thread. After the last bucket
the ranks' shares are broadcast, issued from that same thread (so every rank issues them right
after its last bucket, in one order), and the last bucket's future completes only once they are
in place: when DDP's backward returns, every rank holds the updated parameters. Unlike torch's,
no warm-up iterations are skipped: the partition is by parameter, not by DDP's bucket layout.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from shoal.collectives.futures import Future
from shoal.collectives.optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer

__all__ = ["hook_with_zero_step"]


def hook_with_zero_step(hook: Callable[[Any, Any], Future], ddp: Any,
                        zero: ZeroRedundancyOptimizer,
                        shard_buckets: bool = False) -> Callable[[Any, Any], Future]:
    """`hook` followed by each bucket's share of `zero`'s step, and the exchange after the last.

    Raises:
        ValueError: `zero` was made without overlap_with_ddp=True, or DDP finds unused
            parameters (its extra all_reduce at the end of backward would race the exchange).
    """
    if not zero.overlap_with_ddp:
        raise ValueError("ZeroRedundancyOptimizer must be constructed with "
                         "`overlap_with_ddp=True` to use hook_with_zero_step.")
    if getattr(ddp, "find_unused_parameters", False):
        raise ValueError("hook_with_zero_step cannot run with find_unused_parameters=True: the "
                         "unused-parameter all_reduce at the end of backward would race the "
                         "parameter exchange the last bucket issues.")

    def hook_with_zero_fn(state: Any, bucket: Any) -> Future:
        reduced = hook(state, bucket)

        def drive(seconds: Optional[float]) -> None:
            # A waiter makes `reduced` progress when its work cannot call back by itself;
            # step() below hands any error to `out`.
            try:
                reduced.wait(seconds)
            except BaseException:  # noqa: BLE001  (reported through `out`, by step())
                pass

        out: Future = Future(f"ZeRO's step of DDP bucket {bucket.index()}", driver=drive)

        def step(fut: Future) -> None:
            error: Optional[BaseException] = None
            try:
                value = fut.value()
                zero.step_bucket(bucket.parameters(), bucket.gradients())
            except BaseException as exc:  # noqa: BLE001  (DDP's wait on `out` raises it)
                error = exc
            if error is not None or not bucket.is_last():
                out.try_complete(None if error else value, error)
                return
            zero.exchange_async(lambda exc: out.try_complete(None if exc else value, exc))

        reduced.add_done_callback(step)
        return out

    return hook_with_zero_fn
