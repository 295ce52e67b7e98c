"""F.grid_sample (2-D and 3-D) and F.affine_grid against torch: every mode, padding mode and
align_corners, values and the gradients of both the input and the grid; torch's errors.

Bounds: float64 1e-12 (each output is a sum of at most 16 taps of order 1 with the same
weights; only rounding order differs, a few ulps, and the grid's gradient sums those over 3
channels). float32 1e-4: the same with float32's 6e-8 ulp, where the unnormalised coordinate
(order 10) carries 1e-6 absolute error into weights and, for bicubic, into derivatives scaled
by up to ~3. A wrong tap, weight or padding rule is off by order 0.1.
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as tf

from shoal import core
from shoal.core.nn import functional as F

_R = np.random.default_rng(0)
X = _R.standard_normal((2, 3, 5, 6))
# points inside, outside (reflection folds them back several times), and exactly on the
# corners and the centre
GRID = _R.uniform(-2.5, 2.5, (2, 4, 7, 2))
GRID[0, 0, :3] = [[1.0, -1.0], [0.0, 0.0], [-1.0, 1.0]]


def _compare(kw: dict, dtype: torch.dtype, tol: float) -> None:
    name = str(dtype).rpartition(".")[2]
    tx, tg = (torch.tensor(a, dtype=dtype, requires_grad=True) for a in (X, GRID))
    cx, cg = (core.tensor(a.astype(name), requires_grad=True) for a in (X, GRID))
    expected, got = tf.grid_sample(tx, tg, **kw), F.grid_sample(cx, cg, **kw)
    np.testing.assert_allclose(got.detach().numpy(), expected.detach().numpy(), rtol=tol,
                               atol=tol)
    g = _R.standard_normal(tuple(expected.shape))
    expected.backward(torch.tensor(g, dtype=dtype))
    got.backward(core.tensor(g.astype(name)))
    np.testing.assert_allclose(cx.grad.numpy(), tx.grad.numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(cg.grad.numpy(), tg.grad.numpy(), rtol=tol, atol=tol)


_ALL = list(itertools.product(["bilinear", "nearest", "bicubic"],
                              ["zeros", "border", "reflection"], [False, True]))


@pytest.mark.parametrize("mode,padding,ac", _ALL)
def test_grid_sample_matches_torch_in_float64(mode, padding, ac) -> None:
    """Values, the input's gradient and the grid's."""
    _compare({"mode": mode, "padding_mode": padding, "align_corners": ac}, torch.float64, 1e-12)


@pytest.mark.parametrize("mode,padding,ac", _ALL[::4])
def test_grid_sample_matches_torch_in_float32(mode, padding, ac) -> None:
    """float32 computes its coordinates in float32, as torch's kernel."""
    _compare({"mode": mode, "padding_mode": padding, "align_corners": ac}, torch.float32, 1e-4)


@pytest.mark.parametrize("mode,padding,ac", list(itertools.product(
    ["bilinear", "nearest"], ["zeros", "border", "reflection"], [False, True])))
