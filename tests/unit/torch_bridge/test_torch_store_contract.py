"""The torch bridge's `TorchStore` (torch's c10d store seen as a `collectives.Store`) passes the
contract every shoal store passes, over torch's own TCPStore and HashStore."""

from __future__ import annotations

import pytest

from shoal.collectives.store.api import missing_keys_message
from tests.support.store_contract import StoreContract

dist = pytest.importorskip("torch.distributed")
bridge_store = pytest.importorskip("shoal.torch_bridge.store")


class TestTorchStoreOverTCPStore(StoreContract):
    def make_store(self, tmp_path):
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        return bridge_store.TorchStore(dist.PrefixStore("job/", server), self.timeout_s)

    def make_peer(self, store):
        server = store.torch_store.underlying_store
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
        return bridge_store.TorchStore(dist.PrefixStore("job/", client), self.timeout_s)

    def missing_message(self, store, keys, timeout):
        port = store.torch_store.underlying_store.port
        return missing_keys_message(f"torch TCPStore at 127.0.0.1:{port}", keys, timeout)


class TestTorchStoreOverHashStore(StoreContract):
    def make_store(self, tmp_path):
        return bridge_store.TorchStore(dist.HashStore(), self.timeout_s)

    def make_peer(self, store):
        return store

    def missing_message(self, store, keys, timeout):
        return missing_keys_message("torch HashStore", keys, timeout)


class _PostedSetServer:
    """torch's TCPStore as its clients see it: a set is posted without waiting for an answer
    and applied later, while the server answers each connection's requests in order (so any
    later request on the posting connection returns only after the set is applied)."""

    def __init__(self):
        self.applied = {}

    def connect(self):
        server = self

        class Connection(dist.Store):
            def __init__(self):
                super().__init__()
                self.posted = []

            def _answer(self):
                for key, value in self.posted:
                    server.applied[key] = value
                self.posted.clear()

            def set(self, key, value):
                self.posted.append((key, bytes(value)))

            def check(self, keys):
                self._answer()
                return all(k in server.applied for k in keys)

        return Connection()


def test_a_returned_set_is_visible_on_another_connection_at_once():
    # The contract's test_check failed once in CI over a real TCPStore (a raw torch client
    # missed another client's just-returned set 17 times in 20,000 here): TorchStore.set must
    # not return before the server applied it. Modelled without timing so the test is exact.
    server = _PostedSetServer()
    writer = bridge_store.TorchStore(server.connect(), 5.0)
    reader = bridge_store.TorchStore(server.connect(), 5.0)
    writer.set("addr/0", b"10.0.0.1:29500")
    assert reader.check(["addr/0"])
