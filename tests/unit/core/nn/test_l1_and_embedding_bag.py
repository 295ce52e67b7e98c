"""nn.L1Loss, nn.SmoothL1Loss and nn.EmbeddingBag against torch.nn: values, gradients, errors."""

from __future__ import annotations

import numpy as np
import pytest

from shoal import core
from shoal.core import nn
from shoal.core.nn import losses_functional as LF

torch = pytest.importorskip("torch")


def _pair(array):
    return (core.tensor(array.copy(), requires_grad=True),
            torch.tensor(array.copy(), requires_grad=True))


@pytest.mark.parametrize("name,kwargs", [
    ("L1Loss", dict()), ("L1Loss", dict(reduction="sum")), ("L1Loss", dict(reduction="none")),
    ("SmoothL1Loss", dict()), ("SmoothL1Loss", dict(beta=0.5, reduction="sum")),
    ("SmoothL1Loss", dict(beta=0.0)), ("SmoothL1Loss", dict(beta=2.0, reduction="none")),
])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_losses_match_torch_values_and_gradients(name, kwargs, dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 5)).astype(dtype)
    y = rng.standard_normal((4, 5)).astype(dtype)
    y[0, 0] = x[0, 0]  # a zero difference: torch's gradient there is 0
    xo, xt = _pair(x)
    yo, yt = _pair(y)
    out_o = getattr(nn, name)(**kwargs)(xo, yo)
    out_t = getattr(torch.nn, name)(**kwargs)(xt, yt)
    assert str(out_o.dtype).split(".")[-1] == str(out_t.dtype).split(".")[-1]
    # float32: one rounding per element plus a reduction of 20 terms; float64: exact-ish.
    rtol = 1e-6 if dtype == "float32" else 1e-13
    np.testing.assert_allclose(out_o.array, out_t.detach().numpy(), rtol=rtol, atol=rtol)
    w = rng.standard_normal(tuple(out_t.shape)).astype(dtype)
    (out_o * core.tensor(w)).sum().backward()
    (out_t * torch.tensor(w)).sum().backward()
    np.testing.assert_allclose(xo.grad.array, xt.grad.numpy(), rtol=rtol, atol=rtol)
    np.testing.assert_allclose(yo.grad.array, yt.grad.numpy(), rtol=rtol, atol=rtol)


def test_loss_errors_match_torch():
    with pytest.raises(RuntimeError, match="does not support negative values for beta"):
        torch.nn.functional.smooth_l1_loss(torch.zeros(2), torch.zeros(2), beta=-1.0)
    with pytest.raises(RuntimeError, match="does not support negative values for beta"):
        LF.smooth_l1_loss(core.zeros(2), core.zeros(2), beta=-1.0)
    with pytest.raises(ValueError, match="bad is not a valid value for reduction"):
        torch.nn.functional.l1_loss(torch.zeros(2), torch.zeros(2), reduction="bad")
    with pytest.raises(ValueError, match="bad is not a valid value for reduction"):
        LF.l1_loss(core.zeros(2), core.zeros(2), reduction="bad")


BAGS = [
    dict(mode="sum"), dict(mode="mean"), dict(mode="max"),
    dict(mode="sum", padding_idx=2), dict(mode="mean", padding_idx=0),
    dict(mode="max", include_last_offset=True), dict(mode="mean", include_last_offset=True),
]


@pytest.mark.parametrize("kwargs", BAGS)
@pytest.mark.parametrize("form", ["offsets", "2d"])
def test_embedding_bag_matches_torch(kwargs, form):
    rng = np.random.default_rng(1)
    theirs = torch.nn.EmbeddingBag(10, 4, **kwargs).double()
    ours = nn.EmbeddingBag(10, 4, **kwargs, dtype=core.float64)
    ours.load_state_dict({"weight": core.tensor(theirs.weight.detach().numpy().copy())})
    if form == "2d":
        if kwargs.get("include_last_offset"):
            pytest.skip("include_last_offset applies to 1-D input with offsets only")
        idx = rng.integers(0, 10, (3, 4))
        args_o, args_t = (core.tensor(idx),), (torch.tensor(idx),)
    else:
        idx = np.array([1, 2, 4, 5, 4, 3, 2, 9, 2, 2])
        # bags: [1 2 4], [5 4 3 2], [] (empty), [9 2 2]
        offsets = np.array([0, 3, 7, 7] + ([10] if kwargs.get("include_last_offset") else []))
        args_o = (core.tensor(idx), core.tensor(offsets))
        args_t = (torch.tensor(idx), torch.tensor(offsets))
    out_o, out_t = ours(*args_o), theirs(*args_t)
    np.testing.assert_allclose(out_o.array, out_t.detach().numpy(), rtol=1e-13, atol=1e-15)
    w = rng.standard_normal(tuple(out_t.shape))
    (out_o * core.tensor(w)).sum().backward()
    (out_t * torch.tensor(w)).sum().backward()
    np.testing.assert_allclose(ours.weight.grad.array, theirs.weight.grad.numpy(), rtol=1e-13,
                               atol=1e-15)


def test_embedding_bag_per_sample_weights_match_torch():
    rng = np.random.default_rng(2)
    theirs = torch.nn.EmbeddingBag(6, 3, mode="sum").double()
    ours = nn.EmbeddingBag(6, 3, mode="sum", dtype=core.float64)
    ours.load_state_dict({"weight": core.tensor(theirs.weight.detach().numpy().copy())})
    idx, offsets = np.array([0, 5, 5, 1, 3]), np.array([0, 2])
    psw = rng.standard_normal(5)
    po, pt = _pair(psw)
    out_o = ours(core.tensor(idx), core.tensor(offsets), per_sample_weights=po)
    out_t = theirs(torch.tensor(idx), torch.tensor(offsets), per_sample_weights=pt)
    np.testing.assert_allclose(out_o.array, out_t.detach().numpy(), rtol=1e-13)
    out_o.sum().backward()
    out_t.sum().backward()
    np.testing.assert_allclose(po.grad.array, pt.grad.numpy(), rtol=1e-13)
    np.testing.assert_allclose(ours.weight.grad.array, theirs.weight.grad.numpy(), rtol=1e-13)


def test_embedding_bag_errors_match_torch():
    t_bag, o_bag = torch.nn.EmbeddingBag(5, 2, mode="mean"), nn.EmbeddingBag(5, 2, mode="mean")
    with pytest.raises(NotImplementedError, match="only supported for mode='sum'"):
        t_bag(torch.tensor([0, 1]), torch.tensor([0]), per_sample_weights=torch.ones(2))
    with pytest.raises(NotImplementedError, match="only supported for mode='sum'"):
        o_bag(core.tensor([0, 1]), core.tensor([0]), per_sample_weights=core.ones(2))
    with pytest.raises(ValueError, match="offsets has to be None"):
        t_bag(torch.tensor([[0, 1]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="offsets has to be None"):
        o_bag(core.tensor([[0, 1]]), core.tensor([0]))
    assert nn.EmbeddingBag(5, 2).weight.shape == (5, 2)
