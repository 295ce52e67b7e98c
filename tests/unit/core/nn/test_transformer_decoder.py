"""TransformerDecoderLayer, TransformerDecoder and Transformer against torch: the same
state_dict keys, torch's weights loaded, then outputs and the gradients of the inputs and of
every parameter in float64, with masks (causal, key padding), pre- and post-norm, batch_first
and both activations; torch's errors.

Bound 1e-9 relative and absolute: both sides run the same float64 graph (a few matmuls of
width 8, softmax, layer norm, up to five layers deep); summation order differs, each op adds
a few ulps (2e-16) and layer norm's division by a small spread can scale that by up to 1e3, so
1e-9 leaves a wide margin; a wrong residual, norm or mask is off by order 0.1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal import core

_R = np.random.default_rng(0)
_TOL = 1e-9
D, H, FF = 8, 2, 16


def _load(theirs: torch.nn.Module, ours: core.nn.Module) -> None:
    state = theirs.state_dict()
    assert sorted(ours.state_dict()) == sorted(state)
    ours.load_state_dict({k: core.tensor(v.detach().numpy().copy()) for k, v in state.items()})


def _compare(theirs: torch.nn.Module, ours: core.nn.Module, inputs: list, **kwargs) -> None:
    """inputs: float64 arrays that get gradients; kwargs: masks as numpy arrays."""
    t_in = [torch.tensor(a, requires_grad=True) for a in inputs]
    c_in = [core.tensor(a, requires_grad=True) for a in inputs]
    t_kw = {k: torch.tensor(v) for k, v in kwargs.items()}
    c_kw = {k: core.tensor(v) for k, v in kwargs.items()}
    expected, got = theirs(*t_in, **t_kw), ours(*c_in, **c_kw)
    np.testing.assert_allclose(got.detach().numpy(), expected.detach().numpy(),
                               rtol=_TOL, atol=_TOL)
    g = _R.standard_normal(tuple(expected.shape))
    expected.backward(torch.tensor(g))
    got.backward(core.tensor(g))
    for t, c in zip(t_in, c_in):
        np.testing.assert_allclose(c.grad.numpy(), t.grad.numpy(), rtol=_TOL, atol=_TOL)
    mine = dict(ours.named_parameters())
    for name, p in theirs.named_parameters():
        np.testing.assert_allclose(mine[name].grad.numpy(), p.grad.numpy(), rtol=_TOL,
                                   atol=_TOL, err_msg=name)


def _masks(tgt_len: int, src_len: int, batch: int) -> dict:
    causal = torch.nn.Transformer.generate_square_subsequent_mask(tgt_len).double().numpy()
    padding = np.zeros((batch, src_len), dtype=bool)
    padding[0, -1] = True  # the first sequence's last memory position is padding
    return {"tgt_mask": causal, "memory_key_padding_mask": padding}


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_decoder_layer_matches_torch(norm_first, batch_first, activation) -> None:
    """One layer, with a causal target mask and a memory padding mask."""
    kw = {"dim_feedforward": FF, "dropout": 0.0, "activation": activation,
          "batch_first": batch_first, "norm_first": norm_first}
    torch.manual_seed(0)
    theirs = torch.nn.TransformerDecoderLayer(D, H, **kw).double()
    ours = core.nn.TransformerDecoderLayer(D, H, **kw).double()
    _load(theirs, ours)
    tgt_shape, mem_shape = ((3, 5, D), (3, 4, D)) if batch_first else ((5, 3, D), (4, 3, D))
    _compare(theirs, ours, [_R.standard_normal(tgt_shape), _R.standard_normal(mem_shape)],
             **_masks(5, 4, 3))


def test_decoder_stack_with_final_norm_matches_torch() -> None:
    """Three deep copies and a final LayerNorm; unbatched input too."""
    torch.manual_seed(1)
    layer_t = torch.nn.TransformerDecoderLayer(D, H, FF, 0.0).double()
    theirs = torch.nn.TransformerDecoder(layer_t, 3, torch.nn.LayerNorm(D).double())
    ours = core.nn.TransformerDecoder(core.nn.TransformerDecoderLayer(D, H, FF, 0.0), 3,
                                      core.nn.LayerNorm(D)).double()
    _load(theirs, ours)
    _compare(theirs, ours, [_R.standard_normal((5, 2, D)), _R.standard_normal((4, 2, D))],
             **_masks(5, 4, 2))
    theirs.zero_grad()
    ours.zero_grad()
    _compare(theirs, ours, [_R.standard_normal((5, D)), _R.standard_normal((4, D))])


@pytest.mark.parametrize("batch_first", [False, True])
def test_transformer_matches_torch(batch_first) -> None:
    """Encoder and decoder stacks with their norms; every parameter's gradient."""
    kw = {"num_encoder_layers": 2, "num_decoder_layers": 2, "dim_feedforward": FF,
          "dropout": 0.0, "batch_first": batch_first}
    torch.manual_seed(2)
    theirs = torch.nn.Transformer(D, H, **kw).double()
    ours = core.nn.Transformer(D, H, **kw).double()
    _load(theirs, ours)
    src, tgt = ((2, 4, D), (2, 5, D)) if batch_first else ((4, 2, D), (5, 2, D))
    masks = _masks(5, 4, 2)
    masks["src_key_padding_mask"] = masks["memory_key_padding_mask"]
    _compare(theirs, ours, [_R.standard_normal(src), _R.standard_normal(tgt)], **masks)


def test_transformer_initialises_matrices_with_xavier_and_checks_shapes() -> None:
    """Matrices start Xavier-uniform (within +-sqrt(6 / (fan_in + fan_out))), as torch's
    _reset_parameters; torch's errors for mismatched batch or feature sizes; the causal mask."""
    model = core.nn.Transformer(D, H, 1, 1, FF, 0.0)
    w = model.decoder.layers[0].linear1.weight.detach().numpy()
    assert np.abs(w).max() <= np.sqrt(6 / (D + FF))
    with pytest.raises(RuntimeError, match="the batch number of src and tgt must be equal"):
        model(core.zeros(4, 2, D), core.zeros(5, 3, D))
    with pytest.raises(RuntimeError, match="feature number of src and tgt must be equal"):
        model(core.zeros(4, 2, D), core.zeros(5, 2, D + 1))
    np.testing.assert_array_equal(
        core.nn.Transformer.generate_square_subsequent_mask(4).numpy(),
        torch.nn.Transformer.generate_square_subsequent_mask(4).numpy())
    with pytest.raises(RuntimeError, match="activation should be relu/gelu, not tanh"):
        core.nn.TransformerDecoderLayer(D, H, activation="tanh")
