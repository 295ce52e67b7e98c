"""DistributedOptimizer over three workers: steps equal one process's SGD and Adam; an owner's
failing step is re-raised naming that worker and the context while the other owners still
step; the owners step at the same time."""

from __future__ import annotations

import pathlib
import time

import numpy as np
import pytest

from shoal import core, rpc_agent
from shoal.rpc_agent import dist_autograd
from shoal.rpc_agent.optim import DistributedOptimizer, DistributedOptimizerError
from tests.support.rpc_workers import RpcWorkers

_PARAMS: dict = {}


def _w(rank: int) -> np.ndarray:
    return np.random.default_rng(50 + rank).standard_normal((4, 4))


def make_param():
    rank = rpc_agent.get_worker_info().id
    _PARAMS["w"] = core.Tensor(_w(rank), requires_grad=True)


def param_rref():
    return rpc_agent.RRef(_PARAMS["w"])


def param_value():
    return _PARAMS["w"].array.copy()


def stage(x):
    return (x @ _PARAMS["w"]).tanh()


class BrokenStep(core.optim.SGD):
    def step(self, closure=None):
        raise ValueError("this optimizer refuses to step")


class BrokenOnW1(core.optim.SGD):
    """Steps everywhere but on w1."""

    def step(self, closure=None):
        if rpc_agent.get_worker_info().name == "w1":
            raise ValueError("w1's optimizer refuses to step")
        return super().step(closure)


class MeetsTheOtherOwners(core.optim.SGD):
    """Steps only once every owner in `owners` has begun its step (each marks its start with a
    file in `meet_dir`): owners stepped one after another never meet, and the first gives up
    after 10 s with an error naming the owners it waited for."""

    def __init__(self, params, lr: float, meet_dir: str, owners: tuple):
        super().__init__(params, lr=lr)
        self.meet_dir, self.owners = pathlib.Path(meet_dir), owners

    def step(self, closure=None):
        me = rpc_agent.get_worker_info().name
        (self.meet_dir / me).touch()
        deadline = time.monotonic() + 10
        while True:
            missing = [o for o in self.owners if not (self.meet_dir / o).exists()]
            if not missing:
                return super().step(closure)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{me}'s step waited 10 s for the steps of {missing} to "
                                   "begin: the owners were not stepped at the same time")
            time.sleep(0.005)


def train(optim_name: str, steps: int):
    optim_class = {"sgd": core.optim.SGD, "adam": core.optim.Adam}[optim_name]
    rrefs = [param_rref(), rpc_agent.rpc_sync("w1", param_rref)]
    opt = DistributedOptimizer(optim_class, rrefs, lr=0.05)
    x = core.Tensor(np.random.default_rng(1).standard_normal((3, 4)))
    for _ in range(steps):
        with dist_autograd.context() as cid:
            y = rpc_agent.rpc_sync("w1", stage, (stage(x),))
            dist_autograd.backward(cid, [(y * y).sum()])
            opt.step(cid)
    return param_value(), rpc_agent.rpc_sync("w1", param_value)


def _step_over_two_owners(optimizer_class):
    """One forward through this worker and w1, a distributed backward and a step of
    `optimizer_class` on both owners; (context id, the step's error text or None)."""
    rrefs = [param_rref(), rpc_agent.rpc_sync("w1", param_rref)]
    opt = DistributedOptimizer(optimizer_class, rrefs, lr=0.1)
    x = core.Tensor(np.ones((3, 4)))
    with dist_autograd.context() as cid:
        y = rpc_agent.rpc_sync("w1", stage, (stage(x),))
        dist_autograd.backward(cid, [y.sum()])
        try:
            opt.step(cid)
        except DistributedOptimizerError as exc:
            return cid, str(exc)
    return cid, None


def failing_step():
    return _step_over_two_owners(BrokenStep)


def failing_step_on_w1():
    before = param_value()
    cid, error = _step_over_two_owners(BrokenOnW1)
    return cid, error, before, param_value()


