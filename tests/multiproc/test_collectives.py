"""The tcp backend in a world of real spawned processes: what threads of one process cannot show.

Every collective's semantics (each op and dtype family, Work, bad input, mismatches, timeouts,
subgroups, W = 1..3) are the contract's, checked on every backend in
tests/contracts/test_process_group_contract.py with ranks as threads. Here, one spawned session
per local transport mode checks the process world: init_process_group("env://") and the default
group's queries, the links and shared memory set up between processes, large arrays across
processes on every algorithm (bitwise agreement included), world ranks in the module-level API
on a subgroup, non-members of a subgroup, any-source receives naming world ranks, the object
collectives on the default group, and destroy_process_group.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.ranks import agent_store, run_ranks

LARGE_SIZES = [70_001, 1_200_003]  # past the direct exchange; past the threaded-ring threshold


def _data(rank: int, n: int, salt: int = 0) -> np.ndarray:
    return np.random.default_rng([rank, salt, n]).standard_normal(n).astype(np.float32)


def _session(rank: int, world: int) -> dict:
    import shoal.collectives as c

    pg = c.init_process_group("tcp", init_method="env://", timeout=30)
    assert c.is_initialized() and c.get_backend() == "tcp"
    assert (c.get_rank(), c.get_world_size()) == (rank, world)
    assert c.get_default_group() is pg and c.get_process_group_ranks(None) == list(range(world))

    # Large arrays between processes: sums close to numpy's, bitwise the same on every rank.
    for n in LARGE_SIZES:
        a = _data(rank, n)
        c.all_reduce(a)
        want = np.sum([_data(r, n).astype(np.float64) for r in range(world)], axis=0)
        np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-5, err_msg=f"rank {rank}: [{n}]")
        every = [np.empty_like(a) for _ in range(world)]
        c.all_gather(every, a)
        for q, other in enumerate(every):
            assert other.tobytes() == a.tobytes(), f"ranks {rank} and {q} disagree on [{n}]"
        b = _data(rank, n, salt=1)
        c.broadcast(b, src=world - 1)
        assert b.tobytes() == _data(world - 1, n, salt=1).tobytes()

    # Any-source receives name the sender's world rank.
    if rank == 0:
        got = {}
        for _ in range(1, world):
            buf = np.empty(1, np.int64)
            src = c.recv(buf, src=None, tag=9)
            got[src] = int(buf[0])
        assert got == {q: 100 * q for q in range(1, world)}, got
    else:
        c.send(np.array([100 * rank]), dst=0, tag=9)

    # A subgroup of world ranks 1..W-1: module-level calls take world ranks; rank 0 is outside.
    members = list(range(1, world))
    sub = c.new_group(members, timeout=20)
    if rank == 0:
        assert sub is c.GroupMember.NON_GROUP_MEMBER
        assert c.get_rank(sub) == -1 and c.get_world_size(sub) == -1
        assert c.all_reduce(np.ones(3), group=sub) is None
        assert c.recv(np.ones(3), src=1, group=sub) == -1
    else:
        assert c.get_process_group_ranks(sub) == members
        assert (c.get_rank(sub), c.get_world_size(sub)) == (rank - 1, world - 1)
        x = np.full(3, float(rank))
        c.broadcast(x, src=world - 1, group=sub)
        assert x.tolist() == [world - 1.0] * 3
        if world > 2 and rank == world - 1:
            buf = np.empty(2, np.int32)
            assert c.recv(buf, src=None, group=sub) == 1  # a world rank, not the group's 0
            assert buf.tolist() == [7, 7]
        elif world > 2 and rank == 1:
            c.send(np.full(2, 7, np.int32), dst=world - 1, group=sub)
        with pytest.raises(ValueError, match="src 0 is not a member of group"):
            c.broadcast(x, src=0, group=sub)

    # Object collectives through the module-level API of the default group.
    objs = [None] * world
    c.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(world)]
    lst = [("hello", 1), [1, 2, 3]] if rank == 0 else [None, None]
    c.broadcast_object_list(lst, src=0)
    assert lst == [("hello", 1), [1, 2, 3]]

    c.barrier()
    c.monitored_barrier(timeout=20, wait_all_ranks=True)
    links = set(pg.transports) - {"self"}
    shared_memory = pg.uses_shared_memory
    c.destroy_process_group()
    assert not c.is_initialized()
    return {"links": links, "shm": shared_memory}


# "shm" links same-host processes over Unix sockets and reduces large arrays in shared memory
# they map from each other; "unix" uses the sockets only; "tcp" runs every link over loopback.
@pytest.mark.parametrize("world, transport", [(2, "shm"), (3, "unix"), (4, "tcp")])
def test_process_world_in_each_local_transport_mode(world, transport):
    store, env = agent_store()
    env["SHOAL_LOCAL_TRANSPORT"] = transport
    try:
        results = run_ranks(_session, world, timeout=110, env=env)
    finally:
        store.close()
    links = "tcp" if transport == "tcp" else "unix"
    assert all(r["links"] == {links} for r in results), results
    assert all(r["shm"] == (transport == "shm") for r in results), results
