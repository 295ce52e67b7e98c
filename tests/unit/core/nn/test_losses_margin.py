"""multi_margin_loss, multilabel_margin_loss and multilabel_soft_margin_loss (and their modules)
against torch: values and the input's gradient in float64 for every reduction, p, margin and
weight, batched and unbatched; torch's errors; autocast keeping them in float32.

Bound: 1e-12 relative and absolute. Both sides sum the same few (at most C*C) hinge terms of
order 1 in double; only summation order differs, a few ulps (2e-16 each). A wrong mask, margin or
weight is off by order 0.1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as tf

from shoal import core
from shoal.core.nn import functional as F

_R = np.random.default_rng(0)
_N, _C = 4, 5
X = _R.standard_normal((_N, _C))
Y = _R.integers(0, _C, _N)
W = _R.random(_C) + 0.5
# rows of class lists ended by -1 (a duplicate, a full row, an empty row, one class)
LABELS = np.array([[3, 0, -1, 1, 2], [1, 1, 4, -1, 0], [0, 1, 2, 3, 4], [-1, 2, 3, 0, 0]])
MULTI_HOT = (_R.random((_N, _C)) > 0.5).astype(np.float64)


def _check(name: str, x: np.ndarray, target: np.ndarray, **kw) -> None:
    t_in = torch.tensor(x, requires_grad=True)
    c_in = core.tensor(x, requires_grad=True)
    t_kw = {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    c_kw = {k: core.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    expected = getattr(tf, name)(t_in, torch.tensor(target), **t_kw)
    got = getattr(F, name)(c_in, core.tensor(target), **c_kw)
    assert tuple(got.shape) == tuple(expected.shape)
    np.testing.assert_allclose(got.detach().numpy(), expected.detach().numpy(),
                               rtol=1e-12, atol=1e-12)
    g = _R.standard_normal(tuple(expected.shape))
    expected.backward(torch.tensor(g))
    got.backward(core.tensor(g))
    np.testing.assert_allclose(c_in.grad.numpy(), t_in.grad.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("p,margin,weight", [(1, 1.0, None), (2, 0.5, None), (1, 2.0, W),
                                             (2, 1.5, W)])
def test_multi_margin_loss(reduction, p, margin, weight) -> None:
    """Batched, and unbatched with a 0-d and a 1-element target (torch's output shapes)."""
    kw = {"p": p, "margin": margin, "weight": weight, "reduction": reduction}
    _check("multi_margin_loss", X, Y, **kw)
    _check("multi_margin_loss", X[0], np.array(Y[0]), **kw)
    _check("multi_margin_loss", X[0], Y[:1], **kw)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_multilabel_margin_loss(reduction) -> None:
    """Target rows end at the first -1; duplicates count twice, as in aten's loop."""
    _check("multilabel_margin_loss", X, LABELS, reduction=reduction)
    # rows with at most 3 classes each: core pairs only that many slots with every class
    _check("multilabel_margin_loss", X[[0, 1, 3]], LABELS[[0, 1, 3]], reduction=reduction)
    _check("multilabel_margin_loss", X[1], LABELS[1], reduction=reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weight", [None, W])
def test_multilabel_soft_margin_loss(reduction, weight) -> None:
    """Large logits too: log-sigmoid stays finite where a naive log(sigmoid) would not."""
    _check("multilabel_soft_margin_loss", X * 30, MULTI_HOT, weight=weight, reduction=reduction)
    _check("multilabel_soft_margin_loss", X[2], MULTI_HOT[2], weight=weight, reduction=reduction)


@pytest.mark.parametrize("call,exc,match", [
    (lambda m, x: m.multi_margin_loss(x(X), x(np.array([0, 1]))), RuntimeError,
     "target tensor should be 1-D"),
    (lambda m, x: m.multi_margin_loss(x(X), x(np.array([0, 1, 2, 9]))), RuntimeError,
     "target out of range"),
    (lambda m, x: m.multi_margin_loss(x(X), x(Y), p=3), ValueError, "only p == 1 and p == 2"),
    (lambda m, x: m.multi_margin_loss(x(X), x(Y), weight=x(W[:3])), RuntimeError,
     "inconsistent weight size"),
    (lambda m, x: m.multilabel_margin_loss(x(X), x(Y)), RuntimeError, "inconsistent target size"),
    (lambda m, x: m.multilabel_margin_loss(x(X), x(LABELS + 3)), RuntimeError, "out of range"),
    (lambda m, x: m.multilabel_soft_margin_loss(x(X), x(MULTI_HOT), reduction="avg"), ValueError,
     "avg is not valid"),
])
def test_errors_match_torch(call, exc, match) -> None:
    """torch's exception type and message for each bad argument."""
    with pytest.raises(exc, match=match):
        call(tf, torch.tensor)
    with pytest.raises(exc, match=match):
        call(F, core.tensor)


def test_modules_match_torch_and_keep_weight_in_state_dict() -> None:
    """The modules forward their settings; weights are buffers, so torch's state_dict loads."""
    pairs = [
        (torch.nn.MultiMarginLoss(p=2, margin=0.7, weight=torch.tensor(W), reduction="sum"),
         core.nn.MultiMarginLoss(p=2, margin=0.7, weight=core.tensor(W), reduction="sum"), Y),
        (torch.nn.MultiLabelMarginLoss(reduction="none"),
         core.nn.MultiLabelMarginLoss(reduction="none"), LABELS),
        (torch.nn.MultiLabelSoftMarginLoss(weight=torch.tensor(W)),
         core.nn.MultiLabelSoftMarginLoss(weight=core.tensor(W)), MULTI_HOT),
    ]
    for theirs, ours, target in pairs:
        assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
        ours.load_state_dict({k: core.tensor(v.numpy()) for k, v in theirs.state_dict().items()})
        np.testing.assert_allclose(ours(core.tensor(X), core.tensor(target)).numpy(),
                                   theirs(torch.tensor(X), torch.tensor(target)).numpy(),
                                   rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="only p == 1 and p == 2"):
        core.nn.MultiMarginLoss(p=3)


@pytest.mark.parametrize("name,target", [("multi_margin_loss", Y),
                                         ("multilabel_margin_loss", LABELS)])
def test_autocast_keeps_them_in_float32(name, target) -> None:
    """On autocast's float32 list, as torch's CPU policy: a bfloat16 input is computed in
    float32 and the loss is float32."""
    x = core.tensor(X.astype(np.float32)).to(core.bfloat16)
    with core.autocast("cpu", dtype=core.bfloat16):
        out = getattr(F, name)(x, core.tensor(target))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = getattr(tf, name)(torch.tensor(X, dtype=torch.float32).bfloat16(),
                                torch.tensor(target))
    assert out.dtype == core.float32 and ref.dtype == torch.float32
