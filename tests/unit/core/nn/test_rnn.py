"""nn.RNN, LSTM, GRU and their cells against torch.nn: parameter names and shapes, init bounds,
outputs and gradients given torch's weights."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shoal import core
from shoal.core import nn

torch = pytest.importorskip("torch")

# float64 throughout; a step is a few GEMMs and pointwise ops whose order differs from torch's
# fused kernel by a few ulps, growing mildly over 5 steps and 2 layers: 1e-10 is ample.
RTOL, ATOL = 1e-10, 1e-12

CONFIGS = [
    ("RNN", dict()),
    ("RNN", dict(nonlinearity="relu", num_layers=2, bias=False)),
    ("RNN", dict(num_layers=2, bidirectional=True, batch_first=True)),
    ("LSTM", dict()),
    ("LSTM", dict(num_layers=2, bidirectional=True)),
    ("LSTM", dict(batch_first=True, proj_size=3)),
    ("LSTM", dict(num_layers=2, bias=False, proj_size=2, bidirectional=True)),
    ("GRU", dict()),
    ("GRU", dict(num_layers=3, bidirectional=True, batch_first=True)),
    ("GRU", dict(bias=False)),
]
IDS = [f"{name}-{i}" for i, (name, _) in enumerate(CONFIGS)]
INPUT, HIDDEN, BATCH, STEPS = 4, 5, 3, 5


def _pair(cls_name, kwargs, *args):
    torch.manual_seed(0)
    theirs = getattr(torch.nn, cls_name)(*args, **kwargs).double()
    ours = getattr(nn, cls_name)(*args, **kwargs, dtype=core.float64)
    ours.load_state_dict({k: core.tensor(v.detach().numpy().copy())
                          for k, v in theirs.state_dict().items()})
    return ours, theirs


def _inputs(shape, rng):
    x = rng.standard_normal(shape)
    return core.tensor(x.copy(), requires_grad=True), torch.tensor(x.copy(), requires_grad=True)


def _flat(out):
    if isinstance(out, tuple):
        return [t for item in out for t in _flat(item)]
    return [out]


def _check(ours_out, theirs_out, ours_leaves, theirs_leaves, rng):
    ours_flat, theirs_flat = _flat(ours_out), _flat(theirs_out)
    assert len(ours_flat) == len(theirs_flat)
    loss_o = loss_t = 0
    for a, b in zip(ours_flat, theirs_flat):
        assert tuple(a.shape) == tuple(b.shape)
        np.testing.assert_allclose(a.array, b.detach().numpy(), rtol=RTOL, atol=ATOL)
        w = rng.standard_normal(tuple(b.shape))
        loss_o = loss_o + (a * core.tensor(w)).sum()
        loss_t = loss_t + (b * torch.tensor(w)).sum()
    loss_o.backward()
    loss_t.backward()
    for a, b in zip(ours_leaves, theirs_leaves):
        np.testing.assert_allclose(a.grad.array, b.grad.numpy(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name,kwargs", CONFIGS, ids=IDS)
def test_parameter_names_shapes_and_init_bounds_match_torch(name, kwargs):
    theirs = getattr(torch.nn, name)(INPUT, HIDDEN, **kwargs)
    ours = getattr(nn, name)(INPUT, HIDDEN, **kwargs)
    mine = dict(ours.named_parameters())
    assert list(mine) == [k for k, _ in theirs.named_parameters()]
    bound = 1 / math.sqrt(HIDDEN)
    for key, value in theirs.named_parameters():
        assert tuple(mine[key].shape) == tuple(value.shape)
        assert np.abs(mine[key].array).max() <= bound
    assert mine[next(iter(mine))].dtype == core.float32


@pytest.mark.parametrize("name,kwargs", CONFIGS, ids=IDS)
def test_forward_and_gradients_match_torch_with_and_without_initial_state(name, kwargs):
    rng = np.random.default_rng(0)
    ours, theirs = _pair(name, kwargs, INPUT, HIDDEN)
    shape = (BATCH, STEPS, INPUT) if kwargs.get("batch_first") else (STEPS, BATCH, INPUT)
    xo, xt = _inputs(shape, rng)
    _check(ours(xo), theirs(xt), [xo, *ours.parameters()], [xt, *theirs.parameters()], rng)

    ours.zero_grad()
    theirs.zero_grad()
    layers = kwargs.get("num_layers", 1) * (2 if kwargs.get("bidirectional") else 1)
    h_size = kwargs.get("proj_size") or HIDDEN
    ho, ht = _inputs((layers, BATCH, h_size), rng)
    xo, xt = _inputs(shape, rng)
    if name == "LSTM":
        co, ct = _inputs((layers, BATCH, HIDDEN), rng)
        out_o, out_t = ours(xo, (ho, co)), theirs(xt, (ht, ct))
        leaves_o, leaves_t = [xo, ho, co], [xt, ht, ct]
    else:
        out_o, out_t = ours(xo, ho), theirs(xt, ht)
        leaves_o, leaves_t = [xo, ho], [xt, ht]
    _check(out_o, out_t, leaves_o + list(ours.parameters()),
           leaves_t + list(theirs.parameters()), rng)


@pytest.mark.parametrize("name", ["RNN", "LSTM", "GRU"])
def test_unbatched_input_matches_torch(name):
    rng = np.random.default_rng(1)
    ours, theirs = _pair(name, dict(num_layers=2), INPUT, HIDDEN)
    xo, xt = _inputs((STEPS, INPUT), rng)
    _check(ours(xo), theirs(xt), [xo], [xt], rng)


def test_dropout_between_layers_only_while_training():
    ours = nn.GRU(INPUT, HIDDEN, num_layers=2, dropout=0.5)
    x = core.tensor(np.random.default_rng(2).standard_normal((STEPS, BATCH, INPUT)))
    ours.eval()
    a, b = ours(x)[0], ours(x)[0]
    np.testing.assert_array_equal(a.array, b.array)
    ours.train()
    core.manual_seed(0)
    c = ours(x)[0]
    assert not np.allclose(c.array, a.array)


@pytest.mark.parametrize("name,kwargs", [
    ("RNNCell", dict()), ("RNNCell", dict(nonlinearity="relu", bias=False)),
    ("LSTMCell", dict()), ("LSTMCell", dict(bias=False)), ("GRUCell", dict()),
    ("GRUCell", dict(bias=False)),
])
@pytest.mark.parametrize("batched", [True, False])
def test_cells_match_torch(name, kwargs, batched):
    rng = np.random.default_rng(3)
    ours, theirs = _pair(name, kwargs, INPUT, HIDDEN)
    assert [k for k, _ in ours.named_parameters()] == [k for k, _ in theirs.named_parameters()]
    lead = (BATCH,) if batched else ()
    xo, xt = _inputs(lead + (INPUT,), rng)
    _check(ours(xo), theirs(xt), [xo], [xt], rng)
    ours.zero_grad()
    theirs.zero_grad()
    ho, ht = _inputs(lead + (HIDDEN,), rng)
    if name == "LSTMCell":
        co, ct = _inputs(lead + (HIDDEN,), rng)
        _check(ours(xo, (ho, co)), theirs(xt, (ht, ct)), [ho, co, *ours.parameters()],
               [ht, ct, *theirs.parameters()], rng)
    else:
        _check(ours(xo, ho), theirs(xt, ht), [ho, *ours.parameters()],
               [ht, *theirs.parameters()], rng)


@pytest.mark.parametrize("build,error,match", [
    (lambda m: m.RNN(3, 4, nonlinearity="sigmoid"), ValueError, "Unknown nonlinearity"),
    (lambda m: m.GRU(3, 4, dropout=1.5), ValueError, "dropout should be a number in range"),
    (lambda m: m.LSTM(3, 4, proj_size=4), ValueError, "proj_size has to be smaller"),
    (lambda m: m.LSTM(3, 0), ValueError, "hidden_size must be greater than zero"),
    (lambda m: m.LSTM(3, 4, num_layers=0), ValueError, "num_layers must be greater than zero"),
])
def test_bad_arguments_raise_torchs_errors(build, error, match):
    with pytest.raises(error, match=match):
        build(torch.nn)
    with pytest.raises(error, match=match):
        build(nn)


def test_wrong_input_size_is_refused():
    with pytest.raises(RuntimeError, match="input.size\\(-1\\) must be equal to input_size"):
        torch.nn.LSTM(3, 4)(torch.zeros(2, 1, 5))
    with pytest.raises(ValueError, match="input.size\\(-1\\) must be equal to input_size"):
        nn.LSTM(3, 4)(core.zeros(2, 1, 5))
