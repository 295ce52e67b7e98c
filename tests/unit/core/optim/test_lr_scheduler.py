"""core.optim.lr_scheduler against torch.optim.lr_scheduler: sequences, chaining, state_dict."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from shoal import core
from shoal.core.optim import SGD
from shoal.core.optim import lr_scheduler as ls
from shoal.core.optim.lr_scheduler import SchedulerError
from tests.support.optim_oracle import lr_sequence

torch = pytest.importorskip("torch")

STEPS = 20

# (name, factory taking (module, optimizer) -> list of schedulers stepped together)
CONFIGS = {
    "step": lambda m, o: [m.StepLR(o, step_size=3, gamma=0.5)],
    "exponential": lambda m, o: [m.ExponentialLR(o, gamma=0.9)],
    "cosine": lambda m, o: [m.CosineAnnealingLR(o, T_max=6, eta_min=0.01)],
    "lambda": lambda m, o: [m.LambdaLR(o, lambda e: 1.0 / (1 + e))],
    "linear": lambda m, o: [m.LinearLR(o, start_factor=0.25, end_factor=1.0, total_iters=7)],
    "exp+step": lambda m, o: [m.ExponentialLR(o, gamma=0.9), m.StepLR(o, step_size=3, gamma=0.1)],
    "linear+cosine": lambda m, o: [m.LinearLR(o, 0.5, total_iters=4), m.CosineAnnealingLR(o, 5)],
    "chained": lambda m, o: [m.ChainedScheduler([m.ExponentialLR(o, gamma=0.95),
                                                 m.StepLR(o, step_size=4, gamma=0.3)])],
}


def _shoal_opt(lr=0.1, groups=1):
    params = [core.tensor(np.zeros(2), requires_grad=True) for _ in range(groups)]
    return SGD([{"params": [p], "lr": lr * (i + 1)} for i, p in enumerate(params)], lr=lr)


def _torch_opt(lr=0.1, groups=1):
    params = [torch.zeros(2, requires_grad=True) for _ in range(groups)]
    return torch.optim.SGD([{"params": [p], "lr": lr * (i + 1)} for i, p in enumerate(params)],
                           lr=lr)




@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_schedule_matches_torch_for_twenty_steps(name):
    ours_opt, torch_opt = _shoal_opt(groups=2), _torch_opt(groups=2)
    ours = lr_sequence(ours_opt, CONFIGS[name](ls, ours_opt), STEPS)
    theirs = lr_sequence(torch_opt,
                  CONFIGS[name](torch.optim.lr_scheduler, torch_opt), STEPS)
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-15)


def test_exponential_and_step_chain_gives_the_documented_sequence():
    opt = _shoal_opt(lr=0.1)
    seq = lr_sequence(opt, [ls.ExponentialLR(opt, gamma=0.9), ls.StepLR(opt, 3, gamma=0.1)], 4)
    np.testing.assert_allclose([s[0] for s in seq], [0.1, 0.09, 0.081, 0.00729, 0.006561],
                               rtol=1e-12)


@pytest.mark.parametrize("name", ["step", "cosine", "linear", "exp+step", "chained", "lambda"])
def test_state_dict_round_trip_resumes_the_same_sequence(name):
    opt = _shoal_opt(groups=2)
    schedulers = CONFIGS[name](ls, opt)
    full = lr_sequence(opt, schedulers, STEPS)

    opt = _shoal_opt(groups=2)
    schedulers = CONFIGS[name](ls, opt)
    head = lr_sequence(opt, schedulers, 7)
    saved_opt = pickle.loads(pickle.dumps(opt.state_dict()))
    saved = pickle.loads(pickle.dumps([s.state_dict() for s in schedulers]))

    fresh_opt = _shoal_opt(groups=2)
    fresh = CONFIGS[name](ls, fresh_opt)  # construct first, as torch advises, then load
    fresh_opt.load_state_dict(saved_opt)
    for s, state in zip(fresh, saved):
        s.load_state_dict(state)
    tail = lr_sequence(fresh_opt, fresh, STEPS - 7)
    np.testing.assert_allclose(head + tail[1:], full, rtol=1e-12)


def test_lambda_state_dict_keeps_callable_objects_state():
    class Warmup:
        def __init__(self):
            self.scale = 1.0

        def __call__(self, epoch):
            return self.scale * (epoch + 1)

    opt = _shoal_opt()
    fn = Warmup()
    sched = ls.LambdaLR(opt, fn)
    fn.scale = 0.5
    state = sched.state_dict()
    assert state["lr_lambdas"] == [{"scale": 0.5}]
    other_fn = Warmup()
    ls.LambdaLR(_shoal_opt(), other_fn).load_state_dict(state)
    assert other_fn.scale == 0.5


def test_resume_with_last_epoch_needs_initial_lr():
    opt = _shoal_opt()
    with pytest.raises(SchedulerError, match=r"param_groups\[0\] has no 'initial_lr'"):
        ls.StepLR(opt, step_size=2, last_epoch=4)


def test_cosine_resumed_at_an_epoch_uses_the_closed_form_like_torch():
    ours_opt, torch_opt = _shoal_opt(), _torch_opt()
    for o in (ours_opt, torch_opt):
        o.param_groups[0]["initial_lr"] = 0.1
    ours = lr_sequence(ours_opt, [ls.CosineAnnealingLR(ours_opt, 8, last_epoch=3)], 10)
    theirs = lr_sequence(torch_opt,
                  [torch.optim.lr_scheduler.CosineAnnealingLR(torch_opt, 8, last_epoch=3)], 10)
    np.testing.assert_allclose(ours, theirs, rtol=1e-12)


def test_bad_arguments_and_state_are_rejected_with_clear_errors():
    opt = _shoal_opt()
    with pytest.raises(SchedulerError, match="step_size must be a positive int; got 0"):
        ls.StepLR(opt, step_size=0)
    with pytest.raises(SchedulerError, match=r"start_factor must be in \(0, 1\]; got 0"):
        ls.LinearLR(opt, start_factor=0)
    with pytest.raises(SchedulerError, match="got 2 lr_lambdas for an optimizer with 1"):
        ls.LambdaLR(opt, [lambda e: 1, lambda e: 1])
    with pytest.raises(SchedulerError, match="needs a core.optim.Optimizer; got list"):
        ls.StepLR([], step_size=1)
    other = ls.StepLR(_shoal_opt(), step_size=2)
    with pytest.raises(SchedulerError, match="steps a different one"):
        ls.ChainedScheduler([ls.StepLR(opt, 2), other])
    sched = ls.StepLR(opt, step_size=2)
    before = sched.state_dict()
    with pytest.raises(SchedulerError, match=r"missing keys \['gamma'\], unexpected keys \['x'\]"):
        sched.load_state_dict({**{k: v for k, v in before.items() if k != "gamma"}, "x": 1})
    assert sched.state_dict() == before