def test_volumetric_grid_sample_matches_torch(mode, padding, ac) -> None:
    """5-D input, (x, y, z) grid: trilinear ('bilinear') and nearest, both gradients."""
    x = _R.standard_normal((2, 3, 4, 5, 6))
    grid = _R.uniform(-2.5, 2.5, (2, 3, 4, 5, 3))
    kw = {"mode": mode, "padding_mode": padding, "align_corners": ac}
    tx, tg = (torch.tensor(a, requires_grad=True) for a in (x, grid))
    cx, cg = (core.tensor(a, requires_grad=True) for a in (x, grid))
    expected, got = tf.grid_sample(tx, tg, **kw), F.grid_sample(cx, cg, **kw)
    np.testing.assert_allclose(got.detach().numpy(), expected.detach().numpy(), rtol=1e-12,
                               atol=1e-12)
    g = _R.standard_normal(tuple(expected.shape))
    expected.backward(torch.tensor(g))
    got.backward(core.tensor(g))
    np.testing.assert_allclose(cx.grad.numpy(), tx.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(cg.grad.numpy(), tg.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_only_the_input_or_only_the_grid_may_require_grad() -> None:
    """A fixed grid (a resampling) and a fixed image (a learned warp) both backpropagate."""
    grid = core.tensor(GRID, requires_grad=True)
    F.grid_sample(core.tensor(X), grid, align_corners=False).sum().backward()
    image = core.tensor(X, requires_grad=True)
    F.grid_sample(image, core.tensor(GRID), align_corners=False).sum().backward()
    assert grid.grad is not None and image.grad is not None


@pytest.mark.parametrize("ac", [False, True])
@pytest.mark.parametrize("size", [(2, 3, 4, 5), (2, 1, 1, 3), (2, 1, 3, 4, 5)])
def test_affine_grid_matches_torch(ac, size) -> None:
    """2-D and 3-D grids (one-pixel sides too) and theta's gradient."""
    rows = len(size) - 2
    theta = _R.standard_normal((2, rows, rows + 1))
    tt, ct = torch.tensor(theta, requires_grad=True), core.tensor(theta, requires_grad=True)
    with warnings.catch_warnings():  # torch's notice that unit-size grids changed in 1.3
        warnings.simplefilter("ignore", UserWarning)
        expected = tf.affine_grid(tt, size, align_corners=ac)
    got = F.affine_grid(ct, size, align_corners=ac)
    np.testing.assert_allclose(got.detach().numpy(), expected.detach().numpy(), rtol=1e-12,
                               atol=1e-12)
    g = _R.standard_normal(tuple(expected.shape))
    expected.backward(torch.tensor(g))
    got.backward(core.tensor(g))
    np.testing.assert_allclose(ct.grad.numpy(), tt.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_an_identity_warp_returns_the_image() -> None:
    """affine_grid of the identity, then grid_sample with align_corners, is the image again
    (to rounding: the weights are 1 and 0 up to a few ulps)."""
    theta = core.tensor(np.tile(np.eye(2, 3), (2, 1, 1)))
    grid = F.affine_grid(theta, X.shape, align_corners=True)
    out = F.grid_sample(core.tensor(X), grid, align_corners=True)
    np.testing.assert_allclose(out.numpy(), X, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("call,exc,match", [
    (lambda m, t: m.grid_sample(t(np.zeros((1, 1, 3, 3))), t(np.zeros((2, 2, 2, 2)))),
     RuntimeError, "same batch size"),
    (lambda m, t: m.grid_sample(t(np.zeros((1, 1, 3, 3))), t(np.zeros((1, 2, 2, 3)))),
     RuntimeError, "size 2 in last dimension"),
    (lambda m, t: m.grid_sample(t(np.zeros((1, 1, 3, 3))), t(np.zeros((1, 2, 2, 2))),
                                mode="area"), ValueError, "expected mode to be"),
    (lambda m, t: m.grid_sample(t(np.zeros((1, 1, 3, 3))), t(np.zeros((1, 2, 2, 2))),
                                padding_mode="wrap"), ValueError, "expected padding_mode"),
    (lambda m, t: m.grid_sample(t(np.zeros((1, 1, 3, 3, 3))), t(np.zeros((1, 2, 2, 2, 3))),
                                mode="bicubic"), RuntimeError, "bicubic interpolation only"),
    (lambda m, t: m.grid_sample(t(np.zeros((1, 1, 3, 3, 3))), t(np.zeros((1, 2, 2, 2))),
                                align_corners=False), RuntimeError, "size 3 in last dimension"),
    (lambda m, t: m.affine_grid(t(np.zeros((1, 2, 2))), (1, 1, 3, 3)), ValueError,
     "Expected a batch of 2D affine matrices"),
    (lambda m, t: m.affine_grid(t(np.zeros((1, 2, 3))), (1, 1, 3)), NotImplementedError,
     "affine_grid only supports 4D and 5D sizes"),
])
def test_errors_match_torch(call, exc, match) -> None:
    """torch's exception type and wording for each bad argument."""
    with pytest.raises(exc, match=match):
        call(tf, torch.tensor)
    with pytest.raises(exc, match=match):
        call(F, core.tensor)
