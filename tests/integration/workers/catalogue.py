"""Every collective, checked against numpy on every rank (run under `shoal run`, one or more
ranks per host): the multi-host tests run it across network-namespace hosts, the single-host
shared-memory test on one.

Sizes cover one message (7 elements), the pumped ring or a single shared-memory step (70k) and
several pipelined steps (1.5M float32, 6 MB, more than the 4 MiB shared-memory slots). Then
the same on subgroups: the first three ranks (under 2 hosts x 2 ranks: hosts of unequal size)
and the last rank of each host (one rank per host).

Prints "[rank R] path <what the default group uses> hosts <topology>", "[rank R] receive
buffers <one word per peer>" (fixed: the link's receive buffer is shoal's fixed size; auto:
the kernel autotunes it, as between hosts), and, at the end, "[rank R] catalogue ok"; any
difference raises (the worker fails).
"""

from __future__ import annotations

import hashlib
import os
import socket

import numpy as np

import shoal.collectives as dist
from shoal.collectives import ReduceOp

SIZES = (7, 70_001, 1_500_000)


def data(rank: int, n: int, dtype=np.float32) -> np.ndarray:
    return ((np.arange(n) % 97) + 3 * rank + 1).astype(dtype)


def same_everywhere(x: np.ndarray, group, size: int, what: str) -> None:
    """Bitwise identical on every rank of the group (the rule of every algorithm)."""
    digest = np.frombuffer(hashlib.sha256(x.tobytes()).digest(), np.uint8).copy()
    digests = [np.zeros_like(digest) for _ in range(size)]
    dist.all_gather(digests, digest, group=group)
    assert all((d == digest).all() for d in digests), f"{what} differs between ranks"


def catalogue(group, members: list[int], rank: int, n: int) -> None:
    """Every collective on `group` (whose world ranks are `members`) with `n` elements."""
    size = len(members)
    me = members.index(rank)
    ref = [data(r, n) for r in members]
    tag = f"group {members} n={n}"
    for op, expect in ((ReduceOp.SUM, sum(ref)), (ReduceOp.MAX, np.maximum.reduce(ref)),
                       (ReduceOp.MIN, np.minimum.reduce(ref)), (ReduceOp.AVG, sum(ref) / size)):
        x = data(rank, n)
        dist.all_reduce(x, op=op, group=group)
        np.testing.assert_allclose(x, expect, rtol=1e-6, err_msg=f"all_reduce {op} {tag}")
        same_everywhere(x, group, size, f"all_reduce {op} {tag}")

    for src in members:
        x = data(rank, n)
        dist.broadcast(x, src=src, group=group)
        np.testing.assert_array_equal(x, data(src, n), err_msg=f"broadcast from {src} {tag}")

    for dst in (members[0], members[-1]):
        x = data(rank, n)
        dist.reduce(x, dst=dst, group=group)
        np.testing.assert_allclose(x, sum(ref) if rank == dst else data(rank, n), rtol=1e-6,
                                   err_msg=f"reduce to {dst} {tag}")

    outs = [np.zeros(n, np.float32) for _ in range(size)]
    dist.all_gather(outs, data(rank, n), group=group)
    for i, r in enumerate(members):
        np.testing.assert_array_equal(outs[i], data(r, n), err_msg=f"all_gather {tag}")

    # Block i of every rank goes to rank i: made distinct per (sender, receiver).
    for op in (ReduceOp.SUM, ReduceOp.AVG):
        out = np.zeros(n, np.float32)
        dist.reduce_scatter(out, [data(rank, n) + 100 * i for i in range(size)], op=op,
                            group=group)
        expect = sum(data(q, n) + 100 * me for q in members)
        if op is ReduceOp.AVG:
            expect = expect / size
        np.testing.assert_allclose(out, expect, rtol=1e-6, err_msg=f"reduce_scatter {op} {tag}")

    root = members[-1]
    gathered = [np.zeros(n, np.float32) for _ in range(size)] if rank == root else None
    dist.gather(data(rank, n), gathered, dst=root, group=group)
    if rank == root:
        for i, r in enumerate(members):
            np.testing.assert_array_equal(gathered[i], data(r, n), err_msg=f"gather {tag}")
    out = np.zeros(n, np.float32)
    blocks = [data(r, n) * 2 for r in members] if rank == root else None
    dist.scatter(out, blocks, src=root, group=group)
    np.testing.assert_array_equal(out, data(rank, n) * 2, err_msg=f"scatter {tag}")

    # all_to_all with blocks of different sizes: rank a sends rank b a block of n + a + 2b.
    sizes = lambda a, b: n + a + 2 * b  # noqa: E731
    ins = [data(rank, sizes(me, j)) + 10 * j for j in range(size)]
    received = [np.zeros(sizes(i, me), np.float32) for i in range(size)]
    dist.all_to_all(received, ins, group=group)
    for i, q in enumerate(members):
        np.testing.assert_array_equal(received[i], data(q, sizes(i, me)) + 10 * me,
                                      err_msg=f"all_to_all {tag}")


