"""Adagrad, Adadelta, RMSprop, Adamax, Rprop, NAdam and RAdam against torch.optim."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from shoal import core
from shoal.core import optim
from shoal.core.optim import OptimizerError
from tests.support.optim_oracle import param_pairs, set_grad_pairs

torch = pytest.importorskip("torch")

SHAPES = [(4, 3), (3,), (2, 2, 2)]
STEPS = 12  # long enough for RAdam's rho_t to pass 5 (step 6 with the default betas)

CASES = [
    ("Adagrad", dict(lr=0.1)),
    ("Adagrad", dict(lr=0.1, lr_decay=0.05, weight_decay=0.1, initial_accumulator_value=0.3,
                     maximize=True)),
    ("Adadelta", dict()),
    ("Adadelta", dict(lr=0.5, rho=0.8, weight_decay=0.05, maximize=True)),
    ("RMSprop", dict(lr=0.01)),
    ("RMSprop", dict(lr=0.01, momentum=0.9, centered=True, weight_decay=0.1)),
    ("RMSprop", dict(lr=0.01, alpha=0.9, centered=True, maximize=True)),
    ("RMSprop", dict(lr=0.01, momentum=0.5)),
    ("Adamax", dict()),
    ("Adamax", dict(lr=0.01, betas=(0.8, 0.9), weight_decay=0.1, maximize=True)),
    ("Rprop", dict()),
    ("Rprop", dict(lr=0.05, etas=(0.3, 1.5), step_sizes=(1e-3, 0.2), maximize=True)),
    ("NAdam", dict()),
    ("NAdam", dict(lr=0.01, momentum_decay=0.01, weight_decay=0.1)),
    ("NAdam", dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True, maximize=True)),
    ("RAdam", dict()),
    ("RAdam", dict(lr=0.01, betas=(0.8, 0.9), weight_decay=0.1)),
    ("RAdam", dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True, maximize=True)),
]
IDS = [f"{name}-{i}" for i, (name, _) in enumerate(CASES)]






def _make(name, ours, theirs, kwargs):
    # Two groups: the second overrides lr, so per-group hyper-parameters are exercised too.
    lr = kwargs.get("lr", getattr(torch.optim, name)([torch.zeros(1)]).defaults["lr"])
    ours_opt = getattr(optim, name)(
        [{"params": ours[:2]}, {"params": ours[2:], "lr": lr / 2}], **kwargs)
    theirs_opt = getattr(torch.optim, name)(
        [{"params": theirs[:2]}, {"params": theirs[2:], "lr": lr / 2}], foreach=False, **kwargs)
    return ours_opt, theirs_opt


def _assert_same(ours, theirs):
    # float64 throughout; the two libraries order a few multiplies differently (torch's
    # addcmul/addcdiv/lerp), which costs a few ulps per step over 12 steps: 1e-10 is ample.
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a.array, b.detach().numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name,kwargs", CASES, ids=IDS)
def test_updates_match_torch_over_steps_with_groups_and_missing_grads(name, kwargs):
    rng = np.random.default_rng(0)
    ours, theirs = param_pairs(rng, SHAPES)
    ours_opt, theirs_opt = _make(name, ours, theirs, kwargs)
    for step in range(STEPS):
        set_grad_pairs(ours, theirs, rng, skip=1 if step == 2 else None)
        ours_opt.step()
        theirs_opt.step()
        _assert_same(ours, theirs)


@pytest.mark.parametrize("name,kwargs", CASES, ids=IDS)
def test_defaults_state_keys_and_group_keys_match_torch(name, kwargs):
    rng = np.random.default_rng(1)
    ours, theirs = param_pairs(rng, SHAPES)
    ours_opt, theirs_opt = _make(name, ours, theirs, kwargs)
    set_grad_pairs(ours, theirs, rng)
    ours_opt.step()
    theirs_opt.step()
    mine, yours = ours_opt.state_dict(), theirs_opt.state_dict()
    assert sorted(mine["param_groups"][0]) == sorted(yours["param_groups"][0])
    for key, value in yours["param_groups"][1].items():
        if key == "foreach":
            continue  # torch's side was built with foreach=False, shoal's left it None
        assert mine["param_groups"][1][key] == value, key
    assert {k: sorted(v) for k, v in mine["state"].items()} == {
        k: sorted(v) for k, v in yours["state"].items()}


@pytest.mark.parametrize("name,kwargs", CASES[1::2], ids=IDS[1::2])
def test_state_dict_round_trip_continues_exactly(name, kwargs):
    rng = np.random.default_rng(2)
    ours, theirs = param_pairs(rng, SHAPES)
    ours_opt, theirs_opt = _make(name, ours, theirs, kwargs)
    for _ in range(3):
        set_grad_pairs(ours, theirs, rng)
        ours_opt.step()
        theirs_opt.step()
    saved = pickle.loads(pickle.dumps(ours_opt.state_dict()))
    copies = [core.tensor(p.array.copy(), requires_grad=True) for p in ours]
    fresh, _ = _make(name, copies, [torch.zeros(s) for s in SHAPES], kwargs)
    fresh.load_state_dict(saved)
    for _ in range(STEPS - 3):
        set_grad_pairs(ours, theirs, rng)
        for a, c in zip(ours, copies):
            c.grad = core.tensor(a.grad.array.copy())
        fresh.step()
        theirs_opt.step()
        _assert_same(copies, theirs)


@pytest.mark.parametrize("name,kwargs,match", [
    ("Adagrad", dict(lr=-1.0), "Invalid learning rate"),
    ("Adagrad", dict(lr_decay=-1.0), "Invalid lr_decay value"),
    ("Adagrad", dict(initial_accumulator_value=-1.0), "Invalid initial_accumulator_value"),
    ("Adadelta", dict(rho=1.5), "Invalid rho value"),
    ("RMSprop", dict(momentum=-0.1), "Invalid momentum value"),
    ("RMSprop", dict(alpha=-0.1), "Invalid alpha value"),
    ("Adamax", dict(betas=(1.0, 0.9)), "Invalid beta parameter at index 0"),
    ("Rprop", dict(etas=(1.5, 2.0)), "Invalid eta values"),
    ("NAdam", dict(momentum_decay=-1.0), "Invalid momentum_decay value"),
    ("RAdam", dict(eps=-1.0), "Invalid epsilon value"),
    ("RAdam", dict(betas=(0.9, 1.0)), "Invalid beta parameter at index 1"),
])
def test_bad_arguments_raise_torchs_value_error(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        getattr(torch.optim, name)([torch.zeros(2, requires_grad=True)], **kwargs)
    with pytest.raises(ValueError, match=match):
        getattr(optim, name)([core.zeros(2, requires_grad=True)], **kwargs)


def test_differentiable_is_refused_and_foreach_accepted():
    p = core.zeros(2, requires_grad=True)
    with pytest.raises(OptimizerError, match=r"differentiable=True\) is not supported"):
        optim.RMSprop([p], differentiable=True)
    opt = optim.RMSprop([p], foreach=True)
    assert opt.param_groups[0]["foreach"] is True


def test_adagrad_state_exists_before_the_first_step_as_torch():
    ours = optim.Adagrad([core.zeros(3, requires_grad=True)], initial_accumulator_value=0.5)
    theirs = torch.optim.Adagrad([torch.zeros(3, requires_grad=True)],
                                 initial_accumulator_value=0.5)
    np.testing.assert_array_equal(ours.state_dict()["state"][0]["sum"].array,
                                  theirs.state_dict()["state"][0]["sum"].numpy())
