"""MultiStepLR, ConstantLR, PolynomialLR, SequentialLR, CosineAnnealingWarmRestarts and
ReduceLROnPlateau against torch.optim.lr_scheduler: lr sequences, get_last_lr, state_dict."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest

from shoal import core
from shoal.core.optim import SGD
from shoal.core.optim import lr_scheduler as ls
from shoal.core.optim.lr_scheduler import SchedulerError
from tests.support.optim_oracle import lr_sequence

torch = pytest.importorskip("torch")
tls = torch.optim.lr_scheduler

STEPS = 25

CONFIGS = {
    "multistep": lambda m, o: [m.MultiStepLR(o, milestones=[3, 7, 7, 12], gamma=0.5)],
    "constant": lambda m, o: [m.ConstantLR(o, factor=0.25, total_iters=6)],
    "polynomial": lambda m, o: [m.PolynomialLR(o, total_iters=9, power=2.0)],
    "warm_restarts": lambda m, o: [m.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2,
                                                                 eta_min=0.001)],
    "warm_restarts_1": lambda m, o: [m.CosineAnnealingWarmRestarts(o, T_0=4)],
    "sequential": lambda m, o: [m.SequentialLR(o, [m.LinearLR(o, 0.1, total_iters=4),
                                                   m.ExponentialLR(o, gamma=0.9),
                                                   m.CosineAnnealingLR(o, T_max=5)],
                                               milestones=[5, 12])],
    "sequential_constant_multistep": lambda m, o: [m.SequentialLR(
        o, [m.ConstantLR(o, factor=0.5, total_iters=3), m.MultiStepLR(o, [2, 4])],
        milestones=[6])],
    "multistep+constant": lambda m, o: [m.MultiStepLR(o, [4, 8]), m.ConstantLR(o, 0.5, 3)],
    "chained_polynomial": lambda m, o: [m.ChainedScheduler(
        [m.PolynomialLR(o, total_iters=6), m.ExponentialLR(o, gamma=0.95)])],
}


def _opt(module, lr=0.1, groups=2):
    if module is ls:
        params = [core.tensor(np.zeros(2), requires_grad=True) for _ in range(groups)]
        cls = SGD
    else:
        params = [torch.zeros(2, requires_grad=True) for _ in range(groups)]
        cls = torch.optim.SGD
    return cls([{"params": [p], "lr": lr * (i + 1)} for i, p in enumerate(params)], lr=lr)




@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_schedule_matches_torch(name):
    ours_opt, torch_opt = _opt(ls), _opt(tls)
    ours = lr_sequence(ours_opt, CONFIGS[name](ls, ours_opt), STEPS)
    theirs = lr_sequence(torch_opt, CONFIGS[name](tls, torch_opt), STEPS)
    # Same formulas in the same order on float64: equal up to an ulp or two of drift.
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_state_dict_round_trip_resumes_the_same_sequence(name):
    opt = _opt(ls)
    full = lr_sequence(opt, CONFIGS[name](ls, opt), STEPS)

    opt = _opt(ls)
    schedulers = CONFIGS[name](ls, opt)
    head = lr_sequence(opt, schedulers, 8)
    saved_opt = pickle.loads(pickle.dumps(opt.state_dict()))
    saved = pickle.loads(pickle.dumps([s.state_dict() for s in schedulers]))
    fresh_opt = _opt(ls)
    fresh = CONFIGS[name](ls, fresh_opt)
    fresh_opt.load_state_dict(saved_opt)
    for s, state in zip(fresh, saved):
        s.load_state_dict(state)
    tail = lr_sequence(fresh_opt, fresh, STEPS - 8)
    np.testing.assert_allclose(head + tail[1:], full, rtol=1e-12)


@pytest.mark.parametrize("name,kwargs", [
    ("StepLR", dict(step_size=3, gamma=0.5)),
    ("MultiStepLR", dict(milestones=[2, 5, 5], gamma=0.5)),
    ("ConstantLR", dict(factor=0.5, total_iters=4)),
    ("LinearLR", dict(start_factor=0.2, total_iters=6)),
    ("ExponentialLR", dict(gamma=0.8)),
    ("PolynomialLR", dict(total_iters=6, power=1.5)),
    ("CosineAnnealingLR", dict(T_max=7, eta_min=0.01)),
])
def test_step_with_an_epoch_uses_torchs_closed_form(name, kwargs):
    results = []
    for module in (ls, tls):
        opt = _opt(module)
        sched = getattr(module, name)(opt, **kwargs)
        seq = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch and shoal both warn: epoch is deprecated
            for epoch in (4, 1, 9, 3, 3):
                sched.step(epoch)
                seq.append(sched.get_last_lr())
        results.append(seq)
    np.testing.assert_allclose(results[0], results[1], rtol=1e-12)


def test_warm_restarts_jump_to_fractional_epochs_as_torch():
    results = []
    for module in (ls, tls):
        opt = _opt(module)
        sched = module.CosineAnnealingWarmRestarts(opt, T_0=3, T_mult=2)
        seq = []
        for epoch in (0.5, 2.9, 3.0, 7.25, 20.0, 1.0):
            sched.step(epoch)
            seq.append(sched.get_last_lr() + [sched.T_i, sched.T_cur, sched.last_epoch])
        results.append(seq)
    np.testing.assert_allclose(results[0], results[1], rtol=1e-12)


PLATEAU = [
    dict(),
    dict(mode="max", factor=0.5, patience=2, threshold=0.1, threshold_mode="abs", cooldown=2),
    dict(factor=0.5, patience=1, cooldown=1, min_lr=[0.02, 0.05]),
    dict(mode="max", factor=0.3, patience=0, threshold=0.01, min_lr=0.011, eps=1e-3),
    dict(factor=0.5, patience=1, threshold=0.5, threshold_mode="rel"),
]


@pytest.mark.parametrize("kwargs", PLATEAU)
def test_reduce_on_plateau_matches_torch(kwargs):
    rng = np.random.default_rng(0)
    # A metric that improves, stalls, wobbles, and improves again.
    metrics = np.concatenate([np.linspace(5, 1, 6), np.ones(8) + rng.uniform(0, 0.2, 8),
                              np.linspace(1, 0.1, 5), np.full(20, 0.1)])
    seqs = []
    for module in (ls, tls):
        opt = _opt(module)
        sched = module.ReduceLROnPlateau(opt, **kwargs)
        seq = []
        for metric in metrics:
            opt.step()
            lib = core if module is ls else torch
            sched.step(lib.tensor(metric, dtype=lib.float64))
            seq.append(sched.get_last_lr() + [sched.num_bad_epochs, sched.cooldown_counter,
                                              sched.best, sched.last_epoch])
        seqs.append(seq)
    np.testing.assert_allclose(seqs[0], seqs[1], rtol=1e-12)


def test_reduce_on_plateau_state_dict_has_torchs_keys_and_round_trips():
    ours_opt, torch_opt = _opt(ls), _opt(tls)
    ours = ls.ReduceLROnPlateau(ours_opt, mode="max", patience=1, cooldown=1)
    theirs = tls.ReduceLROnPlateau(torch_opt, mode="max", patience=1, cooldown=1)
    for metric in (1.0, 0.5, 0.4):
        ours.step(metric)
        theirs.step(metric)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    fresh_opt = _opt(ls)
    fresh = ls.ReduceLROnPlateau(fresh_opt)
    fresh.load_state_dict(pickle.loads(pickle.dumps(ours.state_dict())))
    fresh_opt.load_state_dict(ours_opt.state_dict())
    for metric in (0.3, 0.3, 2.0, 1.0, 1.0):
        fresh.step(metric)
        theirs.step(metric)
        assert fresh.get_last_lr() == theirs.get_last_lr()
    assert fresh.mode == "max" and fresh.mode_worse == -np.inf


def test_sequential_state_dict_has_torchs_keys():
    ours_opt, torch_opt = _opt(ls), _opt(tls)
    ours = CONFIGS["sequential"](ls, ours_opt)[0]
    theirs = CONFIGS["sequential"](tls, torch_opt)[0]
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    assert len(ours.state_dict()["_schedulers"]) == 3


@pytest.mark.parametrize("build,error,match", [
    (lambda m, o: m.ConstantLR(o, factor=1.5), ValueError,
     "Constant multiplicative factor expected to be between 0 and 1"),
    (lambda m, o: m.CosineAnnealingWarmRestarts(o, T_0=0), ValueError,
     "Expected positive integer T_0, but got 0"),
    (lambda m, o: m.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=0), ValueError,
     "Expected integer T_mult >= 1, but got 0"),
    (lambda m, o: m.ReduceLROnPlateau(o, factor=1.0), ValueError, "Factor should be < 1.0"),
    (lambda m, o: m.ReduceLROnPlateau(o, mode="up"), ValueError, "mode up is unknown!"),
    (lambda m, o: m.ReduceLROnPlateau(o, threshold_mode="x"), ValueError,
     "threshold mode x is unknown!"),
    (lambda m, o: m.ReduceLROnPlateau(o, min_lr=[0.1]), ValueError, "expected 2 min_lrs, got 1"),
    (lambda m, o: m.ReduceLROnPlateau([], factor=0.5), TypeError, "list is not an Optimizer"),
    (lambda m, o: m.SequentialLR(o, [], milestones=[]), ValueError,
     "expects at least one scheduler"),
    (lambda m, o: m.SequentialLR(o, [m.StepLR(o, 2), m.StepLR(o, 3)], milestones=[]),
     ValueError, "expects number of schedulers provided to be one more"),
    (lambda m, o: m.SequentialLR(o, [m.ReduceLROnPlateau(o)], milestones=[]), ValueError,
     "does not support `ReduceLROnPlateau`"),
])
def test_bad_arguments_raise_torchs_errors(build, error, match):
    with pytest.raises(error, match=match):
        build(tls, _opt(tls))
    with pytest.raises(error, match=match):
        build(ls, _opt(ls))


def test_scheduler_error_stays_a_value_error():
    assert issubclass(SchedulerError, ValueError)
