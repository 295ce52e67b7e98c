"""The contract every `collectives.Store` passes: a mixin of tests over four small hooks.

A backend's test class subclasses `StoreContract` and implements:

- `make_store(tmp_path)`: a fresh store with `timeout_s` as its default timeout;
- `make_peer(store)`: another handle on the same data (a second client, the same file), or the
  store itself for in-process stores;
- `peer_spec(store)`: a picklable recipe that `open_from_spec` turns into a handle in another
  process, or None for in-process stores (the cross-process tests then skip);
- `missing_message(store, keys, timeout)`: the exact StoreTimeout message for missing keys.

Stores may be shared by the tests of one class (a server in another process), so each test uses
keys no other test uses. Semantics are c10d's, as documented in `collectives.api.Store`.
"""

from __future__ import annotations

import multiprocessing
import re
import threading
import time
import traceback

import pytest

from shoal.collectives.store.api import MAX_KEY_BYTES, Store
from shoal.collectives.types import StoreTimeout

SHORT_S = 0.2  # timeouts of calls that are meant to time out
CHILD_JOIN_S = 60.0


def open_from_spec(spec: tuple) -> Store:
    """Rebuild a store handle from `peer_spec` in another process."""
    kind, *args = spec
    prefix = None
    if kind == "tcp":
        from shoal.collectives.store.tcp import TCPStore

        host, port, prefix = args
        store = TCPStore(host, port, timeout=30)
    elif kind == "file":
        from shoal.collectives.store.file import FileStore

        path, prefix = args
        store = FileStore(path, timeout=30)
    elif kind == "etcd":
        from shoal.elastic.rendezvous.etcd_store import EtcdStore

        endpoint, etcd_prefix = args
        store = EtcdStore([endpoint], prefix=etcd_prefix, timeout=30)
    else:
        raise ValueError(f"unknown store spec {spec!r}")
    if prefix is not None:
        from shoal.collectives.store.prefix import PrefixStore

        store = PrefixStore(prefix, store)
    return store


def _child_exchange(spec: tuple, errors) -> None:
    """Wait for the parent's key, answer it, and add to a shared counter alongside the parent."""
    try:
        store = open_from_spec(spec)
        ping = store.get("xproc/to_child", timeout=30)
        store.set("xproc/from_child", ping + b" pong")
        for _ in range(100):
            store.add("xproc/counter", 1)
        store.set("xproc/child_done", b"1")
        store.close()
        errors.put(None)
    except BaseException:  # noqa: BLE001  (handed to the test, which reports it)
        errors.put(traceback.format_exc())


