"""The RPC names torch scripts use (issue 24): init_rpc(backend=BackendType.TENSORPIPE, ...),
TensorPipeRpcBackendOptions and mutable options, get_rpc_timeout/_set_rpc_timeout,
rpc.constants, rpc.api.get_worker_info, worker-name validation. torch is the oracle for the
defaults where it is installed."""

from __future__ import annotations

import pytest

from shoal import rpc_agent as rpc


def test_a_torch_style_init_with_tensorpipe_options_and_timeouts():
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=4, rpc_timeout=20,
                                           init_method="tcp://127.0.0.1:0", _transports=["uv"])
    opts.rpc_timeout = 7  # options are mutable, as torch's
    opts.set_device_map("solo", {0: 0})
    rpc.init_rpc("solo", backend=rpc.BackendType.TENSORPIPE, rank=0, world_size=1,
                 rpc_backend_options=opts)
    try:
        assert rpc.get_rpc_timeout() == 7.0
        rpc._set_rpc_timeout(3)
        assert rpc.get_rpc_timeout() == 3.0
        assert rpc.api.get_worker_info().name == "solo"
        assert rpc.api.get_worker_info("solo").id == 0
        assert rpc.rpc_sync("solo", max, (2, 5), timeout=rpc.constants.UNSET_RPC_TIMEOUT) == 5
        with pytest.raises(ValueError, match="The RPC timeout must be seconds >= 0"):
            rpc._set_rpc_timeout(-3)
    finally:
        rpc.shutdown()
    assert opts.device_maps == {"solo": {0: 0}}


def test_worker_names_follow_torchs_rule():
    assert rpc.WorkerInfo("trainer-1:a_b", 3).name == "trainer-1:a_b"
    for bad in ("", "two words", "a.b", "x" * 129):
        with pytest.raises(ValueError, match="A worker name must be 1 to 128 characters"):
            rpc.WorkerInfo(bad, 0)
    with pytest.raises(ValueError, match="A worker id must be a non-negative int"):
        rpc.WorkerInfo("w", -1)


def test_the_defaults_are_torchs():
    torch_rpc = pytest.importorskip("torch.distributed.rpc")
    ours = rpc.TensorPipeRpcBackendOptions()
    theirs = torch_rpc.TensorPipeRpcBackendOptions()
    assert ours.num_worker_threads == theirs.num_worker_threads
    assert ours.rpc_timeout == theirs.rpc_timeout
    assert ours.init_method == theirs.init_method
    assert rpc.constants.DEFAULT_RPC_TIMEOUT_SEC == torch_rpc.constants.DEFAULT_RPC_TIMEOUT_SEC
    assert rpc.constants.UNSET_RPC_TIMEOUT == torch_rpc.constants.UNSET_RPC_TIMEOUT
    assert rpc.constants.DEFAULT_INIT_METHOD == torch_rpc.constants.DEFAULT_INIT_METHOD
    assert {b.name for b in rpc.BackendType} >= {"TENSORPIPE"}


class Counter:
    def __init__(self):
        self.n = 0

    def add(self, k):
        self.n += k
        return self.n


def test_the_rref_proxy_checks_the_name_against_the_values_type_before_calling():
    """As torch's RRefProxy: `rref.rpc_sync().missing()` raises AttributeError in the caller
    (the value's type lacks it) and sends no call; the type is fetched once and cached."""
    rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=rpc.RpcBackendOptions(
        init_method="tcp://127.0.0.1:0"))
    try:
        rref = rpc.remote("solo", Counter)
        assert rref.rpc_sync().add(2) == 2
        with pytest.raises(AttributeError, match="type object 'Counter' has no attribute 'nope'"):
            rref.rpc_sync().nope(1)
        with pytest.raises(AttributeError, match="'nope'"):
            rref.rpc_async().nope()
        assert rref.rpc_async().add(3).wait() == 5  # the value was not touched by the misses
        assert rref._get_type() is Counter
    finally:
        rpc.shutdown()
