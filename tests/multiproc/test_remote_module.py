"""RemoteModule across two workers (issue 35), beside torch's RemoteModule over TensorPipe: the
same scenario runs on w0 of each world with the module on w1. Forward (sync, async, kwargs),
remote_parameters, train/eval on the owner, the attributes a RemoteModule carries over RPC,
init_from_module_rref, a bad module_cls, and three training steps of a local stage and the
remote module with dist_autograd and DistributedOptimizer must give what torch's give."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.multiproc.test_dist_autograd_context import run_in_torch
from tests.support.rpc_workers import RpcWorkers

STEPS = 3
LR = 0.05


def _values(seed: int, shape: tuple) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def _affine_class(nn, lib):
    """y = tanh(x @ W.T + b) * scale, float64, W and b from a seed: the same in both."""

    class Affine(nn.Module):
        def __init__(self, seed: int, n_in: int = 4, n_out: int = 3):
            super().__init__()
            self.weight = nn.Parameter(lib.tensor(_values(seed, (n_out, n_in))))
            self.bias = nn.Parameter(lib.tensor(_values(seed + 1, (n_out,))))

        def forward(self, x, scale=1.0):
            return (x @ self.weight.t() + self.bias).tanh() * scale

    return Affine


def _shoal_affine():
    from shoal import core

    return _affine_class(core.nn, core)


def _torch_affine():
    import torch

    return _affine_class(torch.nn, torch)


# Module-level names, so each world's workers unpickle the class by reference.
ShoalAffine = _shoal_affine()
ShoalAffine.__qualname__ = ShoalAffine.__name__ = "ShoalAffine"
try:
    # torch builds RemoteModule's forward functions as a module when torch.distributed.nn is
    # imported: every rank of the torch world (which imports this file) needs it.
    import torch.distributed.nn  # noqa: F401

    TorchAffine = _torch_affine()
    TorchAffine.__qualname__ = TorchAffine.__name__ = "TorchAffine"
except ImportError:
    TorchAffine = None


class NotAModule:
    def __init__(self, *args):
        pass


def training_of(module_rref):
    return module_rref.local_value().training


def attributes_of(remote_module):
    attrs = vars(remote_module)
    return (list(attrs), attrs["on"], attrs["device"], attrs["is_device_map_set"],
            attrs["is_scriptable"])


def parameters_of(module_rref):
    return [p.detach().numpy().copy() for p in module_rref.local_value().parameters()]


def _error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001  (the observation is the exception itself)
        return type(exc).__name__, str(exc)
    return None


def _observe(rpc, remote_module_cls, affine, lib, sgd, dist_optimizer, dist_autograd,
             mse_loss) -> dict:
    """The scenario on w0; the remote module lives on w1."""
    numpy = lambda t: t.detach().numpy().tolist()  # noqa: E731
    x = lib.tensor(_values(1, (2, 4)))
    rm = remote_module_cls("w1/cpu", affine, (7,))
    obs = {
        "forward": numpy(rm.forward(x)),
        "forward_async": numpy(rm.forward_async(x, scale=2.0).wait()),
        "forward_kwargs": numpy(rm.forward(x, scale=3.0)),
        "call": numpy(rm(x)),
        "parameters": [numpy(p.to_here()) for p in rm.remote_parameters()],
        "parameters_not_recursive": len(rm.remote_parameters(recurse=False)),
        "module_rref_is_it": rm.get_module_rref() is rm.module_rref,
        "trained": rpc.rpc_sync("w1", training_of, (rm.get_module_rref(),)),
    }
    rm.eval()
    obs["after_eval"] = rpc.rpc_sync("w1", training_of, (rm.get_module_rref(),))
    rm.train()
    obs["after_train"] = rpc.rpc_sync("w1", training_of, (rm.get_module_rref(),))
    obs["on_the_wire"] = rpc.rpc_sync("w1", attributes_of, (rm,))
    twin = rpc.rpc_sync("w1", remote_module_cls.init_from_module_rref,
                        ("w1", rm.get_module_rref()))
    obs["twin_forward"] = numpy(twin.forward(x))
    obs["bad_module"] = _error(lambda: remote_module_cls("w1", NotAModule, (1,)).forward(x))
    obs["trained_parameters"] = _train(rpc, remote_module_cls, affine, lib, sgd,
                                       dist_optimizer, dist_autograd, mse_loss)
    return obs


def _train(rpc, remote_module_cls, affine, lib, sgd, dist_optimizer, dist_autograd,
           mse_loss) -> list:
    """A local stage on w0 and a remote one on w1, trained STEPS steps with dist_autograd."""
    local = affine(11, 4, 4)
    rm = remote_module_cls("w1/cpu", affine, (7,))
    params = rm.remote_parameters() + [rpc.RRef(p) for p in local.parameters()]
    opt = dist_optimizer(sgd, params, lr=LR)
    x, y = lib.tensor(_values(2, (5, 4))), lib.tensor(_values(3, (5, 3)))
    for _ in range(STEPS):
        with dist_autograd.context() as cid:
            loss = mse_loss(rm(local(x)), y)
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
    remote_params = rpc.rpc_sync("w1", parameters_of, (rm.get_module_rref(),))
    return [p.tolist() for p in remote_params] + [
        p.detach().numpy().tolist() for p in local.parameters()]


def shoal_scenario() -> dict:
    from shoal import core, rpc_agent
    from shoal.core.nn import functional
    from shoal.rpc_agent import dist_autograd
    from shoal.rpc_agent.nn import RemoteModule
    from shoal.rpc_agent.optim import DistributedOptimizer

    return _observe(rpc_agent, RemoteModule, ShoalAffine, core, core.optim.SGD,
                    DistributedOptimizer, dist_autograd, functional.mse_loss)


def torch_scenario() -> dict:
    import torch
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as trpc
    from torch.distributed.nn import RemoteModule
    from torch.distributed.optim import DistributedOptimizer

    return _observe(trpc, RemoteModule, TorchAffine, torch, torch.optim.SGD,
                    DistributedOptimizer, dist_autograd, torch.nn.functional.mse_loss)


@pytest.fixture(scope="module")
def workers():
    with RpcWorkers(2) as pool:
        yield pool
        pool.shutdown()


# float64 throughout; the two libraries' matmuls may sum in other orders (BLAS kernels), a few
# ulps per op: 1e-12 for one forward, 1e-10 after three training steps (as the examples' test).
FORWARD_ATOL = 1e-12
TRAINED_ATOL = 1e-10
VALUES = ("forward", "forward_async", "forward_kwargs", "call", "parameters", "twin_forward")


def test_remote_module_behaves_as_torchs(workers, tmp_path):
    pytest.importorskip("torch")
    theirs = run_in_torch(torch_scenario, tmp_path)
    ours = workers.run(0, shoal_scenario, timeout=120)
    assert sorted(ours) == sorted(theirs)
    for key in VALUES:
        for a, b in zip(ours[key], theirs[key]) if key == "parameters" else [(ours[key],
                                                                             theirs[key])]:
            np.testing.assert_allclose(a, b, rtol=0, atol=FORWARD_ATOL, err_msg=key)
    assert len(ours["parameters"]) == len(theirs["parameters"]) == 2
    for a, b in zip(ours["trained_parameters"], theirs["trained_parameters"], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=TRAINED_ATOL)
    # The steps moved both stages' weights (the remote one first, the local one third).
    assert not np.allclose(ours["trained_parameters"][0], _values(7, (3, 4)))
    assert not np.allclose(ours["trained_parameters"][2], _values(11, (4, 4)))
    same = ("parameters_not_recursive", "module_rref_is_it", "trained", "after_eval",
            "after_train", "on_the_wire")
    assert {k: ours[k] for k in same} == {k: theirs[k] for k in same}
    assert ours["on_the_wire"] == (
        ["on", "device", "is_device_map_set", "is_scriptable", "generated_methods",
         "module_rref", "forward_async", "forward"], "w1", "cpu", False, False)
    assert (ours["after_eval"], ours["after_train"]) == (False, True)
    assert ours["bad_module"][0] == theirs["bad_module"][0] == "ValueError"
    # torch's message is the same sentence after "On WorkerInfo(id=1, name=w1):".
    assert re.match(r"Expect `module_cls\(\*args, \*\*kwargs\)` returns an instance of <class "
                    r"nn\.Module>, but it returns an instance of <class '[\w.]*NotAModule'>\.$",
                    ours["bad_module"][1]), ours["bad_module"][1]
    assert ours["bad_module"][1] in theirs["bad_module"][1]
