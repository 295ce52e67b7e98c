"""OneCycleLR against torch: learning rates and cycled momentum/betas at every step."""

import numpy as np
import pytest

from shoal import core
from shoal.core import optim
from shoal.core.optim import lr_scheduler as ls

torch = pytest.importorskip("torch")


def _run(opt, sched, steps, key):
    seq = []
    for _ in range(steps):
        opt.step()
        sched.step()
        g = opt.param_groups[0]
        seq.append((g["lr"], g["momentum"] if key == "momentum" else g["betas"][0]))
    return seq


@pytest.mark.parametrize("kwargs", [
    dict(max_lr=0.5, total_steps=20),
    dict(max_lr=0.5, epochs=4, steps_per_epoch=6, anneal_strategy="linear", pct_start=0.25),
    dict(max_lr=0.5, total_steps=21, three_phase=True, div_factor=10, final_div_factor=100),
])
@pytest.mark.parametrize("opt_name", ["SGD", "AdamW"])
def test_one_cycle_matches_torch(kwargs, opt_name):
    p, tp = core.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    extra = {"momentum": 0.9} if opt_name == "SGD" else {}
    ours_opt = getattr(optim, opt_name)([p], lr=0.1, **extra)
    torch_opt = getattr(torch.optim, opt_name)([tp], lr=0.1, **extra)
    ours = ls.OneCycleLR(ours_opt, **kwargs)
    theirs = torch.optim.lr_scheduler.OneCycleLR(torch_opt, **kwargs)
    steps = (kwargs.get("total_steps") or kwargs["epochs"] * kwargs["steps_per_epoch"]) - 1
    key = "momentum" if opt_name == "SGD" else "betas"
    assert ours_opt.param_groups[0]["lr"] == pytest.approx(torch_opt.param_groups[0]["lr"])
    np.testing.assert_allclose(_run(ours_opt, ours, steps, key), _run(torch_opt, theirs, steps, key),
                               rtol=1e-12, atol=1e-15)
    with pytest.raises(ls.SchedulerError, match="Tried to step"):
        ours.step()
        ours.step()


def test_warmup_then_cosine_chain_matches_torch():
    p, tp = core.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    o, to = optim.AdamW([p], lr=1e-3), torch.optim.AdamW([tp], lr=1e-3)
    mine = [ls.LinearLR(o, 0.1, total_iters=5), ls.CosineAnnealingLR(o, 30)]
    ref = [torch.optim.lr_scheduler.LinearLR(to, 0.1, total_iters=5),
           torch.optim.lr_scheduler.CosineAnnealingLR(to, 30)]
    a, b = [], []
    for _ in range(25):
        o.step(), to.step()
        for s in mine:
            s.step()
        for s in ref:
            s.step()
        a.append(o.param_groups[0]["lr"]), b.append(to.param_groups[0]["lr"])
    np.testing.assert_allclose(a, b, rtol=1e-12)


def test_bad_arguments_are_refused():
    opt = optim.SGD([core.zeros(1, requires_grad=True)], lr=0.1)
    with pytest.raises(ls.SchedulerError, match="needs total_steps, or positive epochs"):
        ls.OneCycleLR(opt, max_lr=1.0)
    with pytest.raises(ls.SchedulerError, match="anneal_strategy must be 'cos' or 'linear'"):
        ls.OneCycleLR(opt, max_lr=1.0, total_steps=10, anneal_strategy="step")
