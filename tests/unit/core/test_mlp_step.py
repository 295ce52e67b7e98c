"""A whole MLP training step (forward, cross-entropy, backward, optimizer) in shoal and torch."""

from __future__ import annotations

import numpy as np
import pytest

from shoal import core
from shoal.core import nn
from shoal.core import optim
from shoal.core.nn import functional as F

torch = pytest.importorskip("torch")

OPTIMIZERS = {
    "sgd-momentum-nesterov": ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "adam": ("Adam", dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=1e-3)),
    "adamw": ("AdamW", dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
}


def _models():
    ours = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16), nn.GELU(),
                         nn.LayerNorm(16), nn.Linear(16, 5)).double()
    theirs = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(),
                                 torch.nn.Linear(32, 16), torch.nn.GELU(),
                                 torch.nn.LayerNorm(16), torch.nn.Linear(16, 5)).double()
    ours.load_state_dict({k: v.detach().numpy().copy() for k, v in theirs.state_dict().items()})
    return ours, theirs


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_three_training_steps_match_torch(name):
    cls, kwargs = OPTIMIZERS[name]
    ours, theirs = _models()
    ours_opt = getattr(optim, cls)(ours.parameters(), **kwargs)
    theirs_opt = getattr(torch.optim, cls)(theirs.parameters(), foreach=False, **kwargs)
    rng = np.random.default_rng(0)
    for step in range(3):
        x = rng.standard_normal((16, 12))
        y = rng.integers(0, 5, size=16)
        ours_opt.zero_grad()
        loss = F.cross_entropy(ours(core.tensor(x)), core.tensor(y))
        loss.backward()
        ours_opt.step()
        theirs_opt.zero_grad()
        tloss = torch.nn.functional.cross_entropy(theirs(torch.tensor(x)), torch.tensor(y))
        tloss.backward()
        theirs_opt.step()
        assert loss.item() == pytest.approx(tloss.item(), rel=1e-12), f"loss at step {step}"
    for (key, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        np.testing.assert_allclose(a.array, b.numpy(), rtol=1e-11, atol=1e-13, err_msg=key)
