"""F.unfold / F.fold (and the Unfold and Fold modules) and F.rrelu / nn.RReLU against torch.

unfold and fold: values and the input's gradient in float64 over kernel, dilation, padding and
stride, batched and unbatched; torch's errors. Bound 1e-12: each output is a copy of an input
(unfold) or a sum of at most kh*kw of them (fold), of order 1 in double, so only summation order
differs (a few ulps); a misplaced block is off by order 1.

rrelu: in eval it is leaky_relu at the mean slope, which must equal torch's (same bound). In
training the slopes are random draws from core's generator, which is not torch's stream, so the
test checks the law instead: positive inputs pass through, each negative input's slope lies in
[lower, upper], the gradient is that slope, and the same seed gives the same slopes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as tf

from shoal import core
from shoal.core.nn import functional as F

_R = np.random.default_rng(0)

# (input shape, kernel_size, dilation, padding, stride)
_GEOMETRIES = [
    ((2, 3, 5, 6), 2, 1, 0, 1),
    ((2, 3, 5, 6), (2, 3), (1, 2), (1, 0), (2, 1)),
    ((3, 7, 7), 3, 2, 2, 3),
    ((1, 2, 4, 4), 4, 1, 1, 2),
    ((0, 2, 4, 4), 2, 1, 0, 1),
]


def _run(fn_t, fn_c, x: np.ndarray) -> None:
    t_in = torch.tensor(x, requires_grad=True)
    c_in = core.tensor(x, requires_grad=True)
    expected, got = fn_t(t_in), fn_c(c_in)
    assert tuple(got.shape) == tuple(expected.shape)
    np.testing.assert_allclose(got.detach().numpy(), expected.detach().numpy(),
                               rtol=1e-12, atol=1e-12)
    g = _R.standard_normal(tuple(expected.shape))
    expected.backward(torch.tensor(g))
    got.backward(core.tensor(g))
    np.testing.assert_allclose(c_in.grad.numpy(), t_in.grad.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape,k,d,p,s", _GEOMETRIES)
def test_unfold_then_fold_match_torch(shape, k, d, p, s) -> None:
    """unfold of an image, and fold of columns of the shape unfold made, back to the image."""
    x = _R.standard_normal(shape)
    _run(lambda t: tf.unfold(t, k, d, p, s), lambda t: F.unfold(t, k, d, p, s), x)
    cols = tf.unfold(torch.tensor(x), k, d, p, s).numpy()
    size = shape[-2:]
    _run(lambda t: tf.fold(t, size, k, d, p, s), lambda t: F.fold(t, size, k, d, p, s), cols)


def test_modules_match_torch() -> None:
    """Unfold and Fold forward their geometry and print as torch's."""
    x = _R.standard_normal((2, 4, 3, 3))
    pairs = [(torch.nn.Unfold((2, 2), 1, 1, 2), core.nn.Unfold((2, 2), 1, 1, 2)),
             (torch.nn.Fold(4, 2, 1, 0, 1), core.nn.Fold(4, 2, 1, 0, 1))]
    inputs = [x, _R.standard_normal((2, 8, 9))]
    for (theirs, ours), arr in zip(pairs, inputs):
        np.testing.assert_allclose(ours(core.tensor(arr)).numpy(),
                                   theirs(torch.tensor(arr)).numpy(), rtol=1e-12, atol=1e-12)
        assert repr(ours) == repr(theirs)


@pytest.mark.parametrize("call,match", [
    (lambda m, x: m.unfold(x(np.zeros((1, 2, 3, 3))), 5), "components must be at least one"),
    (lambda m, x: m.unfold(x(np.zeros((1, 2, 3, 3))), 2, stride=0), "stride should be greater"),
    (lambda m, x: m.unfold(x(np.zeros((1, 2, 3, 3))), 2, padding=-1), "padding should be non-neg"),
    (lambda m, x: m.fold(x(np.zeros((2, 3, 3, 3))), (3, 3), 2), "Expected 2D or 3D"),
    (lambda m, x: m.fold(x(np.zeros((2, 15, 4))), (3, 3), 2), "divisible by the product"),
    (lambda m, x: m.fold(x(np.zeros((2, 16, 5))), (3, 3), 2), "number of sliding blocks"),
    (lambda m, x: m.fold(x(np.zeros((2, 16, 4))), (3, 3), 0), "kernel size should be greater"),
])
def test_errors_match_torch(call, match) -> None:
    """torch's RuntimeError and wording for each bad argument."""
    with pytest.raises(RuntimeError, match=match):
        call(tf, torch.tensor)
    with pytest.raises(RuntimeError, match=match):
        call(F, core.tensor)


def test_rrelu_eval_is_leaky_relu_at_the_mean_slope() -> None:
    """Eval mode (the functional's default, and a module after .eval()) equals torch's,
    gradient at 0 included."""
    x = np.concatenate([_R.standard_normal(20), [0.0]])
    _run(lambda t: tf.rrelu(t, 0.1, 0.6), lambda t: F.rrelu(t, 0.1, 0.6), x)
    module = core.nn.RReLU(0.2, 0.4).eval()
    _run(lambda t: torch.nn.RReLU(0.2, 0.4).eval()(t), module, x)
    assert repr(module) == repr(torch.nn.RReLU(0.2, 0.4))
    assert repr(core.nn.RReLU(inplace=True)) == repr(torch.nn.RReLU(inplace=True))


def test_rrelu_training_draws_slopes_in_bounds_from_core_generator() -> None:
    """Training: positives pass, each negative gets a slope in [lower, upper] that is also its
    gradient, the slopes vary, and core.manual_seed replays them."""
    x = np.concatenate([_R.standard_normal(2000), [0.0]])
    lower, upper = 0.1, 0.3
    runs = []
    for _ in range(2):
        core.manual_seed(7)
        c_in = core.tensor(x, requires_grad=True)
        out = core.nn.RReLU(lower, upper)(c_in)  # a new module trains
        out.sum().backward()
        runs.append((out.detach().numpy(), c_in.grad.numpy()))
    (out, grad), (out2, grad2) = runs
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(grad, grad2)
    pos = x > 0
    np.testing.assert_array_equal(out[pos], x[pos])
    np.testing.assert_array_equal(grad[pos], 1.0)
    slopes = grad[~pos]
    assert slopes.min() >= lower and slopes.max() <= upper
    # 1000 uniform draws: their spread covers most of the interval (a constant slope would not)
    assert slopes.max() - slopes.min() > 0.9 * (upper - lower)
    np.testing.assert_allclose(out[~pos], x[~pos] * slopes, rtol=1e-15)


def test_rrelu_rejects_lower_above_upper() -> None:
    """torch's RuntimeError, in eval and in training."""
    for training in (False, True):
        with pytest.raises(RuntimeError, match="Lower bound should be less than or equal"):
            tf.rrelu(torch.zeros(3), 0.5, 0.1, training=training)
        with pytest.raises(RuntimeError, match="Lower bound should be less than or equal"):
            F.rrelu(core.zeros(3), 0.5, 0.1, training=training)
