"""The RPC names torch scripts use (issue 24): init_rpc(backend=BackendType.TENSORPIPE, ...),
TensorPipeRpcBackendOptions and mutable options, get_rpc_timeout/_set_rpc_timeout,
rpc.constants, rpc.api.get_worker_info, worker-name validation. torch is the oracle for the
defaults where it is installed."""

from __future__ import annotations

import pytest

from shoal import rpc_agent as rpc
from shoal.rpc_agent.types import WorkerNameError


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
    assert rpc.WorkerInfo("x" * 127, 0).name == "x" * 127
    for bad in ("", "two words", "a.b", "\u00e9", "x" * 128, "x" * 129, 7):
        with pytest.raises(WorkerNameError, match="A worker name must be 1 to 127 characters "
                                                  "of A-Z, a-z, 0-9, '_', '-' and ':'"):
            rpc.WorkerInfo(bad, 0)
    with pytest.raises(ValueError, match="A worker id must be a non-negative int"):
        rpc.WorkerInfo("w", -1)


def test_a_bad_worker_name_is_both_a_valueerror_and_torchs_runtimeerror():
    """A torch script's `except RuntimeError` catches it, and so does shoal's ValueError."""
    for caught in (RuntimeError, ValueError, rpc.RpcError):
        with pytest.raises(caught, match="got 'a.b'"):
            rpc.WorkerInfo("a.b", 0)
    with pytest.raises(RuntimeError, match="got 'x x'"):
        rpc.init_rpc("x x", rank=0, world_size=1)


@pytest.mark.parametrize("name", ["w", "Trainer_0:ps-1", "x" * 127, "x" * 128, "x" * 129, "",
                                  "a.b", "a b", "a/b", "\u00e9", "\u0661", "tab\t"])
def test_worker_names_are_accepted_and_refused_exactly_as_torch_does(name):
    """torch's WorkerInfo (rpc_agent.cpp) checks `0 < len < MAX_NAME_LEN (128)` and that every
    character is ASCII alphanumeric or one of - _ :, raising RuntimeError."""
    torch_rpc = pytest.importorskip("torch.distributed.rpc")
    try:
        torch_rpc.WorkerInfo(name, 0)
        torch_refused = None
    except RuntimeError as exc:
        torch_refused = exc
    if torch_refused is None:
        assert rpc.WorkerInfo(name, 0).name == name
    else:
        assert "shorter than 128 chars" in str(torch_refused)
        with pytest.raises(RuntimeError, match="shorter than 128"):
            rpc.WorkerInfo(name, 0)


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
