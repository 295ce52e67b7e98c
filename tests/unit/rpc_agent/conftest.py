"""Fixtures of the rpc_agent unit tests."""

from __future__ import annotations

import pytest

from shoal import rpc_agent
from shoal.collectives.store.hash import HashStore


@pytest.fixture
def solo():
    """A world of one in this process, named "solo": the whole agent without spawning."""
    rpc_agent.init_rpc("solo", 0, 1, rpc_agent.RpcBackendOptions(store=HashStore(),
                                                                 rpc_timeout=10))
    yield
    rpc_agent.shutdown(timeout=10)
