"""The way from a round that ended to the next join (issue 34's low items).

- The outage budget of that join starts when the round ends (`meet_again()`), not when the
  agent, after its own calls on the way (each with its own timeout), calls next_rendezvous: a
  dead backend ends the agent join_outage_timeout after the round ended. An outage noticed
  before the join began counts from the last answer.
- The message then names the round the node ran, not the stale state it read last.
- A state that vanished (a lost etcd lease) is written again under the job's generation by a
  node that only waited to join, so the job keeps its restart count.
The real etcd cases are in tests/integration/test_shoal_run_etcd_outages.py and
test_shoal_run_lost_leases.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from shoal.collectives.store.hash import HashStore
from shoal.elastic.api import RendezvousSettings, RendezvousUnreachableError
from shoal.elastic.rendezvous import RendezvousHandler, reports
from shoal.elastic.rendezvous.join_outage import JoinOutage
from shoal.elastic.rendezvous.state import RendezvousState
from shoal.elastic.rendezvous.store_backend import StoreRendezvousBackend

from tests.support.rdzv import FlakyBackend


class _Bounded:
    """A backend or store stand-in that records the bound given to the calling thread."""

    def __init__(self):
        self.bounds = []

    def describe(self) -> str:
        return "a stand-in at test:1"

    def bound_calls(self, until) -> None:
        self.bounds.append(until)


def test_the_join_goes_on_with_the_outage_budget_the_round_end_started():
    store = _Bounded()
    outage = JoinOutage(_Bounded(), "a", 10.0, store)
    outage.begin_join()  # meet_again(): the round ended
    first = outage.deadline()
    time.sleep(0.05)
    outage.begin_join()  # next_rendezvous, later, on the same thread
    assert outage.deadline() == first
    # The store's calls on this thread end by the outage deadline, as it moves.
    assert callable(store.bounds[-1]) and store.bounds[-1]() == first
    outage.answered()
    assert store.bounds[-1]() > first
    outage.end_join()
    assert store.bounds[-1] is None
    # Another thread's join is its own.
    other = []
    thread = threading.Thread(target=lambda: (outage.begin_join(), other.append(outage.in_join())))
    thread.start()
    thread.join(5)
    assert other == [True] and not outage.in_join()


def test_an_outage_noticed_before_the_join_counts_from_the_last_answer():
    outage = JoinOutage(_Bounded(), "a", 10.0)
    outage.answered()
    answered = time.monotonic()
    time.sleep(0.05)
    outage.failed()  # e.g. a heartbeat failed
    time.sleep(0.05)
    outage.begin_join()
    assert outage.deadline() == pytest.approx(answered + 10.0, abs=0.02)
    outage.end_join()
    outage.answered()  # back: the next join counts from its own start again
    time.sleep(0.05)
    outage.begin_join()
    assert outage.deadline() >= time.monotonic() + 10.0 - 0.02
    outage.end_join()


def _settings(**kw) -> RendezvousSettings:
    base = dict(run_id="job", min_nodes=1, max_nodes=1, last_call_timeout=0, join_timeout=10.0,
                heartbeat_interval=0.1, heartbeat_timeout=3.0, join_outage_timeout=1.0)
    base.update(kw)
    return RendezvousSettings(**base)


def test_the_message_names_the_round_the_node_ran():
    settings = _settings()
    ran = RendezvousState(round=4, participants=("a",), complete=True)
    assert reports.waiting_for(ran, "a", settings, 4) == (
        "to meet again after round 4 of run 'job', the round it ran")
    assert reports.waiting_for(None, "a", settings, 4).startswith("to meet again after round 4")
    newer = RendezvousState(round=5, participants=("b",))
    assert reports.waiting_for(newer, "a", settings, 4).startswith("for round 5 of run 'job'")


def test_a_dead_backend_after_a_round_ends_the_join_one_budget_after_the_round_ended():
    store, down = HashStore(timeout=5), threading.Event()
    backend = FlakyBackend(StoreRendezvousBackend(store, "job"), down, label="switchable",
                           call_delay_s=0.02, watch_cap_s=0.2)
    handler = RendezvousHandler(backend, _settings(), "a", store, backend_timeout=1.0)
    try:
        handler.next_rendezvous()
        down.set()
        ended = time.monotonic()
        handler.meet_again()
        time.sleep(0.6)  # the agent's own calls on the way (failing) take this long
        with pytest.raises(RendezvousUnreachableError,
                           match="to meet again after round 0 of run 'job', the round it ran"):
            handler.next_rendezvous()
        took = time.monotonic() - ended
        # The budget (1 s) from the round's end, plus one retry step; not 0.6 s + 1 s.
        assert took < 1.0 + 0.5, took
    finally:
        down.clear()
        handler.shutdown()


def test_a_vanished_state_rewritten_by_a_waiting_node_keeps_the_job():
    store = HashStore(timeout=5)

    def handler(node):
        # Slow heartbeats: a (which ran the round) must not be the one to write the state again.
        slow = _settings(heartbeat_interval=5.0, heartbeat_timeout=15.0)
        return RendezvousHandler(StoreRendezvousBackend(store, "job"), slow, node, store)

    a, b = handler("a"), handler("b")
    try:
        a.next_rendezvous()
        a.job_store.add("agent/restarts", 2)
        joined = []
        thread = threading.Thread(target=lambda: joined.append(b.next_rendezvous()), daemon=True)
        thread.start()  # the round is full: b waits for it to end
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and '"b"' not in (store.get(
                "shoal/rdzv/job/state", 5) or b"").decode():
            time.sleep(0.02)
        store.delete("shoal/rdzv/job/state")  # the lease it hung on was lost
        thread.join(10)
        assert joined, "b never joined"
        assert joined[0].round >= 1  # after the round it saw, not round 0 of a new job
        assert int(b.job_store.add("agent/restarts", 0)) == 2
    finally:
        a.shutdown()
        b.shutdown()
