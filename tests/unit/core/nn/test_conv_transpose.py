"""conv_transpose1d/2d/3d and nn.ConvTranspose1d/2d/3d against torch 2.13: float64 values and
gradients for input, weight and bias, output_size=, dtypes, autocast and errors.

Bounds: in float64 every output is a sum of at most a few hundred products of O(1) normals, so
both libraries' results carry rounding of ~1e-14; 1e-10 leaves four orders of margin on any
x86-64 CPU whatever the summation order of either BLAS.
"""

import numpy as np
import pytest

from shoal import core
from shoal.core import nn
from shoal.core.nn import functional as F
from tests.support.gradcheck import (compare_module_with_torch, compare_with_torch, gradcheck,
                                     load_torch_weights)

torch = pytest.importorskip("torch")
TF = torch.nn.functional

CASES = [
    # input shape, weight shape (C_in, C_out/G, *K), stride, padding, output_padding, groups,
    # dilation
    ((2, 3, 7), (3, 4, 3), 1, 0, 0, 1, 1),
    ((2, 4, 6), (4, 2, 4), 2, 1, 1, 2, 1),
    ((3, 5), (3, 2, 2), 3, 0, 2, 1, 2),  # unbatched
    ((2, 3, 5, 4), (3, 2, 3, 3), 1, 0, 0, 1, 1),
    ((2, 4, 4, 5), (4, 3, 3, 2), (2, 3), (1, 0), (1, 2), 2, 1),
    ((1, 2, 5, 5), (2, 1, 3, 3), 1, 2, 1, 2, (2, 3)),
    ((3, 4, 4), (3, 2, 2, 3), 2, 1, 0, 1, 1),  # unbatched
    ((2, 2, 3, 4, 3), (2, 3, 2, 3, 2), 1, 0, 0, 1, 1),
    ((1, 4, 3, 3, 4), (4, 1, 3, 2, 2), (2, 1, 2), (1, 0, 1), (1, 0, 1), 2, (1, 2, 1)),
]


@pytest.mark.parametrize("xs, ws, stride, padding, output_padding, groups, dilation", CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_conv_transpose_matches_torch(xs, ws, stride, padding, output_padding, groups, dilation,
                                      bias):
    spatial = len(ws) - 2
    name = f"conv_transpose{spatial}d"
    rng = np.random.default_rng(spatial)
    arrays = [rng.standard_normal(xs), rng.standard_normal(ws)]
    if bias:
        arrays.append(rng.standard_normal(ws[1] * groups))
    kw = dict(stride=stride, padding=padding, output_padding=output_padding, groups=groups,
              dilation=dilation)
    ours, theirs = getattr(F, name), getattr(TF, name)
    compare_with_torch(lambda x, w, *b: ours(x, w, *b, **kw),
                       lambda x, w, *b: theirs(x, w, *b, **kw), *arrays, atol=1e-10, rtol=1e-10)


def test_the_top_level_names_are_the_functional_ones():
    for spatial in (1, 2, 3):
        name = f"conv_transpose{spatial}d"
        assert getattr(core, name) is getattr(F, name)


def test_conv_transpose2d_gradients_match_finite_differences():
    rng = np.random.default_rng(3)
    # eps 1e-6 central differences of a bilinear function: the error is rounding only
    # (~1e-10 relative), well inside gradcheck's 1e-6 / 1e-5.
    gradcheck(lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1,
                                                 groups=2, dilation=1),
              rng.standard_normal((1, 4, 3, 3)), rng.standard_normal((4, 1, 2, 3)),
              rng.standard_normal(2))


@pytest.mark.parametrize("spatial", [1, 2, 3])
def test_conv_transpose_module_matches_torch_with_output_size(spatial):
    torch.manual_seed(spatial)
    kw = dict(stride=2, padding=1, groups=2, dilation=1, bias=True)
    theirs = getattr(torch.nn, f"ConvTranspose{spatial}d")(4, 6, 3, **kw).double()
    ours = getattr(nn, f"ConvTranspose{spatial}d")(4, 6, 3, **kw, dtype=core.float64)
    load_torch_weights(ours, theirs)
    shape = (2, 4) + (4,) * spatial
    x = np.random.default_rng(spatial).standard_normal(shape)
    t_in, c_in = torch.tensor(x), core.tensor(x)
    # 8 = the largest size stride 2 allows here (7 is the smallest): output_padding 1.
    for size in [(8,) * spatial, (2, 6) + (8,) * spatial]:
        t_out, c_out = theirs(t_in, output_size=size), ours(c_in, output_size=size)
        assert tuple(c_out.shape) == tuple(t_out.shape)
        np.testing.assert_allclose(c_out.detach().numpy(), t_out.detach().numpy(), atol=1e-10)
    compare_module_with_torch(ours, theirs, x, atol=1e-10, seed=0, output_size=None)


