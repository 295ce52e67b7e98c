"""core.optim against torch.optim: updates, parameter groups, zero_grad and state_dict."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from shoal import core
from shoal.core.errors import ShapeError
from shoal.core.optim import SGD, Adam, AdamW, OptimizerError
from tests.support.optim_oracle import param_pairs, set_grad_pairs

torch = pytest.importorskip("torch")

SHAPES = [(5, 3), (3,), (2, 2, 2)]

CASES = [
    ("sgd", dict(lr=0.1)),
    ("sgd", dict(lr=0.1, momentum=0.9)),
    ("sgd", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)),
    ("sgd", dict(lr=0.05, momentum=0.5, dampening=0.5, maximize=True)),
    ("adam", dict(lr=0.01)),
    ("adam", dict(lr=0.01, betas=(0.8, 0.9), weight_decay=0.1, amsgrad=True)),
    ("adamw", dict(lr=0.01)),
    ("adamw", dict(lr=0.02, weight_decay=0.3, amsgrad=True, maximize=True)),
]
OURS = {"sgd": SGD, "adam": Adam, "adamw": AdamW}
THEIRS = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}






def _make(kind, ours, theirs, kwargs):
    # Two groups: the second overrides lr, so per-group hyper-parameters are exercised too.
    ours_opt = OURS[kind]([{"params": ours[:2]}, {"params": ours[2:], "lr": kwargs["lr"] / 2}],
                          **kwargs)
    theirs_opt = getattr(torch.optim, THEIRS[kind])(
        [{"params": theirs[:2]}, {"params": theirs[2:], "lr": kwargs["lr"] / 2}],
        foreach=False, **kwargs)
    return ours_opt, theirs_opt


def _assert_same(ours, theirs):
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a.array, b.detach().numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kind,kwargs", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_updates_match_torch_over_steps_with_groups_and_missing_grads(kind, kwargs):
    rng = np.random.default_rng(0)
    ours, theirs = param_pairs(rng, SHAPES)
    ours_opt, theirs_opt = _make(kind, ours, theirs, kwargs)
    for step in range(5):
        set_grad_pairs(ours, theirs, rng, skip=1 if step == 2 else None)
        ours_opt.step()
        theirs_opt.step()
        _assert_same(ours, theirs)


@pytest.mark.parametrize("kind,kwargs", [CASES[2], CASES[5], CASES[7]], ids=["sgd", "adam", "adamw"])
def test_state_dict_round_trip_continues_exactly(kind, kwargs):
    rng = np.random.default_rng(1)
    ours, theirs = param_pairs(rng, SHAPES)
    ours_opt, theirs_opt = _make(kind, ours, theirs, kwargs)
    for _ in range(3):
        set_grad_pairs(ours, theirs, rng)
        ours_opt.step()
        theirs_opt.step()
    state = ours_opt.state_dict()
    theirs_state = theirs_opt.state_dict()
    assert [g["params"] for g in state["param_groups"]] == [[0, 1], [2]]
    assert sorted(state["state"]) == sorted(theirs_state["state"])
    for index, entry in theirs_state["state"].items():
        assert set(state["state"][index]) == set(entry)

    # Restore into fresh parameters (same values) and a fresh optimizer, after a pickle trip.
    restored = [core.tensor(p.array.copy(), requires_grad=True) for p in ours]
    new_opt = OURS[kind]([{"params": restored[:2]}, {"params": restored[2:]}], lr=1.0)
    new_opt.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert new_opt.param_groups[1]["lr"] == kwargs["lr"] / 2
    for _ in range(2):
        set_grad_pairs(ours, theirs, rng)
        for a, b in zip(restored, ours):
            a.grad = core.tensor(b.grad.array.copy())
        new_opt.step()
        ours_opt.step()
        theirs_opt.step()
    _assert_same(restored, theirs)
    # The loaded state is a copy: stepping the restored optimizer left the saved dict alone.
    assert state["state"][0] is not new_opt.state[restored[0]]


def test_load_state_dict_rejects_mismatches_without_changing_anything():
    rng = np.random.default_rng(2)
    ours, theirs = param_pairs(rng, SHAPES)
    opt = SGD([{"params": ours[:2]}, {"params": ours[2:]}], lr=0.1, momentum=0.9)
    set_grad_pairs(ours, theirs, rng)
    opt.step()
    good = opt.state_dict()
    before = pickle.dumps(good)

    one_group = SGD(ours, lr=0.1, momentum=0.9)
    with pytest.raises(OptimizerError, match="has 2 parameter groups but SGD has 1"):
        one_group.load_state_dict(good)

    bad = pickle.loads(before)
    bad["param_groups"][1]["params"] = [2, 3]
    with pytest.raises(OptimizerError, match="parameter group 1 has 2 parameters but the optimizer's group 1 has 1"):
        opt.load_state_dict(bad)

    bad = pickle.loads(before)
    bad["state"][1]["momentum_buffer"] = core.zeros(7)
    bad["param_groups"][0]["lr"] = 123.0
    with pytest.raises(OptimizerError, match=r"'momentum_buffer' for parameter 1 has shape \(7,\) but the parameter has shape \(3,\)"):
        opt.load_state_dict(bad)
    assert opt.param_groups[0]["lr"] == 0.1  # nothing half-loaded
    assert pickle.dumps(opt.state_dict()) == before

    with pytest.raises(OptimizerError, match="exactly the keys 'state' and 'param_groups'"):
        opt.load_state_dict({"state": {}})


def test_steps_update_in_place_and_reuse_buffers():
    p = core.tensor(np.ones((64, 32), dtype=np.float32), requires_grad=True)
    opt = Adam([p], lr=0.1)
    p.grad = core.tensor(np.full((64, 32), 0.5, dtype=np.float32))
    data = p.array
    opt.step()
    exp_avg = opt.state[p]["exp_avg"].array
    opt.step()
    assert p.array is data and p.array.dtype == np.float32
    assert opt.state[p]["exp_avg"].array is exp_avg and opt.state[p]["step"] == 2


def test_zero_grad_sets_none_or_zeros_in_place():
    p = core.tensor(np.ones(3), requires_grad=True)
    opt = SGD([p], lr=0.1)
    p.grad = core.tensor(np.ones(3))
    grad_data = p.grad.array
    opt.zero_grad(set_to_none=False)
    assert p.grad.array is grad_data and not grad_data.any()
    opt.zero_grad()
    assert p.grad is None


def test_bad_arguments_are_rejected_with_clear_errors():
    p = core.tensor(np.ones(3), requires_grad=True)
    with pytest.raises(OptimizerError, match="SGD lr must be >= 0; got -1"):
        SGD([p], lr=-1)
    with pytest.raises(OptimizerError, match="nesterov momentum requires momentum > 0"):
        SGD([p], lr=0.1, nesterov=True)
    with pytest.raises(OptimizerError, match=r"Adam betas must be two numbers in \[0, 1\); got \(0.9, 1.0\)"):
        Adam([p], betas=(0.9, 1.0))
    with pytest.raises(OptimizerError, match="empty parameter list"):
        SGD([], lr=0.1)
    with pytest.raises(OptimizerError, match="single Tensor; wrap it in a list"):
        SGD(p, lr=0.1)
    with pytest.raises(OptimizerError, match="not a set"):
        SGD([{"params": {p}}], lr=0.1)
    with pytest.raises(OptimizerError, match="non-leaf Tensor"):
        SGD([p * 2], lr=0.1)
    opt = SGD([p], lr=0.1)
    with pytest.raises(OptimizerError, match="more than one parameter group"):
        opt.add_param_group({"params": [p]})
    q = core.tensor(np.ones(2), requires_grad=True)
    opt.add_param_group({"params": q, "momentum": 0.5})
    assert opt.param_groups[1]["lr"] == 0.1 and opt.param_groups[1]["momentum"] == 0.5
    q.grad = core.tensor(np.ones(5))
    with pytest.raises(ShapeError, match=r"shape \(2,\) has a gradient of shape \(5,\)"):
        opt.step()


def test_step_returns_the_closure_loss():
    p = core.tensor(np.ones(2), requires_grad=True)
    opt = SGD([p], lr=0.5)

    def closure():
        p.grad = core.tensor(np.ones(2))
        return 3.0

    assert opt.step(closure) == 3.0
    np.testing.assert_allclose(p.array, [0.5, 0.5])