def tensor_and_object_forms(world: int, rank: int, n: int) -> None:
    """torch's tensor, single, coalesced, object and batched point-to-point forms on the default
    group: they reach the same algorithms through other entry points."""
    ref = [data(r, n) for r in range(world)]
    gathered = np.zeros(world * n, np.float32)
    dist.all_gather_into_tensor(gathered, data(rank, n))
    np.testing.assert_array_equal(gathered, np.concatenate(ref), err_msg="all_gather_into_tensor")

    out = np.zeros(n, np.float32)
    dist.reduce_scatter_tensor(out, np.concatenate([data(rank, n) + 100 * i
                                                    for i in range(world)]))
    np.testing.assert_allclose(out, sum(ref) + 100 * rank * world, rtol=1e-6,
                               err_msg="reduce_scatter_tensor")
    same_everywhere(gathered, None, world, "all_gather_into_tensor")

    # all_to_all_single with uneven splits: rank a sends rank b (a + b + 1) * 1000 elements.
    splits_in = [(rank + b + 1) * 1000 for b in range(world)]
    splits_out = [(a + rank + 1) * 1000 for a in range(world)]
    send = np.concatenate([data(rank, k) + 10 * b for b, k in enumerate(splits_in)])
    received = np.zeros(sum(splits_out), np.float32)
    dist.all_to_all_single(received, send, splits_out, splits_in)
    expect = np.concatenate([data(a, k) + 10 * rank for a, k in enumerate(splits_out)])
    np.testing.assert_array_equal(received, expect, err_msg="all_to_all_single")

    pieces = [data(rank, n), data(rank, 7) * 2]
    dist.all_reduce_coalesced(pieces)
    np.testing.assert_allclose(pieces[0], sum(ref), rtol=1e-6, err_msg="all_reduce_coalesced")
    np.testing.assert_allclose(pieces[1], sum(data(r, 7) * 2 for r in range(world)), rtol=1e-6,
                               err_msg="all_reduce_coalesced (second tensor)")

    objects = [{"from": rank}] if rank == world - 1 else [None]
    dist.broadcast_object_list(objects, src=world - 1)
    assert objects == [{"from": world - 1}], objects
    gathered_objects = [None] * world if rank == 0 else None
    dist.gather_object(("rank", rank), gathered_objects, dst=0)
    if rank == 0:
        assert gathered_objects == [("rank", r) for r in range(world)], gathered_objects
    mine = [None]
    dist.scatter_object_list(mine, [f"to {r}" for r in range(world)] if rank == 0 else None,
                             src=0)
    assert mine == [f"to {rank}"], mine

    if world > 1:
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        inbox = np.zeros(n, np.float32)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, data(rank, n), nxt),
                                        dist.P2POp(dist.irecv, inbox, prev)])
        for work in works:
            work.wait()
        np.testing.assert_array_equal(inbox, data(prev, n), err_msg="batch_isend_irecv")


def subgroups(world: int, per_host: int) -> list[list[int]]:
    groups = []
    if world >= 3:
        groups.append([0, 1, 2])
    if per_host > 1 and world > per_host:
        groups.append([h * per_host + per_host - 1 for h in range(world // per_host)])
    return groups


def receive_buffers(pg, rank: int, world: int) -> str:
    """Per peer in rank order, whether our data sockets to it keep fixed receive buffers."""
    from shoal.collectives.constants import SOCKET_BUFFER_BYTES

    mesh = pg._mesh
    words = []
    for peer in range(world):
        if peer == rank:
            continue
        fixed = [end.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == 2 * SOCKET_BUFFER_BYTES
                 for end in (mesh.tx[peer], mesh.rx[peer])]
        words.append("fixed" if all(fixed) else "auto" if not any(fixed) else "mixed")
        # The same verdict decides the ring's thread (Links.reaches_another_host).
        if mesh.remote[peer] != (words[-1] == "auto"):
            raise SystemExit(f"rank {rank}: peer {peer} has {words[-1]} receive buffers but "
                             f"the mesh says remote={mesh.remote[peer]}")
    return " ".join(words)


def main() -> None:
    dist.init_process_group("tcp", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    pg = dist.get_default_group()
    path = ("hierarchical" if getattr(pg, "hierarchical", False)
            else "shared memory" if getattr(pg, "uses_shared_memory", False) else "sockets")
    hosts = pg.topology.describe() if hasattr(pg, "topology") else "?"
    print(f"[rank {rank}] path {path} hosts {hosts}", flush=True)
    if getattr(pg, "hierarchical", False):
        print(f"[rank {rank}] leaders per host {pg.topology.leaders_per_host}", flush=True)
    if world > 1 and hasattr(pg, "_mesh"):
        print(f"[rank {rank}] receive buffers {receive_buffers(pg, rank, world)}", flush=True)

    everyone = list(range(world))
    for n in SIZES:
        catalogue(None, everyone, rank, n)
    for members in subgroups(world, per_host):
        sub = dist.new_group(members)
        if rank in members:
            for n in SIZES[1:]:
                catalogue(sub, members, rank, n)

    tensor_and_object_forms(world, rank, SIZES[1])

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
