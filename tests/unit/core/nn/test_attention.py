"""SDPA, MultiheadAttention and TransformerEncoder(Layer) against torch with copied weights."""

import numpy as np
import pytest

from shoal import core
from shoal.core import nn
from shoal.core.nn import functional as F
from tests.support.gradcheck import compare_with_torch, gradcheck

torch = pytest.importorskip("torch")


def _copy_from_torch(ours, ref):
    ours.load_state_dict({k: core.tensor(v.detach().numpy()) for k, v in ref.state_dict().items()})


@pytest.mark.parametrize("shape_q, shape_kv", [((2, 3, 5, 4), (2, 3, 6, 4)), ((4, 7, 8), (4, 7, 8))])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float", "causal"])
def test_sdpa_matches_torch(shape_q, shape_kv, mask_kind):
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal(shape_q), rng.standard_normal(shape_kv), rng.standard_normal(shape_kv)
    L, S = shape_q[-2], shape_kv[-2]
    arrays, kw = [q, k, v], {}
    if mask_kind == "bool":
        m = rng.random((L, S)) > 0.3
        m[:, 0] = True  # every query keeps at least one key
        kw["attn_mask"] = m
    elif mask_kind == "causal":
        kw["is_causal"] = True
    if mask_kind == "float":
        arrays.append(rng.standard_normal((L, S)))
        compare_with_torch(
            lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
            lambda q, k, v, m: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m),
            *arrays, atol=1e-10, rtol=1e-10)
        return
    tkw = dict(kw)
    if "attn_mask" in tkw:
        tkw["attn_mask"] = torch.tensor(tkw["attn_mask"])
    compare_with_torch(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw),
        lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, **tkw),
        *arrays, atol=1e-10, rtol=1e-10)


def test_sdpa_gradients_match_finite_differences():
    rng = np.random.default_rng(1)
    gradcheck(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.7),
              rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 4)),
              rng.standard_normal((2, 5, 3)), rng.standard_normal((3, 5)))


def test_sdpa_dropout_keeps_expectation_and_zeroes_some_weights():
    q = core.randn(1, 64, 8)
    v = core.ones(1, 64, 8)
    out = F.scaled_dot_product_attention(q, q, v, dropout_p=0.5)
    vals = out.numpy()[0, :, 0]
    assert not np.allclose(vals, 1.0) and abs(vals.mean() - 1.0) < 0.25
    with pytest.raises(ValueError, match="pass either attn_mask or is_causal, not both"):
        F.scaled_dot_product_attention(q, q, v, attn_mask=np.ones((64, 64), bool), is_causal=True)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_matches_torch(batch_first, need_weights):
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(8, 2, batch_first=batch_first).double()
    ours = nn.MultiheadAttention(8, 2, batch_first=batch_first).double()
    assert list(ours.state_dict()) == list(ref.state_dict())
    _copy_from_torch(ours, ref)
    rng = np.random.default_rng(2)
    n, L, S = 3, 5, 6
    shape = (lambda t: (n, t, 8)) if batch_first else (lambda t: (t, n, 8))
    x, kv = rng.standard_normal(shape(L)), rng.standard_normal(shape(S))
    pad = np.zeros((n, S), bool)
    pad[0, -2:] = True
    amask = np.triu(np.ones((L, S), bool), 2)
    xs, kvs = core.tensor(x, requires_grad=True), core.tensor(kv, requires_grad=True)
    xt, kvt = torch.tensor(x, requires_grad=True), torch.tensor(kv, requires_grad=True)
    os_, ws = ours(xs, kvs, kvs, key_padding_mask=pad, attn_mask=amask, need_weights=need_weights)
    ot, wt = ref(xt, kvt, kvt, key_padding_mask=torch.tensor(pad), attn_mask=torch.tensor(amask),
                 need_weights=need_weights)
    np.testing.assert_allclose(os_.detach().numpy(), ot.detach().numpy(), atol=1e-10)
    if need_weights:
        np.testing.assert_allclose(ws.detach().numpy(), wt.detach().numpy(), atol=1e-10)
    g = rng.standard_normal(os_.shape)
    (os_ * core.tensor(g)).sum().backward()
    (ot * torch.tensor(g)).sum().backward()
    np.testing.assert_allclose(xs.grad.numpy(), xt.grad.numpy(), atol=1e-10)
    np.testing.assert_allclose(kvs.grad.numpy(), kvt.grad.numpy(), atol=1e-10)
    for (name, p), (_, tp) in zip(ours.named_parameters(), ref.named_parameters()):
        np.testing.assert_allclose(p.grad.numpy(), tp.grad.numpy(), atol=1e-10, err_msg=name)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_transformer_encoder_matches_torch(norm_first, activation):
    torch.manual_seed(1)
    kw = dict(d_model=16, nhead=4, dim_feedforward=32, dropout=0.0, activation=activation,
              batch_first=True, norm_first=norm_first)
    ref = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(**kw), 2,
                                      norm=torch.nn.LayerNorm(16), enable_nested_tensor=False).double()
    ours = nn.TransformerEncoder(nn.TransformerEncoderLayer(**kw), 2, norm=nn.LayerNorm(16)).double()
    assert list(ours.state_dict()) == list(ref.state_dict())
    _copy_from_torch(ours, ref)
    x = np.random.default_rng(3).standard_normal((2, 7, 16))
    mask = torch.nn.Transformer.generate_square_subsequent_mask(7, dtype=torch.float64)
    xs, xt = core.tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
    ys = ours(xs, mask=mask.numpy(), is_causal=True)
    yt = ref(xt, mask=mask, is_causal=True)
    np.testing.assert_allclose(ys.detach().numpy(), yt.detach().numpy(), atol=1e-10)
    ys.pow(2).sum().backward(), yt.pow(2).sum().backward()
    np.testing.assert_allclose(xs.grad.numpy(), xt.grad.numpy(), atol=1e-9)
    for (name, p), (_, tp) in zip(ours.named_parameters(), ref.named_parameters()):
        np.testing.assert_allclose(p.grad.numpy(), tp.grad.numpy(), atol=1e-9, err_msg=name)


def test_encoder_layers_are_independent_copies_and_dropout_follows_mode():
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.5, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2)
    assert enc.layers[0].linear1.weight is not enc.layers[1].linear1.weight
    x = core.randn(2, 4, 8)
    enc.eval()
    np.testing.assert_array_equal(enc(x).detach().numpy(), enc(x).detach().numpy())
    enc.train()
    assert not np.allclose(enc(x).detach().numpy(), enc(x).detach().numpy())
    with pytest.raises(ValueError, match=r"embed_dim \(10\) must be divisible by num_heads \(3\)"):
        nn.MultiheadAttention(10, 3)
