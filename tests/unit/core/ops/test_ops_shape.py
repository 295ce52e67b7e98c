"""Shape ops and indexing: finite-difference gradients, views without copies, torch parity."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shoal import core
from shoal.core.errors import ShapeError
from tests.support.gradcheck import compare_with_torch, fast_settings, gradcheck

shapes = hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=3)


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


@fast_settings()
@given(shape=shapes, data=st.data())
def test_reshape_transpose_permute_gradients(shape, data):
    x = _rand(shape, data.draw(st.integers(0, 1000)))
    n = len(shape)
    perm = tuple(data.draw(st.permutations(range(n))))
    a, b = data.draw(st.integers(-n, n - 1)), data.draw(st.integers(-n, n - 1))
    gradcheck(lambda t: t.reshape(-1), x)
    gradcheck(lambda t: t.view(tuple(reversed(shape))), x)
    gradcheck(lambda t: t.permute(perm), x)
    gradcheck(lambda t: t.transpose(a, b), x)
    gradcheck(lambda t: t.T, x)
    gradcheck(lambda t: t.unsqueeze(0).flatten(), x)
    gradcheck(lambda t: t.squeeze(), x)


@fast_settings()
@given(shape=shapes, data=st.data())
def test_slicing_and_integer_indexing_gradients(shape, data):
    x = _rand(shape, data.draw(st.integers(0, 1000)))
    first = shape[0]
    i = data.draw(st.integers(-first, first - 1))
    start = data.draw(st.integers(0, first - 1))
    gradcheck(lambda t: t[i], x)
    gradcheck(lambda t: t[start:], x)
    gradcheck(lambda t: t[..., ::2], x)
    gradcheck(lambda t: t[None, :, ...], x)
    # Repeated indices must add their gradients up.
    idx = np.array(data.draw(st.lists(st.integers(0, first - 1), min_size=1, max_size=5)))
    gradcheck(lambda t: t[idx], x)
    gradcheck(lambda t: t[core.tensor(idx)], x)
    mask = _rand(shape, 7) > 0
    gradcheck(lambda t: t[mask], x)


@fast_settings()
@given(shape=shapes, data=st.data())
def test_cat_stack_where_expand_gradients(shape, data):
    seed = data.draw(st.integers(0, 1000))
    n = len(shape)
    dim = data.draw(st.integers(-n, n - 1))
    a, b = _rand(shape, seed), _rand(shape, seed + 1)
    other = list(shape)
    other[dim] = 2
    c = _rand(tuple(other), seed + 2)
    gradcheck(lambda x, y, z: core.cat([x, y, z], dim), a, b, c)
    sdim = data.draw(st.integers(-n - 1, n))
    gradcheck(lambda x, y: core.stack([x, y], sdim), a, b)
    cond = _rand(shape, seed + 3) > 0
    gradcheck(lambda x, y: core.where(core.tensor(cond), x, y), a, b[..., :1])
    gradcheck(lambda x: core.where(core.tensor(cond), x, 0.0), a)
    gradcheck(lambda x: x[..., :1].expand(*shape), a)


def test_split_chunk_contiguous_clone_gradients():
    x = _rand((5, 4))
    gradcheck(lambda t: core.cat([p * (i + 1) for i, p in enumerate(t.split(2))]), x)
    gradcheck(lambda t: core.cat([p * (i + 1) for i, p in enumerate(t.chunk(2, dim=1))], 1), x)
    gradcheck(lambda t: t.T.contiguous() * 2, x)
    gradcheck(lambda t: t.clone() * t, x)


def test_views_share_memory():
    x = core.arange(12, dtype=core.float32).reshape(3, 4)
    for v in (x.T, x.transpose(0, 1), x.permute(1, 0), x.view(4, 3), x[1:], x.reshape(-1)):
        assert np.shares_memory(v.array, x.array)
    assert x.T.shape == (4, 3) and x.mT.shape == (4, 3)


def test_shape_ops_match_torch():
    torch = pytest.importorskip("torch")
    x = _rand((2, 3, 4))
    y = _rand((2, 3, 4), 1)
    idx = np.array([1, 0, 1, 1])
    cases = [
        (lambda t: t.permute(2, 0, 1), lambda t: t.permute(2, 0, 1)),
        (lambda t: t.transpose(0, 2).reshape(4, 6), lambda t: t.transpose(0, 2).reshape(4, 6)),
        (lambda t: t[:, ::2, idx[:2]], lambda t: t[:, ::2, torch.tensor(idx[:2])]),
        (lambda t: t[idx], lambda t: t[torch.tensor(idx)]),
        (lambda t: t[t > 0], lambda t: t[t > 0]),
        (lambda t: t.flatten(1), lambda t: t.flatten(1)),
        (lambda t: t.unsqueeze(-1).squeeze(0), lambda t: t.unsqueeze(-1).squeeze(0)),
        (lambda t: t[:, :1].expand(2, 3, 4), lambda t: t[:, :1].expand(2, 3, 4)),
    ]
    for cfn, tfn in cases:
        compare_with_torch(cfn, tfn, x, atol=1e-12, rtol=1e-12)
    compare_with_torch(
        lambda a, b: core.where(a > b, a, b * 2),
        lambda a, b: torch.where(a > b, a, b * 2),
        x, y, atol=1e-12, rtol=1e-12,
    )
    compare_with_torch(
        lambda a, b: core.cat([a, b], 1), lambda a, b: torch.cat([a, b], 1), x, y
    )
    compare_with_torch(
        lambda a, b: core.stack([a, b], 2), lambda a, b: torch.stack([a, b], 2), x, y
    )


def test_setitem_writes_in_place_outside_the_graph():
    x = core.zeros(3, 4)
    x[1] = 5.0
    x[:, 0] = core.tensor([1.0, 2.0, 3.0])
    assert x.numpy()[1, 1] == 5.0 and x.numpy()[2, 0] == 3.0
    w = core.zeros(2, requires_grad=True)
    with pytest.raises(core.AutogradError, match="in-place"):
        w[0] = 1.0
    with core.no_grad():
        w[0] = 1.0
    assert w.tolist() == [1.0, 0.0]


def test_shape_errors_name_the_op_and_shapes():
    x = core.ones(2, 3)
    with pytest.raises(ShapeError, match=r"reshape: cannot reshape a tensor of shape \(2, 3\)"):
        x.reshape(4, 2)
    with pytest.raises(ShapeError, match=r"cat: shapes \[\(2, 3\), \(2, 4\)\] do not match"):
        core.cat([x, core.ones(2, 4)])
    with pytest.raises(ShapeError, match=r"stack: all tensors must have one shape"):
        core.stack([x, core.ones(3, 2)])
    with pytest.raises(ShapeError, match=r"permute: \(0, 0\) is not a permutation"):
        x.permute(0, 0)
    with pytest.raises(ShapeError, match="getitem: index 5 is out of range"):
        x[5]
    with pytest.raises(ShapeError, match=r"expand: cannot expand shape \(2, 3\) to \(4, 3\)"):
        x.expand(4, 3)
