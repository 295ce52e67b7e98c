"""The names torch tutorials use right after distributed set-up, with torch as the oracle:
loss modules, one_hot, truth tests (all/any/equal/allclose/nonzero), t(), int8/uint8."""

import numpy as np
import pytest

from shoal import core
import shoal.core.nn.functional as F
from shoal.core.errors import ShapeError
from tests.support.gradcheck import compare_with_torch, gradcheck

torch = pytest.importorskip("torch")
tnn = torch.nn


def _module_pair(name, **kwargs):
    """The same loss module in shoal and torch (weights as tensors of each)."""
    w = {k: np.asarray(v, dtype=np.float64) if k == "weight" else v for k, v in kwargs.items()}
    ck = {k: core.tensor(v) if k == "weight" else v for k, v in w.items()}
    tk = {k: torch.tensor(v) if k == "weight" else v for k, v in w.items()}
    return getattr(core.nn, name)(**ck), getattr(tnn, name)(**tk)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_loss_module_matches_torch(reduction):
    rng = np.random.default_rng(0)
    ours, theirs = _module_pair("MSELoss", reduction=reduction)
    x, y = rng.standard_normal((4, 3)), rng.standard_normal((4, 3))
    compare_with_torch(ours, theirs, x, y, atol=1e-12, rtol=1e-12)
    compare_with_torch(ours, theirs, x.astype(np.float32), y.astype(np.float32),
                       atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"ignore_index": 1}, {"weight": [0.5, 2.0, 1.0, 3.0, 0.1]},
     {"weight": [0.5, 2.0, 1.0, 3.0, 0.1], "ignore_index": 4, "label_smoothing": 0.2},
     {"label_smoothing": 0.1}],
)
def test_cross_entropy_loss_module_matches_torch(reduction, kwargs):
    rng = np.random.default_rng(1)
    ours, theirs = _module_pair("CrossEntropyLoss", reduction=reduction, **kwargs)
    x = rng.standard_normal((7, 5)) * 2
    t = np.array([0, 1, 4, 2, 1, 3, 4])
    compare_with_torch(lambda a: ours(a, core.tensor(t)), lambda a: theirs(a, torch.tensor(t)), x,
                       atol=1e-12, rtol=1e-12)
    # (N, C, d) logits, a single unbatched (C,) row, and probability targets.
    x3, t3 = rng.standard_normal((2, 5, 3)), rng.integers(0, 5, (2, 3))
    compare_with_torch(lambda a: ours(a, core.tensor(t3)), lambda a: theirs(a, torch.tensor(t3)),
                       x3, atol=1e-12, rtol=1e-12)
    compare_with_torch(lambda a: ours(a, core.tensor(3)), lambda a: theirs(a, torch.tensor(3)),
                       x[0], atol=1e-12, rtol=1e-12)
    if "ignore_index" not in kwargs:
        probs = rng.dirichlet(np.ones(5), size=7)
        compare_with_torch(lambda a: ours(a, core.tensor(probs)),
                           lambda a: theirs(a, torch.tensor(probs)), x, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("kwargs", [{}, {"ignore_index": 2}, {"weight": [0.3, 1.0, 2.5, 0.7]},
                                    {"weight": [0.3, 1.0, 2.5, 0.7], "ignore_index": 0}])
def test_nll_loss_module_matches_torch(reduction, kwargs):
    rng = np.random.default_rng(2)
    ours, theirs = _module_pair("NLLLoss", reduction=reduction, **kwargs)
    logp = np.log(rng.dirichlet(np.ones(4), size=6))
    t = np.array([0, 2, 3, 1, 2, 0])
    compare_with_torch(lambda a: ours(a, core.tensor(t)), lambda a: theirs(a, torch.tensor(t)),
                       logp, atol=1e-12, rtol=1e-12)
    x4, t4 = rng.standard_normal((2, 4, 3, 2)), rng.integers(0, 4, (2, 3, 2))
    compare_with_torch(lambda a: ours(a, core.tensor(t4)), lambda a: theirs(a, torch.tensor(t4)),
                       x4, atol=1e-12, rtol=1e-12)
    compare_with_torch(lambda a: ours(a, core.tensor(1)), lambda a: theirs(a, torch.tensor(1)),
                       logp[0], atol=1e-12, rtol=1e-12)


def test_nll_loss_gradients_by_finite_differences_and_all_ignored_is_nan():
    rng = np.random.default_rng(3)
    t = core.tensor([1, -100, 2])
    w = core.tensor([1.0, 0.5, 2.0])
    gradcheck(lambda x: F.nll_loss(x, t, weight=w), rng.standard_normal((3, 3)))
    gradcheck(lambda x: F.nll_loss(x, t, reduction="none"), rng.standard_normal((3, 3)))
    ignored = core.tensor([-100, -100])
    ours = F.nll_loss(core.zeros(2, 3), ignored).item()
    theirs = torch.nn.functional.nll_loss(torch.zeros(2, 3), torch.tensor([-100, -100])).item()
    assert np.isnan(ours) and np.isnan(theirs)


def test_cross_entropy_equals_log_softmax_then_nll_loss():
    x = core.randn(5, 4, dtype=core.float64)
    t = core.tensor([0, 3, 1, 1, 2])
    a = core.nn.CrossEntropyLoss()(x, t)
    b = core.nn.NLLLoss()(F.log_softmax(x, dim=1), t)
    assert abs(a.item() - b.item()) < 1e-12


def test_loss_modules_refuse_bad_arguments_and_keep_weight_as_buffer():
    with pytest.raises(ValueError, match=r"MSELoss: reduction must be one of \('mean', 'sum', "
                                         r"'none'\), got 'avg'\."):
        core.nn.MSELoss(reduction="avg")
    with pytest.raises(ValueError, match=r"CrossEntropyLoss: label_smoothing must be in \[0, 1\], "
                                         r"got 1.5\."):
        core.nn.CrossEntropyLoss(label_smoothing=1.5)
    loss = core.nn.NLLLoss(weight=core.ones(3))
    assert list(loss.state_dict()) == list(tnn.NLLLoss(weight=torch.ones(3)).state_dict())
    with pytest.raises(ShapeError, match=r"nll_loss: target class out of range \[0, 3\) "
                                         r"\(targets span 0\.\.3\)\."):
        loss(core.zeros(2, 3), core.tensor([0, 3]))
    with pytest.raises(ShapeError, match=r"nll_loss: target of shape \(3,\) does not match input "
                                         r"of shape \(2, 3\); expected target shape \(2,\)\."):
        loss(core.zeros(2, 3), core.tensor([0, 1, 2]))


def test_loss_module_trains_with_backward():
    model = core.nn.Linear(3, 2)
    loss = core.nn.CrossEntropyLoss()(model(core.randn(4, 3)), core.tensor([0, 1, 1, 0]))
    loss.backward()
    assert model.weight.grad is not None and model.weight.grad.shape == (2, 3)


def test_one_hot_matches_torch():
    for values, n in (([0, 2, 1], -1), ([[1, 0], [3, 3]], 5), ([], 3), (2, 4)):
        ours = F.one_hot(core.tensor(values, dtype=core.int64), n)
        theirs = torch.nn.functional.one_hot(torch.tensor(values, dtype=torch.long), n)
        assert ours.dtype == core.int64
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    with pytest.raises(ShapeError, match=r"one_hot: class values must be non-negative, got -1\."):
        F.one_hot(core.tensor([-1, 2]), 3)
    with pytest.raises(ShapeError, match=r"one_hot: class values must be smaller than "
                                         r"num_classes=3, got 3\."):
        F.one_hot(core.tensor([3]), 3)
    with pytest.raises(ShapeError, match=r"one_hot: only integer \(class index\) tensors apply, "
                                         r"got dtype float32\."):
        F.one_hot(core.tensor([1.0]), 3)
    with pytest.raises(ShapeError, match="one_hot: cannot infer the number of classes from an "
                                         "empty tensor; pass num_classes."):
        F.one_hot(core.tensor([], dtype=core.int64))


_TRUTH_CASES = [
    np.array([[0.0, 1.5], [2.0, 0.0]]),
    np.array([[1, 2], [3, 4]], dtype=np.int64),
    np.array([1, 0, 3], dtype=np.uint8),
    np.array([True, True]),
    np.array(0.0),
    np.array(2.0),
    np.zeros((0, 3)),
]


@pytest.mark.parametrize("arr", _TRUTH_CASES, ids=lambda a: f"{a.dtype}{a.shape}")
def test_all_any_nonzero_match_torch(arr):
    c, t = core.tensor(arr), torch.tensor(arr)
    for name in ("all", "any"):
        ours, theirs = getattr(c, name)(), getattr(t, name)()
        assert str(ours.dtype).split(".")[1] == str(theirs.dtype).split(".")[1], name
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
        assert getattr(core, name)(c).item() == getattr(torch, name)(t).item()
        for dim in range(-arr.ndim, arr.ndim):
            for keepdim in (False, True):
                ours = getattr(c, name)(dim=dim, keepdim=keepdim)
                theirs = getattr(t, name)(dim=dim, keepdim=keepdim)
                assert ours.shape == tuple(theirs.shape)
                np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    ours, theirs = c.nonzero(), t.nonzero()
    assert ours.dtype == core.int64 and ours.shape == tuple(theirs.shape)
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    for o, th in zip(core.nonzero(c, as_tuple=True), t.nonzero(as_tuple=True), strict=True):
        np.testing.assert_array_equal(o.numpy(), th.numpy())


def test_equal_and_allclose_match_torch():
    pairs = [
        ([1.0, 2.0], [1.0, 2.0]),
        ([1.0, 2.0], [1.0, 2.0000001]),
        ([1.0, 2.0], [1.0, 2.001]),
        ([1.0, float("nan")], [1.0, float("nan")]),
        ([1.0, 2.0], [1.0]),
        ([[1.0, 2.0]], [1.0, 2.0]),
    ]
    for a, b in pairs:
        ca, cb = core.tensor(a, dtype=core.float64), core.tensor(b, dtype=core.float64)
        ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
        assert core.equal(ca, cb) == torch.equal(ta, tb) == ca.equal(cb), (a, b)
        for kw in ({}, {"rtol": 1e-2}, {"atol": 0.01, "rtol": 0}, {"equal_nan": True}):
            assert core.allclose(ca, cb, **kw) == torch.allclose(ta, tb, **kw), (a, b, kw)
            assert ca.allclose(cb, **kw) == torch.allclose(ta, tb, **kw)
            np.testing.assert_array_equal(core.isclose(ca, cb, **kw).numpy(),
                                          torch.isclose(ta, tb, **kw).numpy())
    # torch.equal compares values across dtypes (after promotion); allclose refuses them.
    assert core.equal(core.tensor([1, 2]), core.tensor([1.0, 2.0])) == torch.equal(
        torch.tensor([1, 2]), torch.tensor([1.0, 2.0]))
    with pytest.raises(core.DTypeError, match=r"allclose: both tensors must have the same dtype, "
                                              r"got core.float32 and core.float64\."):
        core.allclose(core.ones(2), core.ones(2, dtype=core.float64))
    with pytest.raises(ShapeError, match=r"isclose: cannot broadcast shapes \(2,\) and \(3,\)\."):
        core.allclose(core.ones(2), core.ones(3))


def test_t_matches_torch_and_carries_gradients():
    for shape in ((), (3,), (2, 3)):
        a = np.arange(float(np.prod(shape))).reshape(shape)
        compare_with_torch(lambda x: x.t(), lambda x: x.t(), a, atol=0, rtol=0)
    with pytest.raises(ShapeError, match=r"t: expects a tensor with <= 2 dimensions, got 3 "
                                         r"\(shape \(2, 2, 2\)\)"):
        core.ones(2, 2, 2).t()


def test_int8_and_uint8_match_torch():
    assert core.int8 is core.dtypes.get("int8") and core.uint8 is core.dtypes.get("torch.uint8")
    a = core.tensor([200, 100, 7], dtype=core.uint8)
    b = core.tensor([-3, 5, 100], dtype=core.int8)
    ta = torch.tensor([200, 100, 7], dtype=torch.uint8)
    tb = torch.tensor([-3, 5, 100], dtype=torch.int8)
    for ours, theirs in ((a + a, ta + ta), (a + b, ta + tb), (b * 2, tb * 2), (a.sum(), ta.sum()),
                         (a.to(core.int8), ta.to(torch.int8)), (a.float(), ta.float())):
        assert str(ours.dtype).split(".")[1] == str(theirs.dtype).split(".")[1]
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    assert core.zeros(2, dtype=core.int8).dtype == core.int8
    assert core.ones(2, dtype="uint8").numpy().dtype == np.uint8
