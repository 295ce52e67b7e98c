"""The rendezvous state machine with several handlers as threads over one in-process store.

Dead nodes are simulated by stopping a handler's heartbeat thread without leaving, which is
what the others see of a node whose process was killed.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from shoal.collectives.store.hash import HashStore
from shoal.elastic.rendezvous.state import RendezvousState
from shoal.elastic.api import (
    RendezvousBackend,
    RendezvousClosedError,
    RendezvousError,
    RendezvousSettings,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from shoal.elastic.rendezvous.store_backend import StoreRendezvousBackend
from shoal.elastic.rendezvous import RendezvousHandler, create_backend, create_handler

from tests.support.rdzv import FlakyBackend

WAIT_S = 30.0  # generous: things that should happen


def settings(**kw) -> RendezvousSettings:
    base = dict(run_id="job", min_nodes=2, max_nodes=2, last_call_timeout=0.3,
                join_timeout=20.0, heartbeat_interval=0.1, heartbeat_timeout=3.0)
    base.update(kw)
    return RendezvousSettings(**base)


class Cluster:
    """Handlers over one HashStore, and a pool to run their blocking calls on."""

    def __init__(self, backend_wrapper=None, **kw):
        self.store = HashStore(timeout=10)
        self.settings = settings(**kw)
        self.wrapper = backend_wrapper
        self.handlers: dict[str, RendezvousHandler] = {}
        self.dead: dict[str, threading.Event] = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(8)

    def handler(self, node: str, **kw) -> RendezvousHandler:
        backend: RendezvousBackend = StoreRendezvousBackend(self.store, self.settings.run_id)
        if self.wrapper is not None:
            backend = self.wrapper(backend)
        # A killed node's backend goes silent, so no thread of it can write any more.
        self.dead[node] = threading.Event()
        backend = FlakyBackend(backend, self.dead[node])
        s = settings(**{**self.settings.__dict__, **kw}) if kw else self.settings
        h = RendezvousHandler(backend, s, node, self.store)
        self.handlers[node] = h
        return h

    def join(self, *nodes: str) -> list[concurrent.futures.Future]:
        return [self.pool.submit(self.handlers[n].next_rendezvous) for n in nodes]

    def kill(self, node: str) -> None:
        """Stop a node's heartbeats without leaving, as a SIGKILL would."""
        h = self.handlers[node]
        self.dead[node].set()
        h._stop.set()
        h._heartbeat_thread.join(10)
        assert not h._heartbeat_thread.is_alive()

    def close(self):
        for node, h in self.handlers.items():
            if not self.dead[node].is_set():
                h.shutdown()
        self.pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture
