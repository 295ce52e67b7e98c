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
