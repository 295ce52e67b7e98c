"""conv1d/conv2d and pooling against torch (float64 values and gradients) and finite differences."""

import numpy as np
import pytest

from shoal import core
from shoal.core import nn
from shoal.core.nn import functional as F
from tests.support.gradcheck import compare_with_torch, gradcheck

torch = pytest.importorskip("torch")
TF = torch.nn.functional

CONV2D_CASES = [
    # (N, C, H, W), (O, C/g, kh, kw), stride, padding, dilation, groups
    ((2, 3, 7, 6), (4, 3, 3, 3), 1, 0, 1, 1),
    ((2, 3, 7, 6), (4, 3, 3, 2), 2, 1, 1, 1),
    ((1, 4, 9, 9), (6, 2, 3, 3), (2, 1), (1, 2), (2, 1), 2),
    ((2, 4, 8, 8), (4, 1, 3, 3), 1, "same", 1, 4),
    ((2, 2, 8, 7), (3, 2, 4, 3), 1, "same", (1, 2), 1),
    ((2, 2, 6, 6), (3, 2, 2, 2), 1, "valid", 1, 1),
    ((3, 5, 5), (2, 3, 3, 3), 1, 1, 1, 1),  # unbatched
]


@pytest.mark.parametrize("xs, ws, stride, padding, dilation, groups", CONV2D_CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_conv2d_matches_torch(xs, ws, stride, padding, dilation, groups, bias):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(xs), rng.standard_normal(ws)]
    if bias:
        arrays.append(rng.standard_normal(ws[0]))
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    compare_with_torch(
        lambda x, w, *b: F.conv2d(x, w, *b, **kw), lambda x, w, *b: TF.conv2d(x, w, *b, **kw),
        *arrays, atol=1e-10, rtol=1e-10,
    )


@pytest.mark.parametrize("xs, ws, stride, padding, dilation, groups", [
    ((2, 3, 10), (4, 3, 3), 1, 0, 1, 1),
    ((2, 4, 11), (6, 2, 4), 2, 2, 1, 2),
    ((1, 2, 9), (2, 2, 3), 1, "same", 2, 1),
    ((3, 8), (2, 3, 2), 1, 1, 1, 1),
])
def test_conv1d_matches_torch(xs, ws, stride, padding, dilation, groups):
    rng = np.random.default_rng(1)
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    compare_with_torch(
        lambda x, w, b: F.conv1d(x, w, b, **kw), lambda x, w, b: TF.conv1d(x, w, b, **kw),
        rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(ws[0]),
        atol=1e-10, rtol=1e-10,
    )


def test_conv2d_gradients_match_finite_differences():
    rng = np.random.default_rng(2)
    gradcheck(lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1, dilation=1, groups=2),
              rng.standard_normal((2, 4, 5, 5)), rng.standard_normal((2, 2, 3, 3)),
              rng.standard_normal(2))


@pytest.mark.parametrize("xs, ws, stride, padding, dilation, groups", [
    ((2, 4, 9), (6, 2, 3), 2, 1, 1, 2),
    ((1, 3, 8), (2, 3, 3), 1, "same", 2, 1),
    ((3, 7), (4, 3, 2), 3, 0, 1, 1),  # unbatched
])
def test_conv1d_gradients_match_finite_differences(xs, ws, stride, padding, dilation, groups):
    """float64: the input's, weight's and bias's gradients against central differences."""
    rng = np.random.default_rng(3)
    gradcheck(lambda x, w, b: F.conv1d(x, w, b, stride=stride, padding=padding,
                                       dilation=dilation, groups=groups),
              rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(ws[0]))


def test_conv_refuses_mismatched_channels():
    x = core.randn(1, 3, 5, 5)
    with pytest.raises(core.ShapeError, match=r"expects 4 input channels \(groups=1\), but the input"):
        F.conv2d(x, core.randn(2, 4, 3, 3))
    with pytest.raises(ValueError, match="padding='same' is not supported for strided"):
        F.conv2d(x, core.randn(2, 3, 3, 3), stride=2, padding="same")
    with pytest.raises(ValueError, match=r"groups=2 must be a positive int dividing both in_channels \(3\)"):
        F.conv2d(x, core.randn(2, 1, 3, 3), groups=2)


POOL_CASES = [
    ((2, 3, 8, 8), 2, None, 0),
    ((2, 3, 7, 9), 3, 2, 1),
    ((1, 2, 6, 5), (3, 2), (1, 2), (1, 0)),
]


