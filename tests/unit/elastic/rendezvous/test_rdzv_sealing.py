"""The job's MACs on what the rendezvous reads back (elastic.rendezvous.sealing): a state or a
store value that was forged, moved to another key or run, or written under another secret is
refused with an error naming the key, and the handler that read it stops."""

from __future__ import annotations

import json

import pytest

from shoal.collectives.store.hash import HashStore
from shoal.elastic.api import RendezvousSettings
from shoal.elastic.rendezvous import RendezvousHandler
from shoal.elastic.rendezvous.sealing import ForgedValueError, Seal, SignedStore
from shoal.elastic.rendezvous.state import RendezvousState
from shoal.elastic.rendezvous.store_backend import StoreRendezvousBackend

SECRET = b"sealing-test-secret"
STATE_KEY = "shoal/rdzv/job/state"


def _handler(store, node="a", secret=SECRET, run_id="job") -> RendezvousHandler:
    settings = RendezvousSettings(run_id=run_id, min_nodes=1, max_nodes=1, join_timeout=5,
                                  heartbeat_interval=0.2, heartbeat_timeout=3,
                                  last_call_timeout=0)
    return RendezvousHandler(StoreRendezvousBackend(store, run_id), settings, node, store,
                             secret=secret)


def _rewrite_state(store, change) -> None:
    """What an etcd writer can do: edit the stored JSON, keep its version line and mac."""
    head, _, body = store.get(STATE_KEY).partition(b"\n")
    doc = json.loads(body)
    change(doc)
    store.set(STATE_KEY, head + b"\n" + json.dumps(doc).encode())


def test_a_sealed_state_round_trips_and_any_edit_fails_its_mac():
    seal = Seal(SECRET, "job")
    state = RendezvousState(round=3, participants=("a", "b"), generation="g")
    raw = state.encode(seal)
    assert RendezvousState.decode(raw, seal, "etcd key 'k'") == state
    forged = json.loads(raw)
    forged["closed"] = True
    with pytest.raises(ForgedValueError, match="rendezvous state at etcd key 'k' fails its MAC"):
        RendezvousState.decode(json.dumps(forged).encode(), seal, "etcd key 'k'")
    with pytest.raises(ForgedValueError):  # no mac at all
        RendezvousState.decode(state.encode(), seal)
    with pytest.raises(ForgedValueError):  # moved to another run of the same job secret
        RendezvousState.decode(raw, Seal(SECRET, "other-run"))
    with pytest.raises(ForgedValueError):  # written under another secret
        RendezvousState.decode(raw, Seal(b"another secret", "job"))


def test_store_values_are_bound_to_their_key_and_checked_on_every_read():
    inner = HashStore(timeout=1)
    signed = SignedStore(inner, "job/g", Seal(SECRET, "job"))
    signed.set("master_addr_port", "10.0.0.1:29500")
    assert signed.get("master_addr_port") == b"10.0.0.1:29500"
    assert signed.compare_set("ended", "", "worker_failure:a") == b"worker_failure:a"
    assert signed.compare_set("ended", "", "worker_failure:b") == b"worker_failure:a"
    assert signed.check(["master_addr_port", "ended"])
    # Moved from another key, planted raw, or set under another secret: refused by name.
    inner.set("job/g/exit_done", inner.get("job/g/master_addr_port"))
    with pytest.raises(ForgedValueError, match="store key 'job/g/exit_done' fails its MAC"):
        signed.wait(["exit_done"], 1)
    inner.set("job/g/master_addr_port", "6.6.6.6:29500")
    with pytest.raises(ForgedValueError, match="master_addr_port' fails its MAC"):
        signed.get("master_addr_port")
    SignedStore(inner, "job/g", Seal(b"another secret", "job")).set("nproc", "8")
    with pytest.raises(ForgedValueError):
        signed.multi_get(["nproc"])
    assert signed.add("restarts", 1) == 1  # counters pass through (see sealing's doc)


def test_a_forged_state_stops_the_handler_that_reads_it():
    store = HashStore(timeout=1)
    a = _handler(store)
    try:
        assert a.next_rendezvous().round == 0
        assert a.restart_requested() is None
        _rewrite_state(store, lambda doc: doc.update(closed=True))
        with pytest.raises(ForgedValueError, match=f"store key '{STATE_KEY}' fails its MAC"):
            a.restart_requested()
        with pytest.raises(ForgedValueError):  # aborted: nothing more is read or acted on
            a.is_closed()
    finally:
        a.shutdown()


def test_a_node_with_another_secret_cannot_join_or_disturb_the_job():
    store = HashStore(timeout=1)
    a = _handler(store)
    stranger = _handler(store, node="z", secret=b"not the job's secret")
    try:
        a.next_rendezvous()
        with pytest.raises(ForgedValueError, match="another secret uses the same run id"):
            stranger.next_rendezvous()
        assert a.restart_requested() is None  # the stranger wrote nothing
    finally:
        stranger.shutdown()
        a.shutdown()


def test_a_genuine_close_names_the_node_that_closed_it_and_how():
    store = HashStore(timeout=1)
    a = _handler(store)
    try:
        a.next_rendezvous()
        a.set_closed("failed")
        assert a.restart_requested() == (
            "the rendezvous of run 'job' was closed by node a (its job failed)")
        assert a.closed_by() == " by node a (its job failed)"
        with pytest.raises(ValueError, match="set_closed how='done'"):
            a.set_closed("done")
    finally:
        a.shutdown()
