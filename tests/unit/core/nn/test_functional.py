"""core.nn.functional: gradients by finite differences, values and gradients against torch."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal import core
import shoal.core.nn.functional as F
from shoal.core.errors import ShapeError
from tests.support.gradcheck import compare_with_torch, fast_settings, gradcheck


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


@fast_settings()
@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    fin=st.integers(1, 4), fout=st.integers(1, 4), bias=st.booleans(), seed=st.integers(0, 99),
)
def test_linear_gradients(lead, fin, fout, bias, seed):
    x, w, b = _rand(*lead, fin, seed=seed), _rand(fout, fin, seed=seed + 1), _rand(fout, seed=seed + 2)
    if bias:
        gradcheck(lambda x, w, b: F.linear(x, w, b), x, w, b)
    else:
        gradcheck(lambda x, w: F.linear(x, w), x, w)


@fast_settings()
@given(rows=st.integers(1, 4), classes=st.integers(2, 5), seed=st.integers(0, 99),
       reduction=st.sampled_from(["mean", "sum", "none"]),
       smoothing=st.sampled_from([0.0, 0.2]), weighted=st.booleans(), ignore=st.booleans())
def test_cross_entropy_gradients(rows, classes, seed, reduction, smoothing, weighted, ignore):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, classes)) * 2
    t = rng.integers(0, classes, rows)
    if ignore and rows > 1:
        t[0] = -100
    w = rng.uniform(0.5, 2.0, classes) if weighted else None
    gradcheck(
        lambda x: F.cross_entropy(
            x, core.tensor(t), weight=None if w is None else core.tensor(w),
            reduction=reduction, label_smoothing=smoothing,
        ),
        x,
    )


def test_cross_entropy_probability_targets_and_spatial_gradients():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(4), size=3)
    gradcheck(lambda x: F.cross_entropy(x, core.tensor(probs)), _rand(3, 4))
    gradcheck(lambda x: F.cross_entropy(x, core.tensor(probs), label_smoothing=0.1), _rand(3, 4))
    t = rng.integers(0, 4, (2, 3))
    gradcheck(lambda x: F.cross_entropy(x, core.tensor(t), reduction="none"), _rand(2, 4, 3))
    gradcheck(lambda x: F.cross_entropy(x, core.tensor(2)), _rand(4))


@fast_settings()
@given(seed=st.integers(0, 99), reduction=st.sampled_from(["mean", "sum", "none"]))
def test_mse_layer_norm_embedding_softmax_gradients(seed, reduction):
    x, y = _rand(3, 4, seed=seed), _rand(3, 4, seed=seed + 1)
    gradcheck(lambda a, b: F.mse_loss(a, b, reduction=reduction), x, y)
    w, b = _rand(4, seed=seed + 2), _rand(4, seed=seed + 3)
    gradcheck(lambda a, w, b: F.layer_norm(a, (4,), w, b), x, w, b)
    gradcheck(lambda a: F.layer_norm(a, (3, 4)), x)
    table = _rand(5, 3, seed=seed + 4)
    idx = core.tensor(np.random.default_rng(seed).integers(0, 5, (2, 4)))
    gradcheck(lambda t: F.embedding(idx, t), table)
    gradcheck(lambda a: F.softmax(a, dim=0) * F.log_softmax(a, dim=1), x)
    gradcheck(lambda a: F.gelu(a) + F.relu(a + 0.05) + F.gelu(a, approximate="tanh"), x)


def test_dropout_gradient_uses_the_forward_mask():
    x = core.tensor(_rand(50, 40), requires_grad=True)
    out = F.dropout(x, p=0.3, training=True)
    out.sum().backward()
    kept = out.numpy(force=True) != 0
    np.testing.assert_allclose(x.grad.numpy()[kept], 1 / 0.7, rtol=1e-6)
    assert np.all(x.grad.numpy()[~kept] == 0)
    assert 0.2 < 1 - kept.mean() < 0.4
    np.testing.assert_allclose(out.numpy(force=True)[kept], x.numpy(force=True)[kept] / 0.7, rtol=1e-6)


def test_dropout_is_identity_in_eval_and_seeded_in_training():
    x = core.ones(100)
    assert F.dropout(x, 0.5, training=False) is x
    core.manual_seed(7)
    a = F.dropout(x, 0.5).numpy()
    core.manual_seed(7)
    b = F.dropout(x, 0.5).numpy()
    np.testing.assert_array_equal(a, b)
    assert F.dropout(x, 1.0).numpy().sum() == 0
    with pytest.raises(ValueError, match="dropout: probability must be in"):
        F.dropout(x, 1.5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_functional_matches_torch(dtype):
    torch = pytest.importorskip("torch")
    tf = torch.nn.functional
    rng = np.random.default_rng(2)
    tol = 2e-5 if dtype == np.float32 else 1e-11
    x = rng.standard_normal((6, 5)).astype(dtype)
    w = rng.standard_normal((3, 5)).astype(dtype)
    b = rng.standard_normal(3).astype(dtype)
    compare_with_torch(F.linear, tf.linear, x, w, b, atol=tol, rtol=tol)
    compare_with_torch(lambda a: F.linear(a, core.tensor(w)), lambda a: tf.linear(a, torch.tensor(w)), x,
                       atol=tol, rtol=tol)
    x3 = rng.standard_normal((2, 6, 5)).astype(dtype)
    compare_with_torch(F.linear, tf.linear, x3, w, b, atol=tol, rtol=tol)
    lw, lb = rng.standard_normal(5).astype(dtype), rng.standard_normal(5).astype(dtype)
    compare_with_torch(
        lambda a, w, b: F.layer_norm(a, (5,), w, b), lambda a, w, b: tf.layer_norm(a, (5,), w, b),
        x3, lw, lb, atol=tol * 10, rtol=tol * 10,
    )
    compare_with_torch(lambda a: F.layer_norm(a, (6, 5)), lambda a: tf.layer_norm(a, (6, 5)), x3,
                       atol=tol * 10, rtol=tol * 10)
    y = rng.standard_normal((6, 5)).astype(dtype)
    for red in ("mean", "sum", "none"):
        compare_with_torch(lambda a, c: F.mse_loss(a, c, reduction=red),
                           lambda a, c: tf.mse_loss(a, c, reduction=red), x, y, atol=tol, rtol=tol)
    table = rng.standard_normal((7, 4)).astype(dtype)
    idx = np.array([[0, 3, 3], [6, 0, 1]])
    compare_with_torch(
        lambda t: F.embedding(core.tensor(idx), t, padding_idx=3),
        lambda t: tf.embedding(torch.tensor(idx), t, padding_idx=3), table, atol=tol, rtol=tol,
    )
    for fn in ("relu", "gelu", "softmax", "log_softmax"):
        kw = {"dim": 1} if "softmax" in fn else {}
        compare_with_torch(lambda a: getattr(F, fn)(a, **kw), lambda a: getattr(tf, fn)(a, **kw), x,
                           atol=tol, rtol=tol)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.15])
def test_cross_entropy_matches_torch(reduction, smoothing):
    torch = pytest.importorskip("torch")
    tf = torch.nn.functional
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 5)) * 3
    t = rng.integers(0, 5, 8)
    t[[1, 4]] = -1
    w = rng.uniform(0.5, 2, 5)
    for kwargs in ({}, {"ignore_index": -1}, {"weight": w, "ignore_index": -1}):
        tt = t if "ignore_index" in kwargs else np.abs(t)
        cw = {k: core.tensor(v) if k == "weight" else v for k, v in kwargs.items()}
        tw = {k: torch.tensor(v) if k == "weight" else v for k, v in kwargs.items()}
        compare_with_torch(
            lambda a: F.cross_entropy(a, core.tensor(tt), reduction=reduction, label_smoothing=smoothing, **cw),
            lambda a: tf.cross_entropy(a, torch.tensor(tt), reduction=reduction, label_smoothing=smoothing, **tw),
            x, atol=1e-10, rtol=1e-10,
        )
    probs = rng.dirichlet(np.ones(5), size=8)
    compare_with_torch(
        lambda a: F.cross_entropy(a, core.tensor(probs), reduction=reduction, label_smoothing=smoothing),
        lambda a: tf.cross_entropy(a, torch.tensor(probs), reduction=reduction, label_smoothing=smoothing),
        x, atol=1e-10, rtol=1e-10,
    )
    x4 = rng.standard_normal((2, 5, 3, 2))
    t4 = rng.integers(0, 5, (2, 3, 2))
    compare_with_torch(
        lambda a: F.cross_entropy(a, core.tensor(t4), reduction=reduction, label_smoothing=smoothing),
        lambda a: tf.cross_entropy(a, torch.tensor(t4), reduction=reduction, label_smoothing=smoothing),
        x4, atol=1e-10, rtol=1e-10,
    )


def test_mlp_training_step_matches_torch():
    torch = pytest.importorskip("torch")
    tf = torch.nn.functional
    rng = np.random.default_rng(4)
    shapes = [(16, 8), (16,), (16, 16), (16,), (3, 16), (3,)]
    params = [(rng.standard_normal(s) / 4).astype(np.float32) for s in shapes]
    x = rng.standard_normal((10, 8)).astype(np.float32)
    y = rng.integers(0, 3, 10)
    cp = [core.tensor(p, requires_grad=True) for p in params]
    tp = [torch.tensor(p, requires_grad=True) for p in params]
    for _ in range(3):  # forward, backward, SGD step with momentum, three times
        h = F.gelu(F.linear(core.tensor(x), cp[0], cp[1]))
        h = F.relu(F.linear(h, cp[2], cp[3]))
        loss = F.cross_entropy(F.linear(h, cp[4], cp[5]), core.tensor(y))
        th = tf.gelu(tf.linear(torch.tensor(x), tp[0], tp[1]))
        th = tf.relu(tf.linear(th, tp[2], tp[3]))
        tloss = tf.cross_entropy(tf.linear(th, tp[4], tp[5]), torch.tensor(y))
        np.testing.assert_allclose(loss.item(), tloss.item(), rtol=1e-5)
        loss.backward()
        tloss.backward()
        with core.no_grad(), torch.no_grad():
            for c, t in zip(cp, tp):
                np.testing.assert_allclose(c.grad.numpy(), t.grad.numpy(), atol=1e-5, rtol=1e-4)
                c.add_(c.grad, alpha=-0.1)
                t.add_(t.grad, alpha=-0.1)
                c.grad = None
                t.grad = None
    for c, t in zip(cp, tp):
        np.testing.assert_allclose(c.detach().numpy(), t.detach().numpy(), atol=1e-5)


def test_functional_errors_name_shapes():
    with pytest.raises(ShapeError, match=r"linear: input of shape \(2, 3\) does not fit weight of shape \(4, 5\)"):
        F.linear(core.ones(2, 3), core.ones(4, 5))
    with pytest.raises(ShapeError, match=r"cross_entropy: target of shape \(3,\) does not match input of shape \(2, 4\)"):
        F.cross_entropy(core.ones(2, 4), core.tensor([0, 1, 2]))
    with pytest.raises(ShapeError, match=r"cross_entropy: target class out of range \[0, 4\)"):
        F.cross_entropy(core.ones(2, 4), core.tensor([0, 7]))
    with pytest.raises(ValueError, match="reduction must be one of"):
        F.mse_loss(core.ones(2), core.ones(2), reduction="avg")
    with pytest.raises(ShapeError, match=r"layer_norm: normalized_shape \(3,\) does not match"):
        F.layer_norm(core.ones(2, 4), (3,))
    with pytest.raises(ShapeError, match="embedding: index out of range for a table of 5 rows"):
        F.embedding(core.tensor([5]), core.ones(5, 2))
