"""Shared pieces of the tests that step core's optimizers and schedulers beside torch's."""

from __future__ import annotations

import numpy as np
import torch

from shoal import core


def param_pairs(rng: np.random.Generator, shapes) -> tuple[list, list]:
    """The same random parameters as core tensors and as torch tensors (float64, leaves)."""
    values = [rng.standard_normal(s) for s in shapes]
    ours = [core.tensor(v.copy(), requires_grad=True) for v in values]
    theirs = [torch.tensor(v.copy(), requires_grad=True) for v in values]
    return ours, theirs


def set_grad_pairs(ours, theirs, rng: np.random.Generator, skip=None) -> None:
    """Give each pair the same random gradient; the pair at index `skip` gets none."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if i == skip:
            a.grad, b.grad = None, None
            continue
        g = rng.standard_normal(a.shape)
        a.grad = core.tensor(g.copy())
        b.grad = torch.tensor(g.copy())


def lr_sequence(opt, schedulers, steps: int) -> list:
    """Every group's lr before the first step and after each of `steps` steps, checking that
    the last scheduler's get_last_lr agrees each time."""
    seq = [[g["lr"] for g in opt.param_groups]]
    for _ in range(steps):
        opt.step()
        for s in schedulers:
            s.step()
        seq.append([g["lr"] for g in opt.param_groups])
        assert schedulers[-1].get_last_lr() == seq[-1]
    return seq
