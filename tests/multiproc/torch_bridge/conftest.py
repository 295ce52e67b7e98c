"""Helpers of the torch bridge's multi-process tests: torch's own TCPStore, hosted by the test
process as an agent hosts one, and the environment that points the ranks' env:// at it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture
def torch_env():
    """The env for spawned ranks: torch's env:// joins a TCPStore this test bound on port 0."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the ranks are clients; nobody else binds
        "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TORCH_CPP_LOG_LEVEL": "ERROR",
    }
    del store
