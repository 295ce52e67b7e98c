"""A float attn_mask that requires grad gets torch's gradient through MultiheadAttention (with
and without need_weights, key padding and added bias keys), as in torch's Transformer case of
PyTorch's nn tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal import core
from tests.support.gradcheck import load_torch_weights


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("mask_shape", [(5, 5), (6, 5, 5)])
@pytest.mark.filterwarnings("ignore:Support for mismatched")
def test_float_mask_gradient_matches_torch(need_weights, padded, mask_shape) -> None:
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True).double()
    ours = core.nn.MultiheadAttention(8, 2, add_bias_kv=True).double()
    load_torch_weights(ours, theirs)
    rng = np.random.default_rng(0)
    x, m = rng.standard_normal((5, 3, 8)), rng.standard_normal(mask_shape)
    pad = np.zeros((3, 5), bool)
    pad[1, 4] = True
    tx, tm = torch.tensor(x, requires_grad=True), torch.tensor(m, requires_grad=True)
    cx, cm = core.tensor(x).requires_grad_(True), core.tensor(m).requires_grad_(True)
    t_out, _ = theirs(tx, tx, tx, attn_mask=tm, need_weights=need_weights,
                      key_padding_mask=torch.tensor(pad) if padded else None)
    c_out, _ = ours(cx, cx, cx, attn_mask=cm, need_weights=need_weights,
                    key_padding_mask=core.tensor(pad) if padded else None)
    t_out.sum().backward()
    c_out.sum().backward()
    # float64 on both sides; softmax and matmul orders differ only in rounding (~1e-16 seen)
    np.testing.assert_allclose(c_out.detach().numpy(), t_out.detach().numpy(), atol=1e-12)
    np.testing.assert_allclose(cm.grad.numpy(), tm.grad.numpy(), atol=1e-12)
    np.testing.assert_allclose(cx.grad.numpy(), tx.grad.numpy(), atol=1e-12)


@pytest.mark.parametrize("mask_shape", [(4, 4), (3, 1, 4), (2, 3, 4, 4)])
def test_sdpa_mask_gradient_matches_torch_for_every_mask_shape(mask_shape) -> None:
    # a full-shape mask's gradient was the scores' gradient times 1/sqrt(d) (an in-place
    # scaling reached it through an alias); broadcast ones were right
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 4, 8)) for _ in range(3))
    m = rng.standard_normal(mask_shape)
    tm, cm = torch.tensor(m, requires_grad=True), core.tensor(m).requires_grad_(True)
    torch.nn.functional.scaled_dot_product_attention(
        *(torch.tensor(a) for a in (q, k, v)), attn_mask=tm).sum().backward()
    core.nn.functional.scaled_dot_product_attention(
        *(core.tensor(a) for a in (q, k, v)), attn_mask=cm).sum().backward()
    np.testing.assert_allclose(cm.grad.numpy(), tm.grad.numpy(), atol=1e-12)  # float64, ~3e-16