class StoreContract:
    """Mixin: the tests every store passes."""

    timeout_s = 10.0

    # -- hooks

    def make_store(self, tmp_path) -> Store:
        raise NotImplementedError

    def make_peer(self, store: Store) -> Store:
        raise NotImplementedError

    def peer_spec(self, store: Store):
        return None

    def missing_message(self, store: Store, keys: list[str], timeout: float) -> str:
        raise NotImplementedError

    # -- fixtures

    @pytest.fixture
    def store(self, tmp_path):
        self._opened = []
        store = self.make_store(tmp_path)
        self._opened.append(store)
        yield store
        for s in reversed(self._opened):
            s.close()
            # PrefixStore does not own its underlying store; the test does
            getattr(s, "underlying_store", s).close()

    @pytest.fixture
    def peer(self, store):
        peer = self.make_peer(store)
        if peer is not store:
            self._opened.append(peer)
        return peer

    def expect_timeout(self, store, keys, timeout):
        message = self.missing_message(store, keys, timeout)
        return pytest.raises(StoreTimeout, match="^" + re.escape(message) + "$")

    # -- set / get

    def test_set_then_get_returns_the_bytes(self, store, peer):
        store.set("sg/bytes", b"\x00\x01binary\xff")
        store.set("sg/str", "text")
        store.set("sg/empty", b"")
        assert peer.get("sg/bytes") == b"\x00\x01binary\xff"
        assert peer.get("sg/str") == b"text"
        assert peer.get("sg/empty") == b""
        peer.set("sg/str", bytearray(b"overwritten"))
        assert store.get("sg/str") == b"overwritten"

    def test_large_value_round_trips(self, store, peer):
        value = bytes(range(256)) * (4 * 4096)  # 4 MiB
        store.set("large/value", value)
        assert peer.get("large/value") == value

    def test_get_waits_for_a_set_from_another_client(self, store, peer):
        t = threading.Timer(0.1, peer.set, args=("waitget/key", b"late"))
        t.start()
        try:
            assert store.get("waitget/key", timeout=self.timeout_s) == b"late"
        finally:
            t.join()

    def test_get_timeout_names_the_key(self, store):
        start = time.monotonic()
        with self.expect_timeout(store, ["timeout/missing"], SHORT_S):
            store.get("timeout/missing", timeout=SHORT_S)
        assert time.monotonic() - start >= SHORT_S * 0.9

    def test_default_timeout_applies_and_is_settable(self, store):
        store.set_timeout(0.2)
        assert store.timeout == 0.2
        with self.expect_timeout(store, ["deftimeout/missing"], 0.2):
            store.get("deftimeout/missing")

    # -- add

    def test_add_counts_from_zero_and_returns_the_new_value(self, store, peer):
        assert store.add("add/n", 5) == 5
        assert peer.add("add/n", -7) == -2
        assert store.add("add/n", 0) == -2
        assert peer.get("add/n") == b"-2"

    def test_add_on_a_non_integer_fails_and_keeps_the_value(self, store):
        store.set("addbad/word", b"hello")
        with pytest.raises(ValueError, match=r"Store\.add on key '(.*/)?addbad/word', whose value "
                                             r"b'hello' is not an integer\."):
            store.add("addbad/word", 1)
        assert store.get("addbad/word") == b"hello"

    def test_concurrent_adds_are_atomic(self, store, peer):
        handles = [store, peer, store, peer]
        errors = []

        def bump(handle):
            try:
                for _ in range(50):
                    handle.add("atomic/n", 1)
            except BaseException as exc:  # noqa: BLE001  (surfaced below, not lost in the thread)
                errors.append(exc)

        threads = [threading.Thread(target=bump, args=(h,)) for h in handles]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors and not any(t.is_alive() for t in threads)
        assert store.get("atomic/n") == b"200"

    # -- compare_set

    def test_compare_set_follows_c10d(self, store, peer):
        # missing key, non-empty expected: nothing is set and `expected` comes back
        assert store.compare_set("cas/k", b"old", b"new") == b"old"
        assert not store.check(["cas/k"])
        # missing key, empty expected: set
        assert store.compare_set("cas/k", b"", b"first") == b"first"
        # match: set; mismatch: current value comes back unchanged
        assert peer.compare_set("cas/k", b"first", b"second") == b"second"
        assert store.compare_set("cas/k", b"first", b"third") == b"second"
        assert peer.get("cas/k") == b"second"

    # -- wait / check / delete / num_keys

    def test_wait_returns_when_all_keys_exist(self, store, peer):
        store.set("wait/a", b"1")
        t = threading.Timer(0.1, peer.set, args=("wait/b", b"2"))
        t.start()
        try:
            store.wait(["wait/a", "wait/b"], timeout=self.timeout_s)
        finally:
            t.join()
        store.wait("wait/a", timeout=0)
        store.wait([], timeout=0)
        assert store.check([])

    def test_wait_timeout_names_only_the_missing_keys(self, store):
        store.set("waitto/here", b"1")
        keys = ["waitto/here", "waitto/gone1", "waitto/gone2"]
        with self.expect_timeout(store, ["waitto/gone1", "waitto/gone2"], SHORT_S):
            store.wait(keys, timeout=SHORT_S)
        with self.expect_timeout(store, ["waitto/gone1"], 0):
            store.wait(["waitto/gone1"], timeout=0)

    def test_check(self, store, peer):
        assert not store.check(["check/a"])
        peer.set("check/a", b"")
        assert store.check(["check/a"]) and store.check("check/a")
        assert not store.check(["check/a", "check/b"])

    def test_delete_and_num_keys(self, store, peer):
        before = store.num_keys()
        store.multi_set(["del/a", "del/b", "del/c"], [b"1", b"2", b"3"])
        assert peer.num_keys() == before + 3
        assert peer.delete("del/b") is True
        assert store.delete("del/b") is False
        assert store.num_keys() == before + 2
        assert not store.check(["del/b"])
        with self.expect_timeout(store, ["del/b"], 0.1):
            store.get("del/b", timeout=0.1)
        store.set("del/b", b"again")
        assert peer.get("del/b") == b"again"

    # -- multi_get / multi_set

    def test_multi_set_and_multi_get_keep_order(self, store, peer):
        store.multi_set(["multi/x", "multi/y", "multi/z"], [b"1", "2", b""])
        assert peer.multi_get(["multi/z", "multi/x", "multi/y"]) == [b"", b"1", b"2"]
        assert peer.multi_get([]) == []
        store.multi_set([], [])

    def test_multi_get_waits_and_times_out_naming_missing_keys(self, store, peer):
        store.set("mget/a", b"1")
        t = threading.Timer(0.1, peer.set, args=("mget/b", b"2"))
        t.start()
        try:
            assert store.multi_get(["mget/a", "mget/b"], timeout=self.timeout_s) == [b"1", b"2"]
        finally:
            t.join()
        with self.expect_timeout(store, ["mget/c"], SHORT_S):
            store.multi_get(["mget/a", "mget/c"], timeout=SHORT_S)

    # -- threads of one handle

    def test_a_blocked_get_does_not_block_other_threads(self, store):
        result = {}
        t = threading.Thread(
            target=lambda: result.setdefault("v", store.get("threads/k", timeout=self.timeout_s))
        )
        t.start()
        time.sleep(0.05)  # let the getter block first (the test holds either way)
        store.set("threads/k", b"v")
        t.join(self.timeout_s + 5)
        assert result == {"v": b"v"}

    # -- bad input

    def test_bad_input_is_rejected_with_clear_errors(self, store):
        with pytest.raises(TypeError, match=r"Store keys must be str, got int: 5"):
            store.set(5, b"v")
        with pytest.raises(ValueError, match=r"Store keys must be non-empty strings\."):
            store.get("")
        with pytest.raises(ValueError, match=rf"Store key of {MAX_KEY_BYTES + 1} bytes exceeds"):
            store.set("k" * (MAX_KEY_BYTES + 1), b"v")
        with pytest.raises(TypeError, match=r"Store values must be bytes or str, got int\."):
            store.set("bad/k", 3)
        with pytest.raises(TypeError, match=r"Store\.add amount must be an int, got True\."):
            store.add("bad/n", True)
        with pytest.raises(TypeError, match=r"Store\.add amount must be an int, got 1\.5\."):
            store.add("bad/n", 1.5)
        with pytest.raises(ValueError, match=r"timeout must be zero or more seconds, got -1\.0"):
            store.get("bad/k", timeout=-1)
        with pytest.raises(ValueError, match=r"multi_set got 2 keys but 1 values"):
            store.multi_set(["bad/a", "bad/b"], [b"1"])
        assert not store.check(["bad/k", "bad/n", "bad/a"])

    # -- across processes

    def test_another_process_wakes_a_waiter_and_adds_atomically(self, store):
        spec = self.peer_spec(store)
        if spec is None:
            pytest.skip("an in-process store has no handle in another process")
        ctx = multiprocessing.get_context("spawn")
        errors = ctx.Queue()
        child = ctx.Process(target=_child_exchange, args=(spec, errors))
        child.start()
        try:
            store.set("xproc/to_child", b"ping")
            assert store.get("xproc/from_child", timeout=30) == b"ping pong"
            for _ in range(100):
                store.add("xproc/counter", 1)
            store.wait(["xproc/child_done"], timeout=30)
            assert store.get("xproc/counter") == b"200"
            child.join(CHILD_JOIN_S)
            assert not child.is_alive(), "the child store process did not exit"
            error = errors.get(timeout=5)
            assert error is None, f"child failed:\n{error}"
            assert child.exitcode == 0, f"child exited with code {child.exitcode}"
        finally:
            if child.is_alive():
                child.kill()
                child.join(5)
