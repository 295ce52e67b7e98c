"""StoreHostWatch: a store that stops answering for `lost_after` seconds (and a few probes) is
declared lost once, naming its host node and address; a short blip is not."""

import threading
import time

import pytest

from shoal.collectives.types import StoreError
from shoal.collectives.store.hash import HashStore
from shoal.elastic.api import RendezvousSettings, StoreHostLostError
from shoal.elastic.rendezvous.store_backend import StoreRendezvousBackend
from shoal.elastic.rendezvous.handler import RendezvousHandler
from shoal.elastic.agent.store_host import StoreHostWatch, announce_host


class FlakyStore(HashStore):
    """A HashStore whose calls fail while `down` is set."""

    def __init__(self):
        super().__init__()
        self.down = threading.Event()

    def check(self, keys):
        if self.down.is_set():
            raise StoreError("TCPStore could not reach the server: [Errno 111] Connection refused")
        return super().check(keys)


def _watch(store, lost_after=0.3):
    lost = []
    got = threading.Event()

    def on_lost(error):
        lost.append(error)
        got.set()

    watch = StoreHostWatch(store, "10.0.0.1:29400", interval=0.02, lost_after=lost_after,
                           on_lost=on_lost)
    return watch, lost, got


def test_a_silent_store_is_declared_lost_once_naming_node_and_address():
    store = FlakyStore()
    announce_host(store, "n00000-host-1")
    watch, lost, got = _watch(store)
    watch.start()
    try:
        deadline = time.monotonic() + 5
        while watch.host_node is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.host_node == "n00000-host-1"
        store.down.set()
        assert got.wait(5)
        time.sleep(0.1)
    finally:
        watch.stop()
    assert len(lost) == 1 and watch.lost
    assert isinstance(lost[0], StoreHostLostError)
    assert "the store host node n00000-host-1 at 10.0.0.1:29400 is gone" in str(lost[0])
    assert "Connection refused" in str(lost[0])


def test_a_short_blip_is_forgiven(caplog):
    store = FlakyStore()
    watch, lost, got = _watch(store, lost_after=1.0)
    watch.start()
    try:
        store.down.set()
        time.sleep(0.2)
        store.down.clear()
        assert not got.wait(1.5)
    finally:
        watch.stop()
    assert not lost
    assert "answers again" in caplog.text


def test_an_unnamed_host_is_still_reported_by_address():
    store = FlakyStore()
    store.down.set()
    watch, lost, got = _watch(store, lost_after=0.1)
    watch.start()
    try:
        assert got.wait(5)
    finally:
        watch.stop()
    assert "the store host at 10.0.0.1:29400 is gone" in str(lost[0])


def test_an_aborted_handler_stops_waiting_at_once():
    store = HashStore()
    settings = RendezvousSettings(run_id="abort", min_nodes=2, max_nodes=2, join_timeout=30,
                                  heartbeat_interval=0.05, heartbeat_timeout=1)
    handler = RendezvousHandler(StoreRendezvousBackend(store, "abort"), settings, "a", store)
    error = StoreHostLostError("the store host node h at x:1 is gone")
    threading.Timer(0.3, handler.abort, args=(error,)).start()
    started = time.monotonic()
    with pytest.raises(StoreHostLostError, match="the store host node h at x:1 is gone"):
        handler.next_rendezvous()  # waits for a second node that never comes
    assert time.monotonic() - started < 5
    handler.shutdown()
