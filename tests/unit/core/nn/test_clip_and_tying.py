"""nn.utils.clip_grad_norm_/clip_grad_value_ and weight tying (one Parameter in two modules) vs torch."""

import numpy as np
import pytest

from shoal import core
from shoal.core import nn

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), 3.0])
@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_grad_norm_matches_torch(norm_type, max_norm):
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(s) for s in [(3, 4), (5,), (2, 2, 2)]]
    ours = [core.tensor(np.zeros_like(g), requires_grad=True) for g in grads]
    theirs = [torch.zeros(g.shape, dtype=torch.float64, requires_grad=True) for g in grads]
    for p, tp, g in zip(ours, theirs, grads):
        p.grad, tp.grad = core.tensor(g.copy()), torch.tensor(g.copy())
    total = nn.utils.clip_grad_norm_(ours, max_norm, norm_type)
    ttotal = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert float(total) == pytest.approx(float(ttotal), rel=1e-12)
    for p, tp in zip(ours, theirs):
        np.testing.assert_allclose(p.grad.numpy(), tp.grad.numpy(), rtol=1e-12)


def test_clip_grad_value_and_nonfinite():
    p = core.tensor(np.zeros(4), requires_grad=True)
    p.grad = core.tensor(np.array([-3.0, 0.5, 2.0, -0.1]))
    nn.utils.clip_grad_value_([p], 1.0)
    np.testing.assert_array_equal(p.grad.numpy(), [-1.0, 0.5, 1.0, -0.1])
    p.grad = core.tensor(np.array([np.inf, 1.0, 0.0, 0.0]))
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        nn.utils.clip_grad_norm_(p, 1.0, error_if_nonfinite=True)


class Tied(nn.Module):
    def __init__(self, lib):
        super().__init__()
        self.emb = lib.Embedding(11, 6)
        self.head = lib.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.emb(idx).tanh())


class TorchTied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.emb(idx).tanh())


def test_weight_tying_shares_one_parameter_and_its_gradient_like_torch():
    ours, ref = Tied(nn).double(), TorchTied().double()
    assert list(ours.state_dict()) == list(ref.state_dict()) == ["emb.weight", "head.weight"]
    assert len(list(ours.parameters())) == len(list(ref.parameters())) == 1
    ours.load_state_dict({k: core.tensor(v.numpy()) for k, v in ref.state_dict().items()})
    idx = np.array([[1, 4, 7], [10, 0, 4]])
    targets = np.array([[2, 3, 1], [0, 9, 9]])
    out = ours(core.tensor(idx))
    loss = nn.functional.cross_entropy(out.reshape(-1, 11), core.tensor(targets.reshape(-1)))
    tout = ref(torch.tensor(idx))
    tloss = torch.nn.functional.cross_entropy(tout.reshape(-1, 11), torch.tensor(targets.reshape(-1)))
    loss.backward(), tloss.backward()
    assert loss.item() == pytest.approx(tloss.item(), rel=1e-12)
    np.testing.assert_allclose(ours.emb.weight.grad.numpy(), ref.emb.weight.grad.numpy(), atol=1e-12)
    opt = core.optim.AdamW(ours.parameters(), lr=0.1)
    opt.step()
    assert ours.head.weight is ours.emb.weight
