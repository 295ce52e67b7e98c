"""matmul: every 1-D/2-D/batched combination against finite differences and torch."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shoal import core
from shoal.core.errors import ShapeError
from tests.support.gradcheck import compare_with_torch, fast_settings, gradcheck


@st.composite
def matmul_shapes(draw):
    n, k, m = (draw(st.integers(1, 3)) for _ in range(3))
    batch = draw(hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=2, max_side=3))
    ba, bb = batch.input_shapes
    kind_a = draw(st.sampled_from(["vec", "mat", "batch"]))
    kind_b = draw(st.sampled_from(["vec", "mat", "batch"]))
    a = {"vec": (k,), "mat": (n, k), "batch": ba + (n, k)}[kind_a]
    b = {"vec": (k,), "mat": (k, m), "batch": bb + (k, m)}[kind_b]
    return a, b, draw(st.integers(0, 1000))


@fast_settings()
@given(case=matmul_shapes())
def test_matmul_gradients_all_rank_combinations(case):
    sa, sb, seed = case
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal(sa), rng.standard_normal(sb)
    gradcheck(lambda x, y: x @ y, a, b)


@pytest.mark.parametrize(
    "sa,sb",
    [((3,), (3,)), ((3,), (3, 4)), ((2, 3), (3,)), ((2, 3), (3, 4)), ((5, 2, 3), (3, 4)),
     ((3,), (5, 3, 4)), ((5, 1, 2, 3), (4, 3, 2)), ((2, 3), (6, 3, 4))],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_matches_torch(sa, sb, dtype):
    pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(sa).astype(dtype), rng.standard_normal(sb).astype(dtype)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    compare_with_torch(lambda x, y: x @ y, lambda x, y: x @ y, a, b, atol=tol, rtol=tol)
    compare_with_torch(core.matmul, lambda x, y: x.matmul(y), a, b, atol=tol, rtol=tol)


def test_matmul_with_arrays_and_reflected():
    w = core.ones(3, 2, requires_grad=True)
    out = np.ones((4, 3), dtype=np.float32) @ w
    assert isinstance(out, core.Tensor) and out.shape == (4, 2)
    out.sum().backward()
    np.testing.assert_array_equal(w.grad.numpy(), np.full((3, 2), 4.0))


def test_matmul_shape_error_names_both_shapes():
    with pytest.raises(ShapeError, match=r"matmul: cannot multiply shapes \(3, 4\) and \(5, 6\)"):
        core.ones(3, 4) @ core.ones(5, 6)
    with pytest.raises(ShapeError, match=r"matmul: both operands need at least one dimension"):
        core.ones(3) @ core.tensor(2.0)
