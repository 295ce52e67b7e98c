"""Every `RendezvousBackend` passes `RendezvousBackendContract`: the store backend over a
HashStore and over a TCPStore, and the etcd backend over a real etcd started here."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from shoal.collectives.store.hash import HashStore
from shoal.collectives.store.tcp import TCPStore
from shoal.elastic.api import RendezvousBackend, RendezvousClosedError, RendezvousSettings
from shoal.elastic.rendezvous.store_backend import StoreRendezvousBackend
from shoal.elastic.rendezvous.handler import RendezvousHandler

from tests.support.etcd_server import EtcdServer, require_etcd
from tests.support.rdzv import join_all

WAIT_S = 30.0


class RendezvousBackendContract:
    """Mixin: `make_backend(run_id)` returns a backend; two calls with one run id share state.
    `make_store()` returns the run's Store for handlers."""

    backend_name = ""

    def make_backend(self, run_id: str) -> RendezvousBackend:
        raise NotImplementedError

    def make_store(self):
        raise NotImplementedError

    @pytest.fixture
    def pair(self):
        run_id = f"run-{uuid.uuid4().hex[:8]}"
        made = [self.make_backend(run_id), self.make_backend(run_id)]
        yield made
        for b in made:
            b.close()

    def test_name(self, pair):
        assert pair[0].name == self.backend_name

    def test_no_state_until_the_first_write(self, pair):
        a, b = pair
        assert a.get_state() is None
        state, token, written = a.set_state(b"first", None)
        assert (state, written) == (b"first", True)
        assert b.get_state() == (b"first", token)

    def test_compare_and_set_writes_only_on_the_current_token(self, pair):
        a, b = pair
        _, t1, _ = a.set_state(b"one", None)
        # creating again loses to the existing state, which comes back
        assert b.set_state(b"other", None) == (b"one", t1, False)
        state, t2, written = b.set_state(b"two", t1)
        assert (state, written) == (b"two", True) and t2 != t1
        assert a.set_state(b"stale", t1) == (b"two", t2, False)
        assert a.get_state() == (b"two", t2)
        # an identical value written again still gets a new token
        _, t3, written = a.set_state(b"two", t2)
        assert written and t3 != t2

    def test_concurrent_compare_and_set_loses_no_update(self, pair):
        a, b = pair
        a.set_state(b"0", None)
        errors = []

        def bump(backend):
            try:
                for _ in range(15):
                    while True:
                        value, token = backend.get_state()
                        if backend.set_state(b"%d" % (int(value) + 1), token)[2]:
                            break
            except BaseException as exc:  # noqa: BLE001  (handed to the test, which reports it)
                errors.append(exc)

        threads = [threading.Thread(target=bump, args=(x,)) for x in (a, b, a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert not errors and not any(t.is_alive() for t in threads)
        assert a.get_state()[0] == b"60"

    def test_watch_wakes_on_a_change_and_times_out_otherwise(self, pair):
        a, b = pair
        _, token, _ = a.set_state(b"v1", None)
        start = time.monotonic()
        a.watch(token, 0.3)
        assert time.monotonic() - start >= 0.25  # nothing changed: the full timeout
        timer = threading.Timer(0.2, b.set_state, args=(b"v2", token))
        timer.start()
        start = time.monotonic()
        try:
            a.watch(token, WAIT_S)
        finally:
            timer.join()
        assert time.monotonic() - start < WAIT_S / 2
        assert a.get_state()[0] == b"v2"
        start = time.monotonic()
        a.watch(token, WAIT_S)  # a stale token returns at once
        assert time.monotonic() - start < WAIT_S / 2

    def test_watch_without_state_wakes_on_creation(self, pair):
        a, b = pair
        timer = threading.Timer(0.2, b.set_state, args=(b"created", None))
        timer.start()
        start = time.monotonic()
        try:
            a.watch(None, WAIT_S)
        finally:
            timer.join()
        assert time.monotonic() - start < WAIT_S / 2

    def test_handlers_meet_restart_and_close_over_this_backend(self):
        run_id = f"run-{uuid.uuid4().hex[:8]}"
        settings = RendezvousSettings(run_id=run_id, min_nodes=2, max_nodes=2,
                                      join_timeout=WAIT_S, heartbeat_interval=0.2,
                                      heartbeat_timeout=3.0)
        store = self.make_store()
        handlers = [RendezvousHandler(self.make_backend(run_id), settings, n, store)
                    for n in ("n1", "n0")]
        try:
            infos = join_all(handlers, WAIT_S)
            assert [(i.round, i.group_rank, i.participants) for i in infos] == [
                (0, 1, ["n0", "n1"]), (0, 0, ["n0", "n1"])]
            handlers[1].signal_restart("a worker failed")
            assert handlers[0].restart_requested() == "a worker failed (signalled by node n0)"
            infos = join_all(handlers, WAIT_S)
            assert [i.round for i in infos] == [1, 1]
            handlers[0].set_closed()
            with pytest.raises(RendezvousClosedError):
                handlers[1].next_rendezvous()
        finally:
            for h in handlers:
                h.shutdown()
                h.backend.close()


class TestStoreBackendOverHashStore(RendezvousBackendContract):
    backend_name = "store"

    @pytest.fixture(autouse=True)
    def _store(self):
        self.store = HashStore(timeout=10)

    def make_backend(self, run_id):
        return StoreRendezvousBackend(self.store, run_id)

    def make_store(self):
        return self.store


class TestStoreBackendOverTCPStore(RendezvousBackendContract):
    backend_name = "store"

    @pytest.fixture(autouse=True)
    def _server(self):
        self.master = TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
        self.clients = []
        yield
        for c in self.clients:
            c.close()
        self.master.close()

    def make_backend(self, run_id):
        # each backend its own client connection, as each node would have
        client = TCPStore("127.0.0.1", self.master.port, timeout=10)
        self.clients.append(client)
        return StoreRendezvousBackend(client, run_id)

    def make_store(self):
        return self.master


class TestEtcdBackend(RendezvousBackendContract):
    backend_name = "etcd"

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _etcd(cls):
        cls.server = EtcdServer(require_etcd()).start()
        yield
        cls.server.close()

    def make_backend(self, run_id):
        from shoal.elastic.rendezvous.etcd_backend import EtcdRendezvousBackend

        return EtcdRendezvousBackend([self.server.endpoint], run_id, ttl=10, timeout=10)

    def make_store(self):
        from shoal.elastic.rendezvous.etcd_store import EtcdStore

        return EtcdStore([self.server.endpoint], prefix=f"/store-{uuid.uuid4().hex[:8]}/",
                         timeout=10)


class _MemoryBackend(RendezvousBackend):
    """A minimal backend with no watch of its own: exercises the ABC's polling `watch`."""

    _lock = threading.Lock()
    _runs: dict = {}

    def __init__(self, run_id):
        self.run_id = run_id

    @property
    def name(self):
        return "memory"

    def get_state(self):
        with self._lock:
            return self._runs.get(self.run_id)

    def set_state(self, state, token=None):
        with self._lock:
            current = self._runs.get(self.run_id)
            if (None if current is None else current[1]) == token:
                new = (bytes(state), uuid.uuid4().hex)
                self._runs[self.run_id] = new
                return new[0], new[1], True
            if current is None:
                return None
            return current[0], current[1], False


class TestDefaultWatchOfTheABC(RendezvousBackendContract):
    backend_name = "memory"

    def make_backend(self, run_id):
        return _MemoryBackend(run_id)

    def make_store(self):
        return HashStore(timeout=10)
