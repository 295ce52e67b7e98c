"""The per-rank series that name a hung rank and count every group failure, read from the
ranks' own registries (real processes, a real TCPStore):

- a rank inside a long all_reduce reports since when, and the world rank it waits for (the one
  that never arrived), within a couple of seconds, and both go back to 0 once it completes;
- a peer SIGKILLed between two collectives fails the group and is counted in
  shoal_collectives_errors_total at once, with op "none", although no collective ran; a failure
  during a collective is counted once for that collective, not twice.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from tests.support.ranks import EVENTS, Ranks, agent_store

WAITING = "shoal_collectives_waiting_for_rank_since_timestamp_seconds"
INSIDE = "shoal_collectives_in_collective_since_timestamp_seconds"
ERRORS = "shoal_collectives_errors_total"


def _value(name: str, **labels) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def _poll(check, seconds: float):
    """`check()`'s first truthy answer within `seconds` (None without one)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        answer = check()
        if answer:
            return answer
        time.sleep(0.05)
    return None


def _late_arrival(rank, world, events):
    import shoal.collectives as c

    c.init_process_group("tcp", init_method="env://", timeout=30)
    c.all_reduce(np.ones(4))
    if rank == 1:
        time.sleep(4.0)  # rank 0 waits for this rank meanwhile
        c.all_reduce(np.ones(4))
        c.destroy_process_group()
        return None
    started = time.time()
    done = {}

    def reduce_late():
        c.all_reduce(np.ones(4), timeout=20)
        done["at"] = time.time()

    worker = threading.Thread(target=reduce_late)
    worker.start()
    # WAIT_REPORT_AFTER_S (1 s) plus a watchdog tick and one read of the others' progress.
    waiting = _poll(lambda: _value(WAITING, rank="0", peer="1"), 3.5)
    inside = _value(INSIDE, rank="0")
    worker.join(20)
    cleared = _poll(lambda: _value(WAITING, rank="0", peer="1") == 0
                    and _value(INSIDE, rank="0") == 0 and "at" in done, 3.0)
    c.destroy_process_group()
    return started, waiting, inside, bool(cleared)


def test_a_waiting_rank_names_the_rank_it_waits_for():
    store, env = agent_store()
    try:
        with Ranks(_late_arrival, 2, (EVENTS,), env) as ranks:
            results = ranks.results(timeout=60)
    finally:
        store.close()
    status, value = results[0]
    assert status == "ok", value
    started, waiting, inside, cleared = value
    # Both are the all_reduce's start on rank 0's clock: after `started`, and well before the
    # 1 s report threshold plus the poll ran out.
    assert waiting and started - 0.5 <= waiting <= started + 1.0, value
    assert inside == waiting, value
    assert cleared, value
    assert results[1][0] == "ok", results[1]


def _peer_killed_between_ops(rank, world, events):
    import shoal.collectives as c

    pg = c.init_process_group("tcp", init_method="env://", timeout=30)
    c.all_reduce(np.ones(4))
    before = {(op, kind): _value(ERRORS, op=op, kind=kind)
              for op in ("none", "all_reduce") for kind in ("peer_lost", "error")}
    events.put(("ready", rank))
    if rank == 1:
        time.sleep(60)  # killed by the test
        return None
    end = time.monotonic() + 20
    while pg.failure is None and time.monotonic() < end:
        time.sleep(0.02)
    counted = {key: _value(ERRORS, op=key[0], kind=key[1]) - n for key, n in before.items()}
    try:
        c.all_reduce(np.ones(4), timeout=5)
    except c.PeerLost:
        pass
    after = {key: _value(ERRORS, op=key[0], kind=key[1]) - n for key, n in before.items()}
    return pg.failure, counted, after


def test_a_peer_killed_between_collectives_is_counted_at_once():
    store, env = agent_store()
    try:
        with Ranks(_peer_killed_between_ops, 2, (EVENTS,), env) as ranks:
            assert {ranks.event(30)[1], ranks.event(30)[1]} == {0, 1}
            ranks.kill(1)
            results = ranks.results(timeout=60, ranks=[0])
    finally:
        store.close()
    status, value = results[0]
    assert status == "ok", value
    failure, counted, after = value
    assert failure is not None and "rank 1" in failure, failure
    # Counted when the group failed, with no collective running ...
    assert counted == {("none", "peer_lost"): 1.0, ("none", "error"): 0.0,
                       ("all_reduce", "peer_lost"): 0.0, ("all_reduce", "error"): 0.0}, counted
    # ... and the next all_reduce, refused by the failed group, counts once more.
    assert after[("all_reduce", "peer_lost")] == 1.0 and after[("none", "peer_lost")] == 1.0, after