def test_conv_transpose_module_shapes_repr_and_init_are_torchs():
    ours = nn.ConvTranspose2d(4, 6, (3, 2), stride=2, output_padding=1, groups=2, bias=False)
    theirs = torch.nn.ConvTranspose2d(4, 6, (3, 2), stride=2, output_padding=1, groups=2,
                                      bias=False)
    assert tuple(ours.weight.shape) == tuple(theirs.weight.shape) == (4, 3, 3, 2)
    assert repr(ours) == repr(theirs)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    # kaiming_uniform(a=sqrt(5)) over fan_in = 3*3*2 = 18: |w| <= 1/sqrt(18).
    assert float(ours.weight.abs().max()) <= 1 / np.sqrt(18)


def test_conv_transpose_keeps_float32_and_runs_low_under_autocast():
    x, w = core.randn(1, 2, 4, 4), core.randn(2, 3, 3, 3)
    assert F.conv_transpose2d(x, w).dtype == core.float32
    with core.autocast("cpu", dtype=core.bfloat16):
        out = F.conv_transpose2d(x, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = TF.conv_transpose2d(torch.randn(1, 2, 4, 4), torch.randn(2, 3, 3, 3))
    assert out.dtype == core.bfloat16 and expected.dtype == torch.bfloat16


def test_conv_transpose_of_complex_matches_torch():
    rng = np.random.default_rng(5)

    def cnormal(shape):
        return rng.standard_normal(shape) + 1j * rng.standard_normal(shape)

    x, w, g = cnormal((1, 2, 3, 3)), cnormal((2, 2, 2, 2)), cnormal((1, 2, 6, 6))
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    cx, cw = core.tensor(x, requires_grad=True), core.tensor(w, requires_grad=True)
    t_out, c_out = TF.conv_transpose2d(tx, tw, stride=2), F.conv_transpose2d(cx, cw, stride=2)
    t_out.backward(torch.tensor(g))
    c_out.backward(core.tensor(g))
    np.testing.assert_allclose(c_out.detach().numpy(), t_out.detach().numpy(), atol=1e-10)
    np.testing.assert_allclose(cx.grad.numpy(), tx.grad.numpy(), atol=1e-10)
    np.testing.assert_allclose(cw.grad.numpy(), tw.grad.numpy(), atol=1e-10)


@pytest.mark.parametrize("args, kwargs, error", [
    (((2, 3, 4, 4), (4, 2, 3, 3)), {}, RuntimeError),  # input channels != weight's dim 0
    (((2, 4, 4, 4), (4, 2, 3, 3)), {"output_padding": 1}, RuntimeError),  # not < stride
    (((2, 4, 4, 4), (4, 2, 3, 3)), {"groups": 3}, RuntimeError),
    (((2, 4, 4, 4), (4, 2, 3, 3)), {"padding": -1}, RuntimeError),
    (((2, 4, 4, 4), (4, 2, 3, 3)), {"padding": 5}, RuntimeError),  # output size below 1
    (((2, 4, 4, 4), (4, 2, 3, 3)), {"padding": "same"}, TypeError),
    (((4, 4, 4), (4, 2, 3, 3)), {"bias": (4,)}, RuntimeError),  # bias must have C_out = 2
    (((4, 4), (4, 2, 3, 3)), {}, RuntimeError),  # a 2-d input
])
def test_conv_transpose2d_refuses_what_torch_refuses(args, kwargs, error):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s) for s in args]
    if "bias" in kwargs:
        kwargs = {**kwargs, "bias": rng.standard_normal(kwargs["bias"])}
    with pytest.raises(error):
        TF.conv_transpose2d(*[torch.tensor(a) for a in arrays],
                            **{k: torch.tensor(v) if k == "bias" else v for k, v in kwargs.items()})
    with pytest.raises(error):
        F.conv_transpose2d(*[core.tensor(a) for a in arrays],
                           **{k: core.tensor(v) if k == "bias" else v for k, v in kwargs.items()})


def test_conv_transpose_module_refuses_what_torch_refuses():
    for lib in (torch, core):
        with pytest.raises(ValueError, match='Only "zeros" padding mode is supported'):
            lib.nn.ConvTranspose2d(2, 2, 3, padding_mode="reflect")
        module = lib.nn.ConvTranspose2d(2, 2, 3, stride=2)
        x = lib.zeros(1, 2, 5, 5)
        with pytest.raises(ValueError, match=r"valid sizes range from \[11, 11\] to \[12, 12\]"):
            module(x, output_size=(20, 20))
        with pytest.raises(ValueError, match="output_size must have 2 or 4 elements"):
            module(x, output_size=(11, 11, 11))
