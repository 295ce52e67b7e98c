"""The in-place random fills with generator=: torch's values for the same seed (uniform_,
normal_, random_ and nn.init's), torch's refusal on a leaf that requires grad, and one version
bump per fill."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal import core


def _pair(seed: int = 7):
    return core.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_uniform_and_normal_draw_torchs_values(dtype):
    g, gt = _pair()
    mine, theirs = core.zeros(40, dtype=getattr(core, dtype)), torch.zeros(40, dtype=getattr(torch, dtype))
    mine.uniform_(-2, 3, generator=g)
    theirs.uniform_(-2, 3, generator=gt)
    # the same 24/53 random bits scaled the same way: equal to float rounding
    np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-6)
    mine.normal_(1.0, 0.5, generator=g)
    theirs.normal_(1.0, 0.5, generator=gt)
    # torch's Box-Muller runs in double then rounds; numpy's cos/sin differ by ~1 ulp in double
    np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-6)


def test_random_draws_torchs_integers():
    g, gt = _pair(3)
    mine = core.zeros(12, dtype=core.int64).random_(0, 10, generator=g)
    theirs = torch.zeros(12, dtype=torch.int64).random_(0, 10, generator=gt)
    assert mine.tolist() == theirs.tolist()


def test_nn_init_takes_a_generator():
    g, gt = _pair(11)
    w, wt = core.zeros(4, 5), torch.zeros(4, 5)
    core.nn.init.uniform_(w, -1, 1, generator=g)
    torch.nn.init.uniform_(wt, -1, 1, generator=gt)
    np.testing.assert_allclose(w.numpy(), wt.numpy(), rtol=1e-6)


def test_a_fill_refuses_a_leaf_that_requires_grad_and_counts_a_version():
    w = core.zeros(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        w.normal_()
    with core.no_grad():
        before = w._version
        w.normal_()
    assert w._version == before + 1


def test_a_generator_of_the_wrong_type_is_torchs_type_error():
    with pytest.raises(TypeError, match="must be torch.Generator"):
        core.zeros(3).uniform_(generator=object())