def step_two_remote_owners(meet_dir: str):
    rrefs = [rpc_agent.rpc_sync(w, param_rref) for w in ("w1", "w2")]
    before = [rpc_agent.rpc_sync(w, param_value) for w in ("w1", "w2")]
    opt = DistributedOptimizer(MeetsTheOtherOwners, rrefs, lr=0.1, meet_dir=meet_dir,
                               owners=("w1", "w2"))
    x = core.Tensor(np.ones((3, 4)))
    with dist_autograd.context() as cid:
        y = rpc_agent.rpc_sync("w2", stage, (rpc_agent.rpc_sync("w1", stage, (x,)),))
        dist_autograd.backward(cid, [y.sum()])
        opt.step(cid)
    after = [rpc_agent.rpc_sync(w, param_value) for w in ("w1", "w2")]
    return before, after


def bad_arguments():
    out = []
    for args in ((core.optim.SGD, []), ("SGD", [param_rref()]), (core.optim.SGD, [1])):
        try:
            DistributedOptimizer(*args, lr=0.1)
        except DistributedOptimizerError as exc:
            out.append(str(exc))
    try:
        DistributedOptimizer(core.optim.SGD, [rpc_agent.rpc_sync("w1", param_rref)], lr=-1.0)
    except DistributedOptimizerError as exc:
        out.append(str(exc))
    return out


@pytest.fixture(scope="module")
def workers():
    with RpcWorkers(3) as pool:
        yield pool
        pool.shutdown()


@pytest.mark.parametrize("optim_name", ["sgd", "adam"])
def test_steps_equal_one_process(workers, optim_name):
    workers.run_all(make_param)
    w0, w1 = workers.run(0, train, optim_name, 5)
    ws = [core.Tensor(_w(r), requires_grad=True) for r in range(2)]
    optim_class = {"sgd": core.optim.SGD, "adam": core.optim.Adam}[optim_name]
    opt = optim_class(ws, lr=0.05)
    x = core.Tensor(np.random.default_rng(1).standard_normal((3, 4)))
    for _ in range(5):
        opt.zero_grad()
        y = ((x @ ws[0]).tanh() @ ws[1]).tanh()
        (y * y).sum().backward()
        opt.step()
    np.testing.assert_allclose(w0, ws[0].array, rtol=0, atol=1e-10)
    np.testing.assert_allclose(w1, ws[1].array, rtol=0, atol=1e-10)
    assert not np.allclose(w0, _w(0))


def test_an_owner_failing_its_step_is_named(workers):
    workers.run_all(make_param)
    cid, message = workers.run(0, failing_step)
    assert message is not None
    assert message.startswith(
        f"DistributedOptimizer.step(context {cid}): the optimizer on worker 'w0' failed: "
        "ValueError: this optimizer refuses to step"), message


def test_only_the_owner_that_fails_is_named(workers):
    workers.run_all(make_param)
    cid, message, before, after = workers.run(0, failing_step_on_w1)
    assert message is not None
    assert message == (
        f"DistributedOptimizer.step(context {cid}): the optimizer on worker 'w1' failed: "
        "ValueError: w1's optimizer refuses to step"), message
    # The other owner still stepped.
    assert not np.allclose(after, before)


def test_owners_step_at_the_same_time(workers, tmp_path):
    workers.run_all(make_param)
    before, after = workers.run(0, step_two_remote_owners, str(tmp_path), timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w1", "w2"]
    for b, a in zip(before, after):
        assert not np.allclose(a, b)


def test_bad_arguments(workers):
    workers.run_all(make_param)
    messages = workers.run(0, bad_arguments)
    need_rrefs = ("DistributedOptimizer needs a non-empty list of RRefs to parameters "
                  "(rpc_agent.RRef(param) on their owners).")
    assert messages[0] == need_rrefs
    assert messages[1] == "DistributedOptimizer needs an optimizer class, got 'SGD'."
    assert messages[2] == need_rrefs
    assert messages[3].startswith("DistributedOptimizer could not build SGD on worker 'w1':")
