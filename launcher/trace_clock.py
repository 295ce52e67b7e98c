"""Clock offsets between ranks from round trips through the job's store (NTP's estimate).

Rank r > 0 writes its send time under a ping key; rank 0, the reference, answers each ping
with its own clock under a pong key; r reads the pong at its receive time. With t0 (send),
t1 (receive) and T (rank 0's clock in between), rank 0's clock minus r's is about
T - (t0 + t1) / 2, wrong by at most (t1 - t0) / 2: the round with the shortest round trip
gives the estimate and its error bound. `shoal run --profile` points SHOAL_PROFILE_CLOCK at
`store_clock`, which each worker's job profiler calls before writing a window's trace.
"""

from __future__ import annotations

import os
import time
from typing import Any

from shoal.collectives.store.tcp import TCPStore

ROUNDS = 8
TIMEOUT_S = 20.0


def estimate(store: Any, rank: int, world_size: int, prefix: str,
             rounds: int = ROUNDS, timeout: float = TIMEOUT_S) -> dict:
    """This rank's offset to rank 0 in microseconds (add it to this rank's timestamps)."""
    if rank == 0:
        for peer in range(1, world_size):
            for k in range(rounds):
                store.get(f"{prefix}/ping/{peer}/{k}", timeout=timeout)  # waits for the ping
                store.set(f"{prefix}/pong/{peer}/{k}", str(time.time_ns()))
        return {"offset_us": 0.0, "error_us": 0.0, "reference_rank": 0, "method": "reference"}
    best: tuple[float, float] | None = None
    for k in range(rounds):
        t0 = time.time_ns()
        store.set(f"{prefix}/ping/{rank}/{k}", str(t0))
        ref = int(store.get(f"{prefix}/pong/{rank}/{k}", timeout=timeout))
        t1 = time.time_ns()
        err = (t1 - t0) / 2
        offset = ref - (t0 + t1) / 2
        if best is None or err < best[1]:
            best = (offset, err)
    assert best is not None
    return {"offset_us": best[0] / 1e3, "error_us": best[1] / 1e3, "reference_rank": 0,
            "method": f"store round trips ({rounds}, shortest kept)"}


def store_clock(window: tuple) -> dict:
    """The job profiler's clock source inside `shoal run`: the agent's store for workers."""
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                     is_master=False, timeout=TIMEOUT_S,
                     token=os.environ.get("SHOAL_AUTH_TOKEN"))
    try:
        prefix = (f"shoal/profile/clock/{os.environ.get('SHOAL_RESTART_COUNT', '0')}/"
                  f"{window[0]}-{window[1]}")
        return estimate(store, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), prefix)
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()