@pytest.mark.parametrize("xs, k, s, p", POOL_CASES)
def test_max_pool2d_matches_torch(xs, k, s, p):
    x = np.random.default_rng(3).standard_normal(xs)
    compare_with_torch(lambda t: F.max_pool2d(t, k, s, p), lambda t: TF.max_pool2d(t, k, s, p),
                       x, atol=1e-12, rtol=1e-12)
    compare_with_torch(lambda t: F.max_pool2d(t, k, s, p, dilation=2),
                       lambda t: TF.max_pool2d(t, k, s, p, dilation=2),
                       np.random.default_rng(4).standard_normal((1, 2, 11, 11)), atol=1e-12)


@pytest.mark.parametrize("xs, k, s, p", POOL_CASES)
@pytest.mark.parametrize("include", [True, False])
def test_avg_pool2d_matches_torch(xs, k, s, p, include):
    x = np.random.default_rng(5).standard_normal(xs)
    compare_with_torch(lambda t: F.avg_pool2d(t, k, s, p, count_include_pad=include),
                       lambda t: TF.avg_pool2d(t, k, s, p, count_include_pad=include),
                       x, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("shape, size", [((2, 3, 8, 8), 1), ((2, 3, 7, 10), (3, 4)), ((3, 5, 5), 2)])
def test_adaptive_avg_pool2d_matches_torch(shape, size):
    x = np.random.default_rng(6).standard_normal(shape)
    compare_with_torch(lambda t: F.adaptive_avg_pool2d(t, size),
                       lambda t: TF.adaptive_avg_pool2d(t, size), x, atol=1e-12, rtol=1e-12)


def test_pooling_gradients_match_finite_differences():
    rng = np.random.default_rng(7)
    gradcheck(lambda t: F.max_pool2d(t, 3, 2, 1), rng.standard_normal((1, 2, 5, 5)))
    gradcheck(lambda t: F.avg_pool2d(t, 2, 1, 1, count_include_pad=False),
              rng.standard_normal((1, 2, 4, 4)))
    gradcheck(lambda t: F.adaptive_avg_pool2d(t, (2, 3)), rng.standard_normal((1, 2, 5, 7)))


def test_layers_have_torch_defaults_and_keys():
    conv = nn.Conv2d(3, 8, 3, padding="same", groups=1, bias=True)
    tconv = torch.nn.Conv2d(3, 8, 3, padding="same")
    assert list(conv.state_dict()) == list(tconv.state_dict())
    # torch's init bound for the weight: 1/sqrt(fan_in) (kaiming a=sqrt(5)).
    assert np.abs(conv.weight.detach().numpy()).max() <= 1 / np.sqrt(27) + 1e-7
    conv.load_state_dict({k: core.tensor(v.numpy()) for k, v in tconv.state_dict().items()})
    x = np.random.default_rng(8).standard_normal((2, 3, 6, 6)).astype(np.float32)
    np.testing.assert_allclose(conv(core.tensor(x)).detach().numpy(),
                               tconv(torch.tensor(x)).detach().numpy(), atol=1e-5)
    net = nn.Sequential(nn.Conv1d(2, 4, 3), nn.Identity(),
                        nn.Flatten())
    assert net(core.randn(5, 2, 9)).shape == (5, 28)
    assert nn.AvgPool2d(2)(core.randn(1, 1, 4, 4)).shape == (1, 1, 2, 2)
    assert nn.AdaptiveAvgPool2d(1)(core.randn(2, 3, 5, 5)).shape == (2, 3, 1, 1)
    assert nn.MaxPool2d(2, 2)(core.randn(2, 3, 5, 5)).shape == (2, 3, 2, 2)


def test_max_pool2d_ties_send_the_gradient_to_the_first_maximum_like_torch():
    x = np.maximum(np.random.default_rng(9).standard_normal((2, 3, 6, 6)), 0.0)  # many zeros
    x[0, 0, :2, :2] = 1.5  # a window of equal maxima
    compare_with_torch(lambda t: F.max_pool2d(t, 2), lambda t: TF.max_pool2d(t, 2), x,
                       atol=1e-12, rtol=1e-12)
    compare_with_torch(lambda t: F.max_pool2d(t, 3, 1, 1), lambda t: TF.max_pool2d(t, 3, 1, 1), x,
                       atol=1e-12, rtol=1e-12)
