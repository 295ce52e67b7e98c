"""MultiheadAttention's add_bias_kv and add_zero_attn against torch.nn.MultiheadAttention."""

from __future__ import annotations

import numpy as np
import pytest

from shoal import core
from shoal.core import nn

torch = pytest.importorskip("torch")

E, H, L, S, N = 8, 2, 3, 4, 2


def _pair(**kwargs):
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(E, H, **kwargs).double()
    ours = nn.MultiheadAttention(E, H, **kwargs, dtype=core.float64)
    ours.load_state_dict({k: core.tensor(v.detach().numpy().copy())
                          for k, v in theirs.state_dict().items()})
    return ours, theirs


@pytest.mark.parametrize("kwargs", [
    dict(add_bias_kv=True), dict(add_zero_attn=True), dict(add_bias_kv=True, add_zero_attn=True),
    dict(add_bias_kv=True, add_zero_attn=True, batch_first=True),
])
@pytest.mark.parametrize("masks", ["none", "attn", "padding", "both"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_outputs_weights_and_gradients_match_torch(kwargs, masks, need_weights):
    rng = np.random.default_rng(0)
    ours, theirs = _pair(**kwargs)
    assert [k for k, _ in ours.named_parameters()] == [k for k, _ in theirs.named_parameters()]
    first = (N, L) if kwargs.get("batch_first") else (L, N)
    source = (N, S) if kwargs.get("batch_first") else (S, N)
    arrays = [rng.standard_normal(first + (E,)), rng.standard_normal(source + (E,)),
              rng.standard_normal(source + (E,))]
    ins_o = [core.tensor(a.copy(), requires_grad=True) for a in arrays]
    ins_t = [torch.tensor(a.copy(), requires_grad=True) for a in arrays]
    attn = np.triu(np.ones((L, S), dtype=bool), 2) if masks in ("attn", "both") else None
    pad = np.zeros((N, S), dtype=bool)
    pad[1, -1] = True
    pad = pad if masks in ("padding", "both") else None
    out_o, w_o = ours(*ins_o, attn_mask=None if attn is None else core.tensor(attn),
                      key_padding_mask=None if pad is None else core.tensor(pad),
                      need_weights=need_weights)
    out_t, w_t = theirs(*ins_t, attn_mask=None if attn is None else torch.tensor(attn),
                        key_padding_mask=None if pad is None else torch.tensor(pad),
                        need_weights=need_weights)
    # float64; softmax and a few GEMMs in another order than torch's kernel: 1e-10 is ample.
    np.testing.assert_allclose(out_o.array, out_t.detach().numpy(), rtol=1e-10, atol=1e-12)
    if need_weights:
        np.testing.assert_allclose(w_o.array, w_t.detach().numpy(), rtol=1e-10, atol=1e-12)
    g = rng.standard_normal(tuple(out_t.shape))
    (out_o * core.tensor(g)).sum().backward()
    (out_t * torch.tensor(g)).sum().backward()
    for a, b in zip(ins_o + list(ours.parameters()), ins_t + list(theirs.parameters())):
        np.testing.assert_allclose(a.grad.array, b.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_bias_kv_parameters_have_torchs_shape_and_init_scale():
    ours = nn.MultiheadAttention(E, H, add_bias_kv=True)
    assert tuple(ours.bias_k.shape) == (1, 1, E) and tuple(ours.bias_v.shape) == (1, 1, E)
    assert nn.MultiheadAttention(E, H).bias_k is None
