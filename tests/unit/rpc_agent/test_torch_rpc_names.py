"""The RPC names torch scripts use (issue 24): init_rpc(backend=BackendType.TENSORPIPE, ...),
TensorPipeRpcBackendOptions and mutable options, get_rpc_timeout/_set_rpc_timeout,
rpc.constants, rpc.api.get_worker_info, worker-name validation. torch is the oracle for the
defaults where it is installed."""

from __future__ import annotations

import pytest

from shoal import rpc_agent as rpc
from shoal.core.backend import Device
from shoal.core.errors import DeviceError
from shoal.rpc_agent import _current
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
    assert opts.device_maps == {"solo": {Device("cuda:0"): Device("cuda:0")}}


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


def test_device_maps_given_to_the_constructor_are_kept_as_torch_keeps_them():
    """torch's docstring example: device_maps={"worker1": {0: 1}} in the constructor, then
    set_device_map("worker1", {1: 2}) adds to it; ints are cuda devices, the given dicts are
    copied, the copy init_rpc keeps has them too, and a map must stay one-to-one."""
    given = {"worker1": {0: 1}}
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, device_maps=given,
                                           devices=[0, "cuda:1"], init_method="tcp://127.0.0.1:0")
    cuda = [Device("cuda", i) for i in range(3)]
    assert opts.device_maps == {"worker1": {cuda[0]: cuda[1]}}
    assert opts.devices == [cuda[0], cuda[1]] and opts.num_worker_threads == 8
    opts.set_device_map("worker1", {1: 2})
    opts.set_device_map("ps", {"cpu": "cpu"})
    assert opts.device_maps == {"worker1": {cuda[0]: cuda[1], cuda[1]: cuda[2]},
                                "ps": {Device("cpu"): Device("cpu")}}
    assert given == {"worker1": {0: 1}}  # the caller's dicts are copied, not filled in
    with pytest.raises(ValueError, match=r"^The device map for worker 'worker1' already maps "
                                         r"cuda:0 to cuda:1; it cannot map it to cuda:2 too\.$"):
        opts.set_device_map("worker1", {0: 2})
    with pytest.raises(ValueError, match=r"^The device map for worker 'worker1' maps both cuda:1 "
                                         r"and cuda:2 to cuda:2; a device map must be one-to-one"):
        opts.set_device_map("worker1", {2: 2})
    with pytest.raises(ValueError, match=r"^The device map for worker 'w' maps both cuda:0 and "
                                         r"cuda:1 to cuda:3"):
        rpc.TensorPipeRpcBackendOptions(device_maps={"w": {0: 3, 1: 3}})
    with pytest.raises(TypeError, match=r"^TensorPipeRpcBackendOptions.device_maps must be a dict "
                                        r"of worker name to device map, got list"):
        rpc.TensorPipeRpcBackendOptions(device_maps=[("w", {0: 1})])
    with pytest.raises(WorkerNameError, match="got 'two words'"):
        rpc.TensorPipeRpcBackendOptions(device_maps={"two words": {0: 1}})
    with pytest.raises(DeviceError, match="Unknown device 'tpu:0'"):
        rpc.TensorPipeRpcBackendOptions(device_maps={"w": {"tpu:0": 1}})

    rpc.init_rpc("worker0", rank=0, world_size=1, rpc_backend_options=opts)
    try:
        kept = _current.get().options  # the agent's own copy of the options
        assert kept is not opts and kept.device_maps == opts.device_maps
        assert kept.devices == opts.devices and kept.num_worker_threads == 8
    finally:
        rpc.shutdown()


def test_a_cpu_device_map_reads_back_as_torchs():
    """torch (CPU build) can only build maps of 'cpu' here: both read back the same."""
    torch_rpc = pytest.importorskip("torch.distributed.rpc")
    maps = {"worker1": {"cpu": "cpu"}}
    theirs = torch_rpc.TensorPipeRpcBackendOptions(device_maps=maps).device_maps
    ours = rpc.TensorPipeRpcBackendOptions(device_maps=maps).device_maps
    assert {to: {str(a): str(b) for a, b in m.items()} for to, m in ours.items()} == \
        {to: {str(a): str(b) for a, b in m.items()} for to, m in theirs.items()}


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
