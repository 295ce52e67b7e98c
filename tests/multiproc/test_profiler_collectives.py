"""Collective events from the op ledger in two spawned tcp ranks: op, sequence number, bytes and
the call for each collective and point-to-point op, the same numbers on both ranks."""

from __future__ import annotations

import numpy as np

from tests.support.ranks import agent_store, run_ranks


def _session(rank: int, world: int) -> list:
    import shoal.collectives as c
    from shoal.core import profiler

    c.init_process_group("tcp", init_method="env://", timeout=30)
    c.barrier()  # outside the profile: not recorded
    with profiler.profile() as prof:
        a = np.ones(1000, np.float32)
        c.all_reduce(a)
        c.broadcast(np.zeros(10, np.float64), src=0)
        out = [np.empty(4, np.int32) for _ in range(world)]
        c.all_gather(out, np.full(4, rank, np.int32))
        c.all_reduce(np.ones(8), async_op=True).wait(10)
        if rank == 0:
            c.send(np.arange(5.0), dst=1)
        else:
            c.recv(np.empty(5), src=0)
    c.destroy_process_group()
    events = [fe for fe in prof.events() if fe.ev.cat == "collective"]
    assert {fe.ev.args["group"] for fe in events} == {"default"}
    return [(fe.ev.name, fe.ev.args["seq"], fe.ev.args["bytes"], fe.ev.args["p2p"],
             fe.ev.args["call"], fe.ev.dur) for fe in events]


def test_every_collective_is_an_event_with_its_sequence_number_and_bytes():
    store, env = agent_store()
    try:
        results = run_ranks(_session, 2, timeout=60, env=env)
    finally:
        store.close()
    for rank, events in enumerate(results):
        coll = sorted((e for e in events if not e[3]), key=lambda e: e[1])
        assert [(name, nbytes) for name, _, nbytes, _, _, _ in coll] == [
            ("all_reduce", 4000), ("broadcast", 80), ("all_gather", 16), ("all_reduce", 64)]
        seqs = [seq for _, seq, _, _, _, _ in coll]
        assert seqs == list(range(seqs[0], seqs[0] + 4))  # consecutive, after the barrier's
        p2p = [e for e in events if e[3]]
        assert [(e[0], e[2]) for e in p2p] == [("send" if rank == 0 else "recv", 40)]
        assert all(e[5] >= 0 for e in events)
    # the same collective carries the same number on both ranks
    assert [e[1] for e in results[0] if not e[3]] == [e[1] for e in results[1] if not e[3]]


def _subgroup_session(rank: int, world: int) -> list:
    import shoal.collectives as c
    from shoal.core import profiler

    c.init_process_group("tcp", init_method="env://", timeout=30)
    numbered = c.new_group([0, 1])
    named = c.new_group([0, 1], group_name="pairs")
    with profiler.profile() as prof:
        c.all_reduce(np.ones(4, np.float32))
        c.all_reduce(np.ones(8, np.float32), group=numbered)
        c.all_reduce(np.ones(16, np.float32), group=named)
        c.broadcast(np.zeros(2, np.float64), src=1, group=named)
    c.destroy_process_group()
    return [(fe.ev.name, fe.ev.args["group"], fe.ev.args["seq"], fe.ev.args["bytes"])
            for fe in prof.events() if fe.ev.cat == "collective"]


def test_a_subgroups_collectives_carry_its_name_and_its_own_numbers():
    store, env = agent_store()
    try:
        results = run_ranks(_subgroup_session, 2, timeout=60, env=env)
    finally:
        store.close()
    for events in results:
        by_group = {}
        for name, group, seq, nbytes in events:
            by_group.setdefault(group, []).append((name, seq, nbytes))
        assert sorted(by_group) == ["default", "group1", "pairs"]
        assert [(n, b) for n, _, b in by_group["group1"]] == [("all_reduce", 32)]
        assert [(n, b) for n, _, b in by_group["pairs"]] == [("all_reduce", 64),
                                                             ("broadcast", 16)]
        # each group numbers its own collectives from 1 (a new group has run none before)
        assert [seq for _, seq, _ in by_group["pairs"]] == [1, 2]
        assert [seq for _, seq, _ in by_group["group1"]] == [1]
    assert results[0] == results[1]
