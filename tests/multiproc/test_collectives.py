"""Every collective of the tcp backend on real spawned ranks, compared with numpy's answer.

One spawned session per world size runs the whole catalogue (spawning costs more than the
collectives), including sizes not divisible by W, empty arrays, several dtypes, async ops,
subgroups and the object collectives.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.ranks import agent_store, run_ranks

SIZES = [0, 1, 7, 1000, 70_001, 1_200_003]  # up to ~4.8 MiB of float32: every algorithm
DTYPES = ["float32", "float64", "int32", "int64", "uint8", "float16"]


def _data(rank: int, n: int, dtype: str, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + salt + n)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(n).astype(dtype)
    hi = 3 if dtype == "uint8" else 1000
    return rng.integers(0, hi, n).astype(dtype)


def _reference(op: str, arrays: list[np.ndarray]) -> np.ndarray:
    # Rank order, as the backend reduces small arrays; ring results may differ in rounding.
    acc = arrays[0].astype(np.float64) if arrays[0].dtype.kind == "f" else arrays[0].copy()
    for x in arrays[1:]:
        x = x.astype(acc.dtype)
        acc = {"sum": np.add, "avg": np.add, "product": np.multiply, "min": np.minimum,
               "max": np.maximum}[op](acc, x)
    if op == "avg":
        acc = acc / len(arrays)
    return acc


def _catalogue(rank: int, world: int) -> dict:
    import shoal.collectives as c

    pg = c.init_process_group("tcp", init_method="env://", timeout=30)
    assert c.is_initialized() and c.get_rank() == rank and c.get_world_size() == world
    checks = 0

    def close(got, want, what, exact=False):
        nonlocal checks
        checks += 1
        if exact or got.dtype.kind in "iub":
            np.testing.assert_array_equal(got, want, err_msg=f"rank {rank}: {what}")
        else:
            tol = 2e-2 if got.dtype == np.float16 else 1e-5
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol,
                                       err_msg=f"rank {rank}: {what}")

    # all_reduce: every op, sizes and dtypes (products and min/max on small sizes).
    for n in SIZES:
        for dtype in (DTYPES if n <= 70_001 else ["float32"]):
            for op in ("sum", "max", "min", "avg", "product"):
                if op == "avg" and np.dtype(dtype).kind != "f":
                    continue
                if op == "product" and n > 1000:
                    continue
                mine = _data(rank, n, dtype)
                a = mine.copy()
                c.all_reduce(a, op=c.ReduceOp[op.upper()])
                close(a, _reference(op, [_data(r, n, dtype) for r in range(world)]),
                      f"all_reduce {op} {dtype}[{n}]")
    # Results agree bitwise across ranks (the DDP requirement), checked via all_gather.
    for n in (1000, 1_200_003):
        a = _data(rank, n, "float32")
        c.all_reduce(a)
        outs = [np.empty_like(a) for _ in range(world)]
        c.all_gather(outs, a)
        for o in outs:
            close(o, a, f"bitwise agreement [{n}]", exact=True)

    # broadcast from every root, all_gather, reduce, gather, scatter.
    for n in (0, 5, 70_001, 1_200_003):
        for src in range(world):
            a = _data(rank, n, "float32")
            c.broadcast(a, src=src)
            close(a, _data(src, n, "float32"), f"broadcast src={src} [{n}]", exact=True)
        x = _data(rank, n, "int32")
        outs = [np.empty(n, np.int32) for _ in range(world)]
        c.all_gather(outs, x)
        for r in range(world):
            close(outs[r], _data(r, n, "int32"), f"all_gather [{n}] from {r}")
        dst = world - 1
        y = _data(rank, n, "float64")
        c.reduce(y, dst=dst)
        want = _reference("sum", [_data(r, n, "float64") for r in range(world)]) if rank == dst else _data(rank, n, "float64")
        close(y, want, f"reduce dst={dst} [{n}]")
        gl = [np.empty(n, np.int32) for _ in range(world)] if rank == 0 else None
        c.gather(x, gl, dst=0)
        if rank == 0:
            for r in range(world):
                close(gl[r], _data(r, n, "int32"), f"gather [{n}] from {r}")
        sl = [_data(100 + j, n, "int32") for j in range(world)] if rank == 1 else None
        out = np.empty(n, np.int32)
        c.scatter(out, sl, src=1)
        close(out, _data(100 + rank, n, "int32"), f"scatter [{n}]")

    into = np.empty((world, 3), np.float32)
    c.all_gather_into_tensor(into, np.full(3, rank, np.float32))
    close(into, np.repeat(np.arange(world, dtype=np.float32), 3).reshape(world, 3), "all_gather_into_tensor")

    # reduce_scatter and all_to_all (uneven per-pair sizes).
    for n in (0, 3, 300_001):
        ins = [_data(rank, n, "float32", salt=j) for j in range(world)]
        out = np.empty(n, np.float32)
        c.reduce_scatter(out, ins)
        close(out, _reference("sum", [_data(r, n, "float32", salt=rank) for r in range(world)]),
              f"reduce_scatter [{n}]")
    ins = [np.full(rank + j + 1, 10 * rank + j, np.int64) for j in range(world)]
    outs = [np.empty(j + rank + 1, np.int64) for j in range(world)]
    c.all_to_all(outs, ins)
    for j in range(world):
        close(outs[j], np.full(j + rank + 1, 10 * j + rank, np.int64), f"all_to_all from {j}")

    # Objects.
    objs = [None] * world
    c.all_gather_object(objs, {"rank": rank, "name": f"r{rank}"})
    assert objs == [{"rank": r, "name": f"r{r}"} for r in range(world)]
    lst = [("hello", 1), [1, 2, 3]] if rank == 0 else [None, None]
    c.broadcast_object_list(lst, src=0)
    assert lst == [("hello", 1), [1, 2, 3]]

    # Point to point with tags, out of order, and from any source.
    if rank == 0:
        for q in range(1, world):
            c.send(np.arange(4, dtype=np.float32) + q, dst=q, tag=7)
            c.send(np.full(2, q, np.int16), dst=q, tag=8)
        got = set()
        for _ in range(1, world):
            buf = np.empty(1, np.int64)
            got.add((c.recv(buf, src=None, tag=9), int(buf[0])))
        assert got == {(q, q * 100) for q in range(1, world)}, got
    else:
        b8 = np.empty(2, np.int16)
        b7 = np.empty(4, np.float32)
        assert c.recv(b8, src=0, tag=8) == 0
        assert c.recv(b7, src=0, tag=7) == 0
        close(b8, np.full(2, rank, np.int16), "recv tag 8")
        close(b7, np.arange(4, dtype=np.float32) + rank, "recv tag 7")
        c.send(np.array([rank * 100]), dst=0, tag=9)

    # Several outstanding async ops of mixed kinds complete correctly and in order.
    arrays_ = [np.full(n, rank + i, np.float32) for i, n in enumerate((10, 100_000, 2_000_000, 10))]
    works = [c.all_reduce(a, async_op=True) for a in arrays_]
    bw = c.broadcast(b := np.full(50, rank, np.int32), src=0, async_op=True)
    order = []
    for w in works:
        w.add_done_callback(lambda w_: order.append(w_.seq))
    for i, (w, a) in enumerate(zip(works, arrays_)):
        assert w.wait(timeout=20) and w.is_completed() and w.is_success() and w.exception() is None
        close(a, np.full(a.size, sum(r + i for r in range(world)), np.float32), f"async all_reduce {i}")
    bw.wait(timeout=20)
    close(b, np.zeros(50, np.int32), "async broadcast")
    assert order == sorted(order), order

    # A subgroup of the first two ranks, and its non-members.
    sub = c.new_group([0, 1], timeout=20)
    if rank < 2:
        assert c.get_rank(sub) == rank and c.get_world_size(sub) == 2
        a = np.full(3, rank + 1.0)
        c.all_reduce(a, group=sub)
        close(a, np.full(3, 3.0), "subgroup all_reduce")
        b = np.full(2, rank, np.int32)
        c.broadcast(b, src=1, group=sub)
        close(b, np.full(2, 1, np.int32), "subgroup broadcast")
    else:
        assert sub is c.GroupMember.NON_GROUP_MEMBER and c.get_rank(sub) == -1
        assert c.all_reduce(np.ones(3), group=sub) is None
    c.barrier()
    c.monitored_barrier(timeout=20, wait_all_ranks=True)
    seq = pg._engine.seq
    transports = set(pg._mesh.transports) - {"self"}
    shared_memory = pg._shm is not None
    c.destroy_process_group()
    assert not c.is_initialized()
    return {"checks": checks, "seq": seq, "transports": transports, "shm": shared_memory}


# "shm" links same-host ranks over Unix sockets and reduces large arrays in shared memory;
# "tcp" runs every algorithm over loopback sockets.
@pytest.mark.parametrize("world,transport", [(2, "shm"), (3, "tcp"), (4, "shm")])
def test_every_collective_matches_numpy(world, transport):
    store, env = agent_store()
    env["SHOAL_LOCAL_TRANSPORT"] = transport  # same-host Unix links by default; TCP on request
    try:
        results = run_ranks(_catalogue, world, timeout=110, env=env)
    finally:
        store.close()
    # Every rank ran the same number of group collectives and checks.
    assert len({r["seq"] for r in results}) == 1
    assert all(r["checks"] > 100 for r in results), results
    links = "tcp" if transport == "tcp" else "unix"
    assert all(r["transports"] == {links} for r in results), results
    assert all(r["shm"] == (transport == "shm") for r in results), results
