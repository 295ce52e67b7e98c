"""RemoteModule (torch.distributed.nn's, issue 35) in a world of one, and what needs no RPC
compared with torch's own class: the refused nn.Module methods, plain pickling, use before
init_rpc and the parsing of `remote_device`. tests/multiproc/test_remote_module.py runs it
across workers beside torch's."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from shoal import core, rpc_agent
from shoal.core import nn
from shoal.rpc_agent.nn import RemoteModule
from shoal.rpc_agent.nn.api import remote_module as remote_module_api
from shoal.rpc_agent.nn.remote_device import _remote_device


def _torch_remote_module_api():
    return pytest.importorskip("torch.distributed.nn.api.remote_module")


# Each refused method and the arguments torch's test (remote_module_test.py) calls it with.
REFUSED = [
    ("register_buffer", ("buffer", None)), ("register_parameter", ("param", None)),
    ("add_module", ("empty", None)), ("apply", (print,)), ("cuda", ()), ("ipu", ()),
    ("xpu", ()), ("cpu", ()), ("type", ("float",)), ("float", ()), ("double", ()),
    ("half", ()), ("bfloat16", ()), ("to", ("cpu",)),
    ("register_backward_hook", (print,)), ("register_forward_pre_hook", (print,)),
    ("register_forward_hook", (print,)), ("state_dict", ()), ("load_state_dict", ({},)),
    ("parameters", ()), ("named_parameters", ()), ("buffers", ()), ("named_buffers", ()),
    ("children", ()), ("named_children", ()), ("modules", ()), ("named_modules", ()),
    ("requires_grad_", ()), ("zero_grad", ()), ("share_memory", ()), ("extra_repr", ()),
]


@pytest.mark.parametrize("name,args", REFUSED, ids=[name for name, _ in REFUSED])
def test_refused_methods_raise_torchs_valueerror(name, args):
    """Bare instances: the refusals happen before the instance's state is read, in both."""
    torch_api = _torch_remote_module_api()
    with pytest.raises(ValueError) as torch_error:
        getattr(object.__new__(torch_api.RemoteModule), name)(*args)
    with pytest.raises(ValueError) as ours:
        getattr(object.__new__(RemoteModule), name)(*args)
    assert str(ours.value) == str(torch_error.value)
    assert f"Method ``{name}`` not supported for RemoteModule" in str(ours.value)


def test_plain_pickle_is_refused_as_torchs():
    torch_api = _torch_remote_module_api()
    with pytest.raises(RuntimeError) as torch_error:
        pickle.dumps(object.__new__(torch_api.RemoteModule))
    with pytest.raises(RuntimeError) as ours:
        pickle.dumps(object.__new__(RemoteModule))
    assert str(ours.value) == str(torch_error.value) == (
        "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled when "
        "using RPC")


def test_before_init_rpc_it_raises_torchs_assertionerror():
    torch_api = _torch_remote_module_api()
    torch_nn = pytest.importorskip("torch.nn")
    with pytest.raises(AssertionError, match="RemoteModule only works in RPC.") as torch_error:
        torch_api.RemoteModule("worker1/cpu", torch_nn.Linear, (2, 2))
    with pytest.raises(AssertionError, match="RemoteModule only works in RPC.") as ours:
        RemoteModule("worker1/cpu", nn.Linear, (2, 2))
    assert str(ours.value) == str(torch_error.value)


PARSED = ["worker1/cpu", "worker1", "rank:1/cpu", "rank:1", "rank:12/cuda:0", "cpu",
          "cuda:1", "trainer0/cuda", "ps_0"]
REFUSED_DEVICES = ["/", "/cuda:0", "worker1/cuda:0/cuda:1", "rank:x/cpu", "a:b:c/cpu",
                   "ps_0:x"]


@pytest.mark.parametrize("spec", PARSED)
def test_remote_device_parses_as_torchs(spec):
    torch_remote = pytest.importorskip("torch.distributed.remote_device")._remote_device(spec)
    ours = _remote_device(spec)
    assert ours.worker_name() == torch_remote.worker_name()
    assert ours.rank() == torch_remote.rank()
    assert str(ours.device()) == str(torch_remote.device())
    assert repr(ours) == repr(torch_remote)


@pytest.mark.parametrize("spec", REFUSED_DEVICES)
def test_remote_device_refuses_as_torchs(spec):
    torch_mod = pytest.importorskip("torch.distributed.remote_device")
    with pytest.raises(ValueError) as torch_error:
        torch_mod._remote_device(spec)
    with pytest.raises(ValueError) as ours:
        _remote_device(spec)
    assert str(ours.value) == str(torch_error.value)


@pytest.mark.parametrize("spec", ["worker1/cpu2", "worker1/"])
def test_a_bad_device_field_is_a_runtimeerror_as_torchs(spec):
    """The messages differ (each library names its own devices); the type is torch's."""
    torch_mod = pytest.importorskip("torch.distributed.remote_device")
    with pytest.raises(RuntimeError):
        torch_mod._remote_device(spec)
    with pytest.raises(RuntimeError, match="Unknown device"):
        _remote_device(spec)


