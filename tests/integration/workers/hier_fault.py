"""A rank that dies in the middle of two-level all_reduces (run with env:// on network-namespace
hosts by test_multihost): the last rank SIGKILLs itself after a few rounds; every other rank
must raise an error naming it, whichever level of the algorithm it was in.

Prints "[rank R] failed in <s>s: <message>" (survivors) or nothing (the victim).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import shoal.collectives as dist


def main() -> None:
    dist.init_process_group("tcp", init_method="env://", timeout=60)
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = dist.get_default_group()
    print(f"[rank {rank}] hierarchical {pg.hierarchical}", flush=True)
    x = np.ones(4 * 1024 * 1024, np.float32)  # 16 MiB: every level, several chunks
    t0 = None
    try:
        for step in range(1000):
            if rank == world - 1 and step == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == 3:
                t0 = time.monotonic()
            dist.all_reduce(x)
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        print(f"[rank {rank}] failed in {time.monotonic() - t0:.1f}s: {type(exc).__name__}: {exc}",
              flush=True)
        sys.exit(0)
    print(f"[rank {rank}] never failed", flush=True)
    sys.exit(1)


if __name__ == "__main__":
    main()
