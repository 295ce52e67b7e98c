"""Clock offsets between ranks from round trips through the job's store (NTP's estimate).

Rank r > 0 writes a ping; rank 0, the reference, answers each ping with its own clock reading
T under a pong key; r reads the pong. With t0 (r's clock at the ping) and t1 (at the pong's
arrival), rank 0's clock minus r's is about T - (t0 + t1) / 2, wrong by at most (t1 - t0) / 2:
the round with the shortest round trip gives the estimate and its error bound.

Both sides read `trace_clock_ns`, the clock trace timestamps are exported on, so the offset
aligns exactly what `shoal trace merge` shifts (a wall clock read now could have stepped since
the traces' epoch offset was taken).

core names no layer above it: whoever owns the job's store (collectives, when the default
process group forms) lends it with `use_store`; the store is duck-typed (`set(key, value)`,
`get(key, timeout=seconds)`, as every `collectives.Store` has).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from shoal.core.profiler.events import EPOCH_OFFSET_NS, now_ns
from shoal.core.profiler.schedule import ProfilerError

ROUNDS = 8
TIMEOUT_S = 20.0


def trace_clock_ns() -> int:
    """Now on the traces' clock: the monotonic clock plus the epoch offset read at import."""
    return now_ns() + EPOCH_OFFSET_NS


def _check(rank: int, world_size: int, rounds: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ProfilerError(f"Clock offset estimate: rank {rank} is not in 0..{world_size - 1} "
                            f"(world size {world_size}).")
    if rounds < 1:
        raise ProfilerError(f"Clock offset estimate: rounds must be at least 1, got {rounds}.")


def estimate(store: Any, rank: int, world_size: int, prefix: str, rounds: int = ROUNDS,
             timeout: float = TIMEOUT_S,
             clock: Callable[[], int] = trace_clock_ns) -> dict:
    """This rank's offset to rank 0 in microseconds: add it to this rank's timestamps.

    Every rank calls it with the same `prefix` (unused in the store so far); rank 0 answers the
    others' pings in rank order. `clock` is the clock whose offset is measured (the traces' own
    unless a test gives another).

    Raises:
        ProfilerError: `rank` outside 0..world_size-1 or `rounds` < 1.
        Whatever the store raises when a peer's key does not appear within `timeout`.
    """
    _check(rank, world_size, rounds)
    if rank == 0:
        for peer in range(1, world_size):
            for k in range(rounds):
                store.get(f"{prefix}/ping/{peer}/{k}", timeout=timeout)  # waits for the ping
                store.set(f"{prefix}/pong/{peer}/{k}", str(clock()))
        return {"offset_us": 0.0, "error_us": 0.0, "reference_rank": 0, "method": "reference"}
    best: Optional[tuple[float, float]] = None
    for k in range(rounds):
        t0 = clock()
        store.set(f"{prefix}/ping/{rank}/{k}", str(t0))
        ref = int(store.get(f"{prefix}/pong/{rank}/{k}", timeout=timeout))
        t1 = clock()
        err = (t1 - t0) / 2
        if best is None or err < best[1]:
            best = (ref - (t0 + t1) / 2, err)
    assert best is not None  # rounds >= 1
    return {"offset_us": best[0] / 1e3, "error_us": best[1] / 1e3, "reference_rank": 0,
            "method": f"store round trips ({rounds}, shortest kept)"}


@dataclass(frozen=True)
class LentStore:
    """A store every rank of the job reaches, with this rank's place in it."""

    store: Any
    rank: int
    world_size: int
    prefix: str  # keys go under it: unique to this incarnation of the job

    def __post_init__(self) -> None:
        _check(self.rank, self.world_size, 1)


_lock = threading.Lock()
_lent: Optional[LentStore] = None


def use_store(store: Any, rank: int, world_size: int, prefix: str) -> None:
    """Measure the job profiler's clock offsets through `store` from now on."""
    global _lent
    lent = LentStore(store, rank, world_size, prefix)
    with _lock:
        _lent = lent


def forget_store(store: Any) -> None:
    """Stop using `store` (it is closing); another one lent since stays."""
    global _lent
    with _lock:
        if _lent is not None and _lent.store is store:
            _lent = None


def lent_store() -> Optional[LentStore]:
    """The store lent now, or None."""
    return _lent


def window_offset(window: tuple) -> dict:
    """This rank's offset for the trace of `window` (first step, last step), through the lent
    store; without one, offset 0 and an unknown error."""
    lent = _lent
    if lent is None:
        return {"offset_us": 0.0, "error_us": None, "reference_rank": 0,
                "method": "none (no process group lent its store)"}
    return estimate(lent.store, lent.rank, lent.world_size,
                    f"{lent.prefix}/{window[0]}-{window[1]}")
