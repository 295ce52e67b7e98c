"""core.utils.checkpoint against torch.utils.checkpoint: the same semantics case by case, and
the same values on the same weights."""

import warnings

import numpy as np
import pytest

from shoal import core
from shoal.core import nn
from shoal.core.utils.checkpoint import checkpoint, checkpoint_sequential

torch = pytest.importorskip("torch")
torch_ckpt = pytest.importorskip("torch.utils.checkpoint")


def _mlp():
    core.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def test_non_reentrant_output_requires_grad_from_parameters_alone_like_torch():
    lin = nn.Linear(3, 2)
    t_lin = torch.nn.Linear(3, 2)
    out = checkpoint(lin, core.randn(4, 3), use_reentrant=False)
    t_out = torch_ckpt.checkpoint(t_lin, torch.randn(4, 3), use_reentrant=False)
    assert out.requires_grad == t_out.requires_grad is True
    out.sum().backward()
    assert lin.weight.grad is not None


def test_reentrant_without_an_input_requiring_grad_warns_and_records_nothing_like_torch():
    lin = nn.Linear(3, 2)
    t_lin = torch.nn.Linear(3, 2)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        out = checkpoint(lin, core.randn(4, 3), use_reentrant=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t_out = torch_ckpt.checkpoint(t_lin, torch.randn(4, 3), use_reentrant=True)
    assert out.requires_grad == t_out.requires_grad is False


def test_reentrant_refuses_keyword_arguments_like_torch():
    with pytest.raises(ValueError, match="Unexpected keyword arguments: b") as ours:
        checkpoint(lambda a, b=1: a, core.randn(2), use_reentrant=True, b=2)
    with pytest.raises(ValueError) as theirs:
        torch_ckpt.checkpoint(lambda a, b=1: a, torch.randn(2), use_reentrant=True, b=2)
    assert str(ours.value) == str(theirs.value)


def test_non_reentrant_works_with_autograd_grad_and_matches_torch_values():
    w = np.random.default_rng(3).standard_normal((6, 6)).astype(np.float32)
    xv = np.random.default_rng(4).standard_normal((5, 6)).astype(np.float32)
    cw, cx = core.tensor(w, requires_grad=True), core.tensor(xv, requires_grad=True)
    tw, tx = torch.tensor(w, requires_grad=True), torch.tensor(xv, requires_grad=True)
    cy = checkpoint(lambda a, m: (a @ m).sigmoid() @ m, cx, m=cw)
    ty = torch_ckpt.checkpoint(lambda a, m: (a @ m).sigmoid() @ m, tx, m=tw,
                               use_reentrant=False)
    cg = core.autograd.grad((cy * cy).sum(), [cx, cw])
    tg = torch.autograd.grad((ty * ty).sum(), [tx, tw])
    assert cw.grad is None  # grad() returns gradients and leaves .grad alone, as torch
    for c, t in zip(cg, tg):
        # Sums of 6 float32 products twice over: each result is within a few ulps of the exact
        # value on any x86-64 CPU, whatever order either library sums in.
        np.testing.assert_allclose(c.array, t.numpy(), rtol=2e-5, atol=2e-6)


def test_checkpoint_sequential_matches_torch_values():
    net = _mlp()
    t_net = torch.nn.Sequential(*[
        torch.nn.Linear(m.in_features, m.out_features) if isinstance(m, nn.Linear)
        else torch.nn.Tanh() if isinstance(m, nn.Tanh) else torch.nn.ReLU()
        for m in net.children()])
    with torch.no_grad():
        for tp, p in zip(t_net.parameters(), net.parameters()):
            tp.copy_(torch.from_numpy(p.array.copy()))
    xv = np.random.default_rng(5).standard_normal((5, 8)).astype(np.float32)
    x, tx = core.tensor(xv, requires_grad=True), torch.tensor(xv, requires_grad=True)
    checkpoint_sequential(net, 3, x).pow(2).sum().backward()
    torch_ckpt.checkpoint_sequential(t_net, 3, tx, use_reentrant=False).pow(2).sum().backward()
    for p, tp in zip([*net.parameters(), x], [*t_net.parameters(), tx]):
        # Five float32 layers of width 16: relative error stays near 16 ulps per layer.
        np.testing.assert_allclose(p.grad.array, tp.grad.numpy(), rtol=1e-4, atol=1e-6)
