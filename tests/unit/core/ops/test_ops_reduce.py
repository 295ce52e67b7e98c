"""Reductions and softmax: finite-difference gradients over dims/keepdim, torch parity."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shoal import core
from shoal.core.errors import ShapeError
from tests.support.gradcheck import compare_with_torch, fast_settings, gradcheck

shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4)


@st.composite
def shape_and_dims(draw):
    shape = draw(shapes)
    dims = draw(
        st.one_of(
            st.none(),
            st.integers(-len(shape), len(shape) - 1),
            st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=len(shape), unique=True).map(tuple),
        )
    )
    return shape, dims, draw(st.booleans()), draw(st.integers(0, 2**16))


def _distinct(shape, seed):
    # Distinct values (a random permutation) so max/min have no ties.
    n = int(np.prod(shape))
    return np.random.default_rng(seed).permutation(n).reshape(shape) * 0.37 - n * 0.1


@fast_settings()
@given(case=shape_and_dims())
def test_sum_and_mean_gradients(case):
    shape, dims, keepdim, seed = case
    x = np.random.default_rng(seed).standard_normal(shape)
    gradcheck(lambda t: t.sum(dims, keepdim=keepdim), x)
    gradcheck(lambda t: t.mean(dims, keepdim=keepdim), x)


@fast_settings()
@given(case=shape_and_dims())
def test_amax_amin_gradients(case):
    shape, dims, keepdim, seed = case
    x = _distinct(shape, seed)
    gradcheck(lambda t: t.amax(dims, keepdim=keepdim), x)
    gradcheck(lambda t: core.amin(t, dims, keepdim=keepdim), x)


@fast_settings()
@given(shape=shapes, data=st.data())
def test_max_min_over_a_dim_gradients_and_indices(shape, data):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    keepdim = data.draw(st.booleans())
    x = _distinct(shape, data.draw(st.integers(0, 1000)))
    gradcheck(lambda t: t.max(dim, keepdim=keepdim).values, x)
    gradcheck(lambda t: t.min(dim, keepdim=keepdim).values, x)
    values, indices = core.tensor(x).max(dim, keepdim=keepdim)
    np.testing.assert_array_equal(indices.numpy(), x.argmax(axis=dim, keepdims=keepdim))
    np.testing.assert_array_equal(values.numpy(), x.max(axis=dim, keepdims=keepdim))
    gradcheck(lambda t: t.max(), x)


@fast_settings()
@given(shape=shapes, data=st.data())
def test_softmax_log_softmax_logsumexp_gradients(shape, data):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = np.random.default_rng(data.draw(st.integers(0, 1000))).standard_normal(shape) * 3
    gradcheck(lambda t: t.softmax(dim), x)
    gradcheck(lambda t: t.log_softmax(dim), x)
    gradcheck(lambda t: t.logsumexp(dim), x)


def test_full_max_splits_gradient_between_ties_like_torch():
    torch = pytest.importorskip("torch")
    x = np.array([[1.0, 3.0], [3.0, 0.0]])
    compare_with_torch(lambda t: t.max(), lambda t: t.max(), x)
    compare_with_torch(lambda t: t.amax(1), lambda t: t.amax(1), x)
    del torch


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reductions_match_torch(dtype):
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(5).standard_normal((3, 4, 5)).astype(dtype) * 4
    tol = 1e-5 if dtype == np.float32 else 1e-12
    cases = [
        (lambda t: t.sum(), lambda t: t.sum()),
        (lambda t: t.sum((0, 2), keepdim=True), lambda t: t.sum((0, 2), keepdim=True)),
        (lambda t: t.mean(1), lambda t: t.mean(1)),
        (lambda t: t.max(2).values, lambda t: t.max(2).values),
        (lambda t: t.min(0, keepdim=True).values, lambda t: t.min(0, keepdim=True).values),
        (lambda t: t.softmax(1), lambda t: t.softmax(1)),
        (lambda t: t.log_softmax(-1), lambda t: t.log_softmax(-1)),
        (lambda t: t.logsumexp(0), lambda t: t.logsumexp(0)),
        (lambda t: t.var(1), lambda t: t.var(1)),
    ]
    for cfn, tfn in cases:
        compare_with_torch(cfn, tfn, x, atol=tol, rtol=tol)
    np.testing.assert_array_equal(
        core.tensor(x).argmax(1).numpy(), torch.tensor(x).argmax(1).numpy()
    )


def test_softmax_is_stable_for_huge_logits():
    x = core.tensor([[1000.0, 0.0, -1000.0]])
    np.testing.assert_allclose(x.softmax(-1).numpy(), [[1.0, 0.0, 0.0]])
    np.testing.assert_allclose(x.log_softmax(-1).numpy(), [[0.0, -1000.0, -2000.0]])


def test_full_reductions_return_0d_tensors():
    x = core.ones(2, 3, requires_grad=True)
    for out in (x.sum(), x.mean(), x.max(), x.amax()):
        assert out.shape == () and out.ndim == 0
    x.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.ones((2, 3)))


def test_bad_dim_names_the_op():
    with pytest.raises(ShapeError, match="sum: dimension 3 is out of range for a tensor of 2"):
        core.ones(2, 3).sum(3)
    with pytest.raises(ShapeError, match="softmax: dimension -3"):
        core.ones(2, 3).softmax(-3)