def cluster():
    made = []

    def make(**kw):
        c = Cluster(**kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def results(futures):
    return [f.result(WAIT_S) for f in futures]


def wait_for(predicate, what: str, timeout: float = WAIT_S):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    pytest.fail(f"{what} did not happen within {timeout}s")


def test_max_nodes_completes_at_once_with_sorted_ranks(cluster):
    c = cluster(min_nodes=1, max_nodes=3, last_call_timeout=60)
    for n in ("c", "a", "b"):
        c.handler(n)
    start = time.monotonic()
    infos = results(c.join("c", "a", "b"))
    assert time.monotonic() - start < 30  # far below the 60 s last call
    assert [i.round for i in infos] == [0, 0, 0]
    assert all(i.participants == ["a", "b", "c"] and i.num_nodes == 3 for i in infos)
    assert [i.group_rank for i in infos] == [2, 0, 1]


def test_min_nodes_complete_after_the_last_call(cluster):
    c = cluster(min_nodes=2, max_nodes=4, last_call_timeout=0.5)
    c.handler("a"), c.handler("b")
    start = time.monotonic()
    infos = results(c.join("a", "b"))
    assert time.monotonic() - start >= 0.5
    assert [i.participants for i in infos] == [["a", "b"], ["a", "b"]]


def test_one_node_short_of_min_times_out_naming_who_joined(cluster):
    c = cluster(min_nodes=2, max_nodes=2, join_timeout=1.0)
    c.handler("a")
    with pytest.raises(RendezvousTimeoutError,
                       match=r"Node a timed out after 1s joining round 0 of run 'job', "
                             r"with 1 of min_nodes=2 joined \(a\)"):
        c.handlers["a"].next_rendezvous()
    # The node left: the state no longer lists it.
    state = RendezvousState.decode(c.handlers["a"].backend.get_state()[0])
    assert state.participants == ()  # the state holds tuples: it is an immutable value


def test_round_store_is_scoped_and_master_address_is_shared(cluster):
    c = cluster()
    c.handler("a"), c.handler("b")
    ia, ib = results(c.join("a", "b"))
    ia.publish_master("127.0.0.1", 29500)
    assert ib.read_master(timeout=5) == ("127.0.0.1", 29500)
    generation = RendezvousState.decode(c.store.get("shoal/rdzv/job/state").split(b"\n", 1)[1]
                                        ).generation
    assert len(generation) == 16  # made by the first node: the job's keys live under it
    stored = c.store.get(f"rdzv/job/{generation}/round_0/master_addr_port")
    assert stored.startswith(b"SHV1") and stored.endswith(b"127.0.0.1:29500")  # sealed


def test_dead_node_requests_restart_and_survivors_form_the_next_round(cluster):
    # A long last call: round 0 waits for all three (max_nodes), however slow a thread is.
    c = cluster(min_nodes=2, max_nodes=3, last_call_timeout=60, heartbeat_timeout=1.5)
    for n in "abc":
        c.handler(n)
    infos = results(c.join("a", "b", "c"))
    assert infos[0].participants == ["a", "b", "c"]
    assert c.handlers["a"].restart_requested() is None
    c.kill("c")
    reason = wait_for(c.handlers["a"].restart_requested, "a seeing c's death")
    assert "node c sent no heartbeat" in reason
    assert c.handlers["b"].restart_requested() == reason
    assert c.handlers["a"].dead_nodes() == ["c"]
    start = time.monotonic()
    a1, b1 = results(c.join("a", "b"))
    assert (a1.round, a1.participants, b1.participants) == (1, ["a", "b"], ["a", "b"])
    assert time.monotonic() - start < 10  # no last call: both expected survivors came back
    assert c.handlers["a"].restart_requested() is None


def test_late_joiner_waits_and_triggers_a_scale_up_round(cluster):
    c = cluster(min_nodes=2, max_nodes=3, last_call_timeout=0.2)
    for n in "abc":
        c.handler(n)
    results(c.join("a", "b"))
    assert c.handlers["a"].num_nodes_waiting() == 0
    (late,) = c.join("c")
    wait_for(lambda: c.handlers["a"].num_nodes_waiting() == 1, "c counted as waiting")
    assert not late.done()
    infos = results(c.join("a", "b")) + [late.result(WAIT_S)]
    assert [(i.round, i.participants) for i in infos] == [(1, ["a", "b", "c"])] * 3
    assert c.handlers["a"].num_nodes_waiting() == 0


def test_a_full_round_reports_no_waiting_nodes(cluster):
    c = cluster(min_nodes=2, max_nodes=2)
    for n in "abc":
        c.handler(n)
    results(c.join("a", "b"))
    (late,) = c.join("c")
    wait_for(lambda: "c" in RendezvousState.decode(c.store.get("shoal/rdzv/job/state")
                                                  .partition(b"\n")[2]).wait_list, "c waiting")
    assert c.handlers["a"].num_nodes_waiting() == 0
    c.handlers["a"].set_closed()
    with pytest.raises(RendezvousClosedError):
        late.result(WAIT_S)


def test_signal_restart_reaches_every_node_and_a_new_round_follows(cluster):
    c = cluster()
    c.handler("a"), c.handler("b")
    results(c.join("a", "b"))
    c.handlers["b"].signal_restart("worker 3 exited with code -9")
    assert c.handlers["a"].restart_requested() == (
        "worker 3 exited with code -9 (signalled by node b)")
    infos = results(c.join("a", "b"))
    assert [i.round for i in infos] == [1, 1]
    assert c.handlers["a"].restart_requested() is None


def test_a_participant_rejoining_opens_a_round_the_others_notice(cluster):
    c = cluster()
    c.handler("a"), c.handler("b")
    results(c.join("a", "b"))
    (fa,) = c.join("a")
    reason = wait_for(c.handlers["b"].restart_requested, "b noticing a new round")
    assert reason == "node a asked for a new round after round 0"
    assert c.handlers["b"].next_rendezvous().round == 1
    assert fa.result(WAIT_S).round == 1


def test_shutdown_leaves_and_the_others_restart_at_the_smaller_size(cluster):
    c = cluster(min_nodes=1, max_nodes=2, last_call_timeout=60)
    c.handler("a"), c.handler("b")
    results(c.join("a", "b"))
    c.handlers["b"].shutdown()
    assert c.handlers["a"].restart_requested() == "node b left the rendezvous"
    assert c.handlers["a"].dead_nodes() == ["b"]
    info = c.handlers["a"].next_rendezvous()
    assert (info.round, info.participants) == (1, ["a"])


def test_close_ends_the_job_everywhere(cluster):
    c = cluster()
    for n in "abc":
        c.handler(n)
    results(c.join("a", "b"))
    assert not c.handlers["b"].is_closed()
    c.handlers["a"].set_closed()
    assert c.handlers["b"].is_closed()
    with pytest.raises(RendezvousClosedError, match="run 'job' is closed; node b cannot join"):
        c.handlers["b"].next_rendezvous()
    # c never ran in the job: it is told the run id is used up, and what to do instead.
    with pytest.raises(RendezvousClosedError, match=r"Run id 'job' belongs to a job that "
                       r"already ended .*give a new job its own run id \(--rdzv-id\)"):
        c.handlers["c"].next_rendezvous()


def test_a_forming_round_drops_a_joiner_that_died(cluster):
    c = cluster(min_nodes=3, max_nodes=3, heartbeat_timeout=1.0)
    for n in "abc":
        c.handler(n)
    c.handler("x", join_timeout=5.0)

    def forming():
        return RendezvousState.decode(c.store.get("shoal/rdzv/job/state").partition(b"\n")[2])

    fx = c.join("x")[0]
    wait_for(lambda: "x" in forming().participants, "x joined")
    c.kill("x")
    # With a and x in, the round is one short of min_nodes and cannot complete; a drops x.
    fa = c.join("a")[0]
    wait_for(lambda: forming().participants == ("a",), "a dropping the dead x")
    rest = c.join("b", "c")
    infos = [fa.result(WAIT_S)] + results(rest)
    assert all(i.participants == ["a", "b", "c"] for i in infos)
    fx.cancel()


def test_a_backend_outage_longer_than_the_heartbeat_timeout_kills_nobody(cluster):
    down = threading.Event()
    c = cluster(backend_wrapper=lambda b: FlakyBackend(b, down), heartbeat_timeout=1.5)
    c.handler("a"), c.handler("b")
    results(c.join("a", "b"))
    down.set()
    time.sleep(2.5)  # the outage itself: longer than heartbeat_timeout on purpose
    with pytest.raises(RendezvousError, match="flaky backend is down"):
        c.handlers["a"].is_closed()
    down.clear()
    # Heartbeats resume; nobody is declared dead over the next two timeouts.
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        assert c.handlers["a"].restart_requested() is None
        assert c.handlers["b"].restart_requested() is None
        time.sleep(0.1)
    assert c.handlers["a"].dead_nodes() == []


def test_garbage_state_is_a_clear_error():
    store = HashStore(timeout=5)
    store.set("shoal/rdzv/job/state", b"1 ab\nnot json")
    h = RendezvousHandler(StoreRendezvousBackend(store, "job"), settings(), "a", store)
    with pytest.raises(RendezvousStateError, match="is not JSON"):
        h.is_closed()
    store.set("shoal/rdzv/job/state", b"no version line")
    with pytest.raises(RendezvousStateError, match="does not start with a version line"):
        h.is_closed()


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(min_nodes=0), r"min_nodes must be an integer >= 1, got 0"),
        (dict(min_nodes=3, max_nodes=2), r"max_nodes \(2\) must be >= min_nodes \(3\)"),
        (dict(run_id="a/b"), r"may not contain '/'"),
        (dict(join_timeout=0), r"join_timeout must be more than zero seconds, got 0.0"),
        (dict(heartbeat_interval=2, heartbeat_timeout=1),
         r"heartbeat_timeout \(1s\) must exceed heartbeat_interval \(2s\)"),
        (dict(last_call_timeout="x"), r"last_call_timeout must be a number of seconds"),
        (dict(join_timeout=float("inf")), r"join_timeout must be a finite number of seconds"),
    ],
)
def test_settings_are_validated(kw, message):
    with pytest.raises(ValueError, match=message):
        settings(**kw)


