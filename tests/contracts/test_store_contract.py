"""Every store passes `StoreContract`: HashStore, PrefixStore, TCPStore (server here or in
another process), FileStore, and PrefixStore over TCPStore."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile

import pytest

from shoal.collectives.store.file import FileStore
from shoal.collectives.store.hash import HashStore
from shoal.collectives.store.prefix import PrefixStore
from shoal.collectives.store.tcp import TCPStore
from tests.support.store_contract import StoreContract
from shoal.collectives.store.api import missing_keys_message

STARTUP_S = 30.0


def start_store_process(*extra: str) -> tuple[subprocess.Popen, int]:
    """Start `python -m collectives.store_tcp` and read the bound port from its first line."""
    # stderr goes to a file: a pipe nobody reads could fill up and stall the server's logging
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal.collectives.store.tcp", "--host", "127.0.0.1", "--port", "0",
         *extra],
        stdout=subprocess.PIPE, stderr=log, env=os.environ.copy(),
    )
    ready, _, _ = select.select([proc.stdout], [], [], STARTUP_S)
    line = proc.stdout.readline().decode() if ready else ""
    if not line.startswith("shoal store listening on 127.0.0.1:"):
        proc.kill()
        proc.wait(10)
        log.seek(0)
        pytest.fail(f"the store process printed {line!r} instead of its port; stderr:\n"
                    f"{log.read().decode(errors='replace')}")
    return proc, int(line.rsplit(":", 1)[1])


def stop_store_process(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        pytest.fail("the store process ignored SIGTERM for 10s")


class TestHashStore(StoreContract):
    def make_store(self, tmp_path):
        return HashStore(timeout=self.timeout_s)

    def make_peer(self, store):
        return store

    def missing_message(self, store, keys, timeout):
        return missing_keys_message("HashStore", keys, timeout)


class TestPrefixStoreOverHashStore(StoreContract):
    def make_store(self, tmp_path):
        return PrefixStore("job", HashStore(timeout=self.timeout_s))

    def make_peer(self, store):
        return PrefixStore("job", store.underlying_store)

    def missing_message(self, store, keys, timeout):
        return missing_keys_message("HashStore", [f"job/{k}" for k in keys], timeout)


class TestTCPStoreServedHere(StoreContract):
    def make_store(self, tmp_path):
        return TCPStore("127.0.0.1", 0, is_master=True, timeout=self.timeout_s)

    def make_peer(self, store):
        return TCPStore(store.host, store.port, timeout=self.timeout_s)

    def peer_spec(self, store):
        return ("tcp", store.host, store.port, None)

    def missing_message(self, store, keys, timeout):
        return missing_keys_message(f"TCPStore at {store.address}", keys, timeout)


class TestTCPStoreServedByAnotherProcess(TestTCPStoreServedHere):
    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def server(cls):
        proc, cls.server_port = start_store_process()
        yield
        stop_store_process(proc)

    def make_store(self, tmp_path):
        return TCPStore("127.0.0.1", self.server_port, timeout=self.timeout_s)


class TestFileStore(StoreContract):
    def make_store(self, tmp_path):
        return FileStore(tmp_path / "store", timeout=self.timeout_s)

    def make_peer(self, store):
        return FileStore(store.path, timeout=self.timeout_s)

    def peer_spec(self, store):
        return ("file", store.path, None)

    def missing_message(self, store, keys, timeout):
        return missing_keys_message(f"FileStore {store.path!r}", keys, timeout)


class TestPrefixStoreOverTCPStore(StoreContract):
    def make_store(self, tmp_path):
        return PrefixStore("run7", TCPStore("127.0.0.1", 0, is_master=True, timeout=self.timeout_s))

    def make_peer(self, store):
        master = store.underlying_store
        return PrefixStore("run7", TCPStore(master.host, master.port, timeout=self.timeout_s))

    def peer_spec(self, store):
        return ("tcp", store.underlying_store.host, store.underlying_store.port, "run7")

    def missing_message(self, store, keys, timeout):
        return missing_keys_message(
            f"TCPStore at {store.underlying_store.address}", [f"run7/{k}" for k in keys], timeout
        )
