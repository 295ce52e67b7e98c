"""PyTorch's optimizer test inputs (the wheel's torch/testing/_internal/common_optimizers.py,
`optim_db`: every optimizer with the configurations torch's own test_optim.py runs on the cpu:
default, weight decay, maximize, momentum, nesterov, amsgrad, tensor learning rates, ...) run on
shoal's optimizer of the same name and on torch's, from the same float64 parameters with the
same closure, comparing the parameters after every step and the closure's loss.

Each configuration either matches torch or is an expected failure named with its reason; one
that starts matching fails here, so the table stays true.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from shoal import core
from tests.torch_ports import shim
from tests.torch_ports.convert import to_core

shim._stub_expecttest()
import torch.testing._internal.common_optimizers as _theirs  # noqa: E402 - after the stand-in

_STEPS = 6
_MISSING = "shoal lacks optim.{0}"
# torch.optim classes shoal does not have: every configuration of theirs is expected to fail
_ABSENT = {"Adafactor", "Muon", "SparseAdam"}


def _configs() -> list[tuple[str, type, dict]]:
    out = []
    for info in _theirs.optim_db:
        name = info.optim_cls.__name__
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inputs = info.optim_inputs_func(device="cpu", dtype=torch.float64)
        for i, optim_input in enumerate(inputs):
            out.append((f"{name}-{i}-{optim_input.desc}", info.optim_cls, optim_input.kwargs))
    return out


_CONFIGS = _configs()
EXPECTED_FAILURES = {cid: _MISSING.format(cls.__name__)
                     for cid, cls, _ in _CONFIGS if cls.__name__ in _ABSENT}


def _problem(lib, params_np, data_np):
    """Float64 parameters and a closure: a least-squares fit with an L1 term (so Rprop's signs
    and the adaptive methods' per-coordinate scales all matter)."""
    tensor = (lambda a: torch.tensor(a)) if lib is torch else (lambda a: core.tensor(a))
    weight, bias = (tensor(p.copy()) for p in params_np)
    weight.requires_grad_(True)
    bias.requires_grad_(True)
    x, y = (tensor(d) for d in data_np)

    def closure(optimizer):
        optimizer.zero_grad()
        loss = ((x @ weight.T + bias - y) ** 2).mean() + 0.01 * weight.abs().sum()
        loss.backward()
        return loss
    return [weight, bias], closure


def _run(lib, cls, kwargs, params_np, data_np):
    params, closure = _problem(lib, params_np, data_np)
    optimizer = cls(params, **kwargs)
    losses, trajectory = [], []
    for _ in range(_STEPS):
        loss = optimizer.step(lambda: closure(optimizer))
        losses.append(float(loss))
        trajectory.append([np.array(p.detach().numpy()) for p in params])
    return losses, trajectory


@pytest.mark.parametrize("config", _CONFIGS, ids=[c[0] for c in _CONFIGS])
def test_torchs_optimizer_configuration(config) -> None:
    config_id, their_cls, kwargs = config
    rng = np.random.default_rng(0)
    params_np = (rng.standard_normal((3, 4)), rng.standard_normal(3))
    data_np = (rng.standard_normal((8, 4)), rng.standard_normal((8, 3)))

    def compare() -> None:
        our_cls = getattr(core.optim, their_cls.__name__)
        ours_kwargs = {k: to_core(v) for k, v in kwargs.items()}
        their_losses, theirs = _run(torch, their_cls, kwargs, params_np, data_np)
        our_losses, ours = _run(core, our_cls, ours_kwargs, params_np, data_np)
        # float64 both; six steps of elementwise updates whose order of operations differs
        # (e.g. torch's fused lerp vs a multiply-add): assert_close's float64 defaults (1e-7)
        np.testing.assert_allclose(our_losses, their_losses, rtol=1e-7, atol=1e-7)
        for step, (mine, their) in enumerate(zip(ours, theirs)):
            for p_mine, p_their in zip(mine, their):
                np.testing.assert_allclose(p_mine, p_their, rtol=1e-7, atol=1e-7,
                                           err_msg=f"step {step + 1}")

    reason = EXPECTED_FAILURES.get(config_id)
    if reason is None:
        compare()
        return
    with pytest.raises(Exception):  # any failure is the expected one
        compare()
    pytest.xfail(reason)
