"""Every collective once, checked against numpy on every rank (run under `shoal run`, one or
more ranks per host): the multi-host tests run it across network-namespace hosts.

Prints "[rank R] catalogue ok" at the end; any difference raises (the worker fails).
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

import shoal.collectives as dist
from shoal.collectives import ReduceOp

SIZES = (7, 70_001, 1_500_000)  # one message, the ring, the threaded ring


def data(rank: int, n: int, dtype=np.float32) -> np.ndarray:
    return ((np.arange(n) % 97) + 3 * rank + 1).astype(dtype)


def main() -> None:
    dist.init_process_group("tcp", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()

    for n in SIZES:
        ref = [data(r, n) for r in range(world)]
        for op, expect in ((ReduceOp.SUM, sum(ref)), (ReduceOp.MAX, np.maximum.reduce(ref)),
                           (ReduceOp.MIN, np.minimum.reduce(ref))):
            x = data(rank, n)
            dist.all_reduce(x, op=op)
            np.testing.assert_allclose(x, expect, rtol=1e-6, err_msg=f"all_reduce {op} {n}")
            # Bitwise identical on every rank (the ring's rule), checked by digest.
            digest = np.frombuffer(hashlib.sha256(x.tobytes()).digest(), np.uint8).copy()
            digests = [np.zeros_like(digest) for _ in range(world)]
            dist.all_gather(digests, digest)
            assert all((d == digest).all() for d in digests), f"all_reduce {op} {n} differs"

        for src in range(world):
            x = data(rank, n)
            dist.broadcast(x, src=src)
            np.testing.assert_array_equal(x, data(src, n))

        x = data(rank, n)
        dist.reduce(x, dst=world - 1)
        np.testing.assert_allclose(x, sum(ref) if rank == world - 1 else data(rank, n), rtol=1e-6)

        outs = [np.zeros(n, np.float32) for _ in range(world)]
        dist.all_gather(outs, data(rank, n))
        for r in range(world):
            np.testing.assert_array_equal(outs[r], data(r, n))

    # Rooted and personalised exchanges, on small arrays.
    gathered = [np.zeros(5, np.float32) for _ in range(world)] if rank == 0 else None
    dist.gather(data(rank, 5), gathered, dst=0)
    if rank == 0:
        for r in range(world):
            np.testing.assert_array_equal(gathered[r], data(r, 5))
    out = np.zeros(5, np.float32)
    dist.scatter(out, [data(r, 5) for r in range(world)] if rank == 0 else None, src=0)
    np.testing.assert_array_equal(out, data(rank, 5))
    pieces = [data(rank, 6) + 100 * r for r in range(world)]
    out = np.zeros(6, np.float32)
    dist.reduce_scatter(out, pieces)
    np.testing.assert_allclose(out, sum(data(q, 6) + 100 * rank for q in range(world)))
    received = [np.zeros(3, np.float32) for _ in range(world)]
    dist.all_to_all(received, [data(rank, 3) + 10 * r for r in range(world)])
    for q in range(world):
        np.testing.assert_array_equal(received[q], data(q, 3) + 10 * rank)

    # Point to point around a ring, and the object collectives.
    if world > 1:
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        inbox = np.zeros(4, np.float32)
        request = dist.isend(data(rank, 4), dst=nxt)
        dist.recv(inbox, src=prev)
        request.wait()
        np.testing.assert_array_equal(inbox, data(prev, 4))
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank, "host": os.uname().nodename})
    assert [o["rank"] for o in objects] == list(range(world))
    dist.barrier()
    print(f"[rank {rank}] catalogue ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
