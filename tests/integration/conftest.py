"""Fixtures for integration tests: real etcd servers.

`etcd` is a fresh server for one test (stop/start it freely); `shared_etcd` is one server for
the whole session, for tests that only need keys of their own (use a unique run id or prefix).
"""

from __future__ import annotations

import pytest

from tests.support.etcd_server import EtcdServer, require_etcd


@pytest.fixture
def etcd():
    """A running etcd of this test's own; yields the EtcdServer (`.endpoint`, `.restart()`)."""
    server = EtcdServer(require_etcd()).start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def shared_etcd():
    """One running etcd for the session; tests must not stop it."""
    server = EtcdServer(require_etcd()).start()
    yield server
    server.close()