def test_collectives_nn_names_where_remote_module_lives():
    """torch.distributed.nn renamed is shoal.collectives.nn, which may not import RPC (a layer
    above it): the import fails with a sentence naming shoal.rpc_agent.nn."""
    with pytest.raises(ImportError, match=r"RemoteModule is in shoal\.rpc_agent\.nn, not "
                                          r"shoal\.collectives\.nn"):
        from shoal.collectives.nn import RemoteModule as _  # noqa: F401
    import shoal.collectives.nn as collectives_nn

    assert not hasattr(collectives_nn, "functional_all_reduce")


# ----------------------------------------------------------------------------- a world of one

class Affine(nn.Module):
    """y = tanh(x @ W.T + b) with given float64 values (no random init to compare)."""

    def __init__(self, seed: int, n_in: int = 4, n_out: int = 3):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.weight = nn.Parameter(core.Tensor(rng.standard_normal((n_out, n_in))))
        self.bias = nn.Parameter(core.Tensor(rng.standard_normal(n_out)))

    def forward(self, x, scale=1.0):
        return (x @ self.weight.t() + self.bias).tanh() * scale


class NotAModule:
    def __init__(self, *args):
        pass


def _training(module_rref):
    return module_rref.local_value().training


def test_forward_and_forward_async_run_the_module_on_its_owner(solo):
    rm = RemoteModule("solo/cpu", Affine, (7,))
    x = core.Tensor(np.random.default_rng(1).standard_normal((2, 4)))
    want = Affine(7)(x, scale=2.0).detach().numpy()
    np.testing.assert_array_equal(rm.forward(x, scale=2.0).detach().numpy(), want)
    np.testing.assert_array_equal(rm.forward_async(x, scale=2.0).wait(5).detach().numpy(),
                                  want)
    np.testing.assert_array_equal(rm(x, 2.0).detach().numpy(), want)
    assert (rm.on, rm.device, rm.is_device_map_set, rm.is_scriptable) == ("solo", "cpu",
                                                                          False, False)
    assert list(vars(rm))[-2:] == ["forward_async", "forward"]
    assert repr(rm) == "RemoteModule(on='solo', device='cpu')"


def test_remote_parameters_module_rref_and_training_mode(solo):
    rm = RemoteModule("rank:0", Affine, args=(7,), kwargs={"n_out": 2})
    params = rm.remote_parameters()
    assert [p.to_here().shape for p in params] == [(2, 4), (2,)]
    assert all(isinstance(p, rpc_agent.RRef) for p in params)
    assert rm.get_module_rref() is rm.module_rref
    assert rpc_agent.rpc_sync("solo", _training, (rm.get_module_rref(),)) is True
    rm.eval()
    assert rpc_agent.rpc_sync("solo", _training, (rm.get_module_rref(),)) is False
    rm.train()
    assert rpc_agent.rpc_sync("solo", _training, (rm.get_module_rref(),)) is True
    rm.train(False)  # torch drops `mode` here (its train(False) trains); shoal passes it
    assert rpc_agent.rpc_sync("solo", _training, (rm.get_module_rref(),)) is False


def test_a_class_that_builds_no_module_fails_at_the_first_forward(solo):
    rm = RemoteModule("solo", NotAModule, (1,))  # remote(): creation does not wait
    with pytest.raises(ValueError, match=r"Expect `module_cls\(\*args, \*\*kwargs\)` returns "
                                         "an instance of <class nn.Module>"):
        rm.forward(core.Tensor(np.ones((1, 4))))


def test_init_from_module_rref_shares_the_module(solo):
    rm = RemoteModule("solo/cpu", Affine, (3,))
    twin = RemoteModule.init_from_module_rref("solo/cpu", rm.get_module_rref())
    x = core.Tensor(np.ones((1, 4)))
    np.testing.assert_array_equal(twin.forward(x).detach().numpy(),
                                  rm.forward(x).detach().numpy())
    assert twin.get_module_rref() is rm.get_module_rref()


def _numpy(tensor):
    return tensor.detach().numpy()


def _attributes(remote_module):
    return list(vars(remote_module)), _numpy(remote_module.forward(core.Tensor(np.ones((1, 4)))))


def test_it_travels_over_rpc_as_its_attributes_and_module_rref(solo):
    rm = RemoteModule("solo/cpu", Affine, (3,))
    rm.new_attr = 1  # not declared: not sent (torch prints a line, shoal logs a warning)
    names, out = rpc_agent.rpc_sync("solo", _attributes, (rm,))
    assert names == list(remote_module_api._REMOTE_MODULE_PICKLED_ATTRIBUTES) + [
        "forward_async", "forward"]
    np.testing.assert_array_equal(out, _numpy(rm.forward(core.Tensor(np.ones((1, 4))))))


def test_a_torchscript_interface_is_refused(solo):
    with pytest.raises(ValueError, match="shoal has no TorchScript"):
        remote_module_api._RemoteModule("solo", Affine, (1,), _module_interface_cls=object)