def test_settings_from_conf_and_factory_errors():
    s = RendezvousSettings.from_conf("r", 1, 2, {"join-timeout": "7", "ttl": "3"})
    assert s.join_timeout == 7.0
    with pytest.raises(ValueError, match=r"--rdzv-conf last_call_timeout='soon' is not a number"):
        RendezvousSettings.from_conf("r", 1, 2, {"last_call_timeout": "soon"})
    with pytest.raises(ValueError,
                       match=r"Unknown rendezvous backend 'zk'; choose one of \['store', 'etcd'\]"):
        create_backend("zk", "h:1", "r")
    with pytest.raises(ValueError, match=r"endpoint 'nohost' is not 'HOST:PORT'"):
        create_backend("store", "nohost", "r")
    with pytest.raises(ValueError, match="exactly one 'HOST:PORT' endpoint"):
        create_backend("store", "a:1,b:2", "r")
    with pytest.raises(ValueError, match=r"store rendezvous backend takes no option 'ttl'"):
        create_backend("store", "h:1", "r", ttl=5)
    with pytest.raises(ValueError, match=r"ttl=1 is invalid: etcd lease ttl must be 2..3600"):
        create_backend("etcd", "h:2379", "r", ttl=1)
    with pytest.raises(ValueError, match=r"etcd endpoint needs a real port, not 0 \(got h:0\)"):
        create_backend("etcd", "h:0", "r")


