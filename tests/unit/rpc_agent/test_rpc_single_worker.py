"""A world of one in this process: the whole agent (streams aside) without spawning."""

from __future__ import annotations

import operator

import numpy as np
import pytest

from shoal import rpc_agent
from shoal.collectives.store.hash import HashStore


def _double(x):
    return x * 2


@rpc_agent.functions.async_execution
def _async_double(x):
    return rpc_agent.rpc_async("solo", _double, (x,))


def test_calls_to_itself(solo):
    assert rpc_agent.rpc_sync("solo", operator.add, (1, 2)) == 3
    a = np.arange(200_000, dtype=np.float32)  # above the threshold, still local
    np.testing.assert_array_equal(rpc_agent.rpc_sync(0, _double, (a,)), a * 2)
    assert rpc_agent.rpc_async("solo", _async_double, (4,)).wait(5) == 8
    assert rpc_agent.get_worker_info() == rpc_agent.WorkerInfo("solo", 0)


def test_rrefs_owned_by_itself(solo):
    rref = rpc_agent.remote("solo", _double, (21,))
    assert rref.is_owner() and rref.to_here() == 42 and rref.local_value() == 42
    local = rpc_agent.RRef([1, 2])
    assert local.owner_name() == "solo" and local.to_here() == [1, 2]
    assert rpc_agent.rpc_sync("solo", len, (local.to_here(),)) == 2
    assert rref.rpc_sync().bit_length() == 6
    assert rpc_agent.rpc_sync("solo", _rref_value, (local,)) == [1, 2]


def _rref_value(rref):
    return rref.local_value()


def test_init_again_after_shutdown_and_errors_without_init():
    with pytest.raises(rpc_agent.RpcError, match="RPC is not initialized in this process"):
        rpc_agent.rpc_sync("solo", operator.add, (1, 2))
    for _ in range(2):
        rpc_agent.init_rpc("solo", 0, 1, rpc_agent.RpcBackendOptions(store=HashStore()))
        assert rpc_agent.rpc_sync("solo", operator.add, (1, 2)) == 3
        rpc_agent.shutdown()


def test_bad_arguments_to_init():
    with pytest.raises(ValueError, match="rank in 0..0"):
        rpc_agent.init_rpc("x", 3, 1, rpc_agent.RpcBackendOptions(store=HashStore()))
    for bad in ("", "has space", "x" * 129, "a/b"):
        with pytest.raises(ValueError, match="A worker name must be 1 to 127 characters of "
                                             "A-Z, a-z, 0-9, '_', '-' and ':'"):
            rpc_agent.init_rpc(bad, 0, 1)
    with pytest.raises(ValueError, match="backend must be None or a BackendType"):
        rpc_agent.init_rpc("x", "tensorpipe", rank=0, world_size=1)
    with pytest.raises(TypeError, match="must be an RpcBackendOptions"):
        rpc_agent.init_rpc("x", 0, 1, {"init_method": "env://"})


def test_init_through_tcp_and_file_urls(tmp_path):
    for url in ("tcp://127.0.0.1:0", f"file://{tmp_path / 'rpc-store'}"):
        rpc_agent.init_rpc("solo", 0, 1, rpc_agent.RpcBackendOptions(init_method=url))
        assert rpc_agent.rpc_sync("solo", operator.add, (2, 2)) == 4
        rpc_agent.shutdown()


def test_env_url_needs_master_address(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(rpc_agent.RpcError, match="needs MASTER_ADDR and MASTER_PORT"):
        rpc_agent.init_rpc("solo", 0, 1)
