"""`EtcdStore` passes the Store contract against a real etcd, and survives an etcd restart."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from shoal.collectives.store.api import missing_keys_message
from shoal.collectives.types import StoreError, StoreTimeout
from shoal.elastic.rendezvous.etcd_store import EtcdStore
from tests.support.store_contract import StoreContract


class TestEtcdStore(StoreContract):
    @pytest.fixture(autouse=True)
    def _server(self, shared_etcd):
        self.server = shared_etcd

    def make_store(self, tmp_path):
        # A fresh prefix per test: the server is shared by the whole session.
        return EtcdStore([self.server.endpoint], prefix=f"/test/{uuid.uuid4().hex}/",
                         timeout=self.timeout_s)

    def make_peer(self, store):
        return EtcdStore([self.server.endpoint], prefix=store.prefix, timeout=self.timeout_s)

    def missing_message(self, store, keys, timeout):
        return missing_keys_message(
            f"EtcdStore at {self.server.endpoint} under {store.prefix!r}", keys, timeout)

    def peer_spec(self, store):
        return ("etcd", self.server.endpoint, store.prefix)


def test_fails_over_to_a_live_endpoint(shared_etcd):
    # The first endpoint refuses connections (the server's own port on a loopback address
    # nothing listens on); the second is real.
    port = shared_etcd.port
    store = EtcdStore([f"127.0.0.2:{port}", shared_etcd.endpoint], prefix="/failover/", timeout=10)
    try:
        store.set("k", b"v")
        assert store.get("k", timeout=5) == b"v"
    finally:
        store.close()


def test_no_reachable_endpoint_is_a_store_error_naming_it(shared_etcd):
    store = EtcdStore([f"127.0.0.2:{shared_etcd.port}"], prefix="/nowhere/", timeout=1.0)
    try:
        with pytest.raises(StoreError, match=rf"EtcdStore at 127\.0\.0\.2:{shared_etcd.port} "
                                             r"under '/nowhere/' failed set of key 'k'"):
            store.set("k", b"v")
    finally:
        store.close()


def test_a_value_over_the_server_limit_is_a_clear_error(shared_etcd):
    store = EtcdStore([shared_etcd.endpoint], prefix=f"/big/{uuid.uuid4().hex}/", timeout=10)
    try:
        with pytest.raises(StoreError, match="larger than etcd's --max-request-bytes"):
            store.set("huge", b"x" * (40 * 1024 * 1024))
        assert not store.check(["huge"])
    finally:
        store.close()


def test_store_keeps_working_across_an_etcd_restart(etcd):
    store = EtcdStore([etcd.endpoint], prefix="/outage/", timeout=30)
    peer = EtcdStore([etcd.endpoint], prefix="/outage/", timeout=30)
    try:
        store.set("before", b"1")
        got = {}
        waiter = threading.Thread(
            target=lambda: got.setdefault("v", store.get("during", timeout=60)))
        waiter.start()
        etcd.stop()
        time.sleep(3.0)  # the outage itself
        restarter = threading.Thread(target=etcd.start)
        restarter.start()
        # Calls made while etcd is down block until it is back, then succeed.
        assert peer.add("counter", 2) == 2
        restarter.join(30)
        peer.set("during", b"2")
        waiter.join(60)
        assert got == {"v": b"2"}
        assert store.get("before") == b"1"
        with pytest.raises(StoreTimeout):
            store.get("never", timeout=0.2)
    finally:
        store.close()
        peer.close()


def test_a_failover_by_one_thread_does_not_break_another_threads_call(shared_etcd, monkeypatch):
    import aetcd.exceptions as aexc
    from shoal.elastic.rendezvous import etcd_client as _etcd_client

    monkeypatch.setattr(_etcd_client, "CLOSE_GRACE_S", 0.5)

    store = EtcdStore([shared_etcd.endpoint], prefix=f"/race/{uuid.uuid4().hex}/", timeout=30)
    got, errors = {}, []

    def blocked_get():
        try:
            got["v"] = store.get("k", timeout=30)  # waits in a watch on the current channel
        except BaseException as exc:  # noqa: BLE001  (handed to the test, which reports it)
            errors.append(exc)

    waiter = threading.Thread(target=blocked_get)
    waiter.start()
    try:
        time.sleep(0.3)  # let the get reach its watch (the test holds either way)
        failed = []

        async def fail_once(client):
            if not failed:
                failed.append(1)
                raise aexc.ConnectionFailedError("injected")  # makes this call fail over
            return "ok"

        assert store._client.call(fail_once, "an injected failure") == "ok"
        # The old channel closes after its grace period, under the waiting get: it must retry.
        time.sleep(1.0)
        store.set("k", b"v")
        waiter.join(30)
        assert not errors, errors
        assert got == {"v": b"v"}
    finally:
        store.set("k", b"v")
        waiter.join(30)
        store.close()