def test_create_handler_over_a_hosted_tcp_store():
    backend, host_store = create_backend("store", "127.0.0.1:0", "job", is_host=True, timeout=10)
    try:
        assert backend.name == "store" and host_store.port > 0
        s = settings(min_nodes=2, max_nodes=2)
        a = RendezvousHandler(backend, s, "a", host_store)
        b = create_handler("store", f"127.0.0.1:{host_store.port}", s, "b", timeout=10)
        pool = concurrent.futures.ThreadPoolExecutor(2)
        ia, ib = results([pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)])
        pool.shutdown()
        assert ia.participants == ib.participants == ["a", "b"]
        ia.store.set("from_a", b"1")
        assert ib.store.get("from_a", timeout=5) == b"1"
        b.shutdown()  # b owns its client store and closes it; the host's store keeps serving
        assert a.restart_requested() == "node b left the rendezvous"
        a.shutdown()
    finally:
        host_store.close()


def test_a_vanished_state_is_a_restart_reason(cluster):
    c = cluster()
    c.handler("a"), c.handler("b")
    results(c.join("a", "b"))
    c.store.delete("shoal/rdzv/job/state")  # as an expired etcd lease would
    # Read at once or after a heartbeat recreated the state (as round 1), the reason is the same.
    expected = "the rendezvous state of run 'job' vanished from the flaky backend"
    assert c.handlers["a"].restart_requested() == expected
    wait_for(lambda: c.store.check(["shoal/rdzv/job/state"]), "a heartbeat recreating the state")
    assert c.handlers["b"].restart_requested() == expected
    infos = results(c.join("a", "b"))
    assert [i.round for i in infos] == [1, 1]
