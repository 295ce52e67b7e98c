"""The nccl backend's monitored_barrier, through the store: NCCL cannot tell who is missing,
so every rank checks in under the barrier's key and rank 0 names the ranks that never did."""

from __future__ import annotations

from typing import Optional

from shoal.collectives.store.api import Store
from shoal.collectives.types import CollectiveError, CollectiveTimeout, StoreTimeout

__all__ = ["monitored_barrier"]


def _rank0_waits(store: Store, base: str, seq: int, size: int, name: str, timeout: float,
                 wait_all_ranks: bool) -> Optional[CollectiveError]:
    """Rank 0's side: wait for every other rank, publish the outcome; the error, if any."""
    keys = [f"{base}/arrived/{q}" for q in range(1, size)]
    try:
        store.wait(keys, timeout=timeout)
    except StoreTimeout:
        missing = [q for q in range(1, size) if not store.check([keys[q - 1]])]
        shown = missing if wait_all_ranks else missing[:1]
        word = "rank" if len(shown) == 1 else "ranks"
        reason = (f"{word} {', '.join(map(str, shown))} did not reach "
                  f"monitored_barrier #{seq} within {timeout:g}s")
        store.set(f"{base}/result", "fail:" + reason)
        return CollectiveTimeout(
            f"Rank 0 timed out in monitored_barrier #{seq} of group '{name}': {reason}."
        )
    store.set(f"{base}/result", "ok")
    return None


def monitored_barrier(store: Store, base: str, seq: int, rank: int, size: int, name: str,
                      timeout: float, wait_all_ranks: bool, grace_s: float
                      ) -> Optional[BaseException]:
    """Barrier #`seq` of group `name` under the store key prefix `base`; returns the error this
    rank fails with (None: every rank arrived). A rank other than 0 waits `grace_s` past
    `timeout` for rank 0's outcome."""
    try:
        store.set(f"{base}/arrived/{rank}", b"1")
        if rank == 0:
            return _rank0_waits(store, base, seq, size, name, timeout, wait_all_ranks)
        try:
            result = store.get(f"{base}/result", timeout=timeout + grace_s).decode()
        except StoreTimeout:
            result = f"fail:rank 0 did not report the outcome within {timeout + grace_s:g}s"
        if result != "ok":
            return CollectiveTimeout(
                f"Rank {rank}'s monitored_barrier #{seq} of group '{name}' failed: "
                f"{result[5:]}."
            )
        return None
    except CollectiveError as exc:
        return exc
    # The store failed under us (a StoreError, a dropped connection, garbage): whatever it
    # was, this rank's caller gets a CollectiveError naming the barrier, not the raw error.
    except Exception as exc:  # noqa: BLE001 - returned to the caller as the barrier's error
        error = CollectiveError(
            f"Rank {rank}'s monitored_barrier #{seq} of group '{name}' failed: {exc}"
        )
        error.__cause__ = exc
        return error
