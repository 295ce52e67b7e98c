"""F.interpolate and the Upsample modules against torch: every mode (antialiased too), sizes
and scale factors (integer, fractional, per-axis, recomputed), align_corners, 1-d/2-d/3-d inputs;
values and the input's gradient, and torch's errors for bad arguments.

Bounds: float64 cases use 1e-12 relative / 1e-12 absolute: both sides take the same taps with
the same weights in double and differ only in summation order (core resamples axis by axis,
torch's kernels sum a 2x2 or 4x4 block at once), a few ulps on values of order 10. float32 cases
use 1e-5: the same arguments at float32's 6e-8 ulp, with weights that aten may form with fused
multiply-adds where core does not. A wrong tap or weight is off by far more (order 0.1).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as tf

from shoal import core
from shoal.core.nn import functional as F

_R = np.random.default_rng(0)
_SHAPES = {3: (2, 3, 7), 4: (2, 2, 5, 6), 5: (1, 2, 3, 4, 5)}
_MODES = {"nearest": (3, 4, 5), "nearest-exact": (3, 4, 5), "area": (3, 4, 5), "linear": (3,),
          "bilinear": (4,), "bicubic": (4,), "trilinear": (5,)}
_INTERPOLATING = ("linear", "bilinear", "bicubic", "trilinear")
# (size, scale_factor, recompute_scale_factor); a tuple is one entry per spatial axis
_GEOMETRIES = [(None, 2, None), (None, 0.5, None), (None, 1.7, None), (None, 1.7, True),
               (None, 0.37, None), ("up", None, None), ("down", None, None), (None, "mixed", None)]


def _geometry(ndim: int, size: object, scale: object) -> tuple:
    dim = ndim - 2
    if size == "up":
        size = tuple(n * 2 + 1 for n in _SHAPES[ndim][2:])
    elif size == "down":
        size = tuple(max(1, n - 2) for n in _SHAPES[ndim][2:])
    if scale == "mixed":
        scale = (1.5, 0.6, 3.0)[:dim]
    return size, scale


def _cases():
    for mode, ndims in _MODES.items():
        for ndim in ndims:
            for size, scale, recompute in _GEOMETRIES:
                corners = (None, False, True) if mode in _INTERPOLATING else (None,)
                for ac in corners:
                    yield pytest.param(mode, ndim, size, scale, recompute, ac,
                                       id=f"{mode}-{ndim}d-{size}-{scale}-{recompute}-{ac}")


def _compare(mode, ndim, size, scale, recompute, ac, dtype, tol) -> None:
    size, scale = _geometry(ndim, size, scale)
    x = _R.standard_normal(_SHAPES[ndim]) * 3
    kw = {"size": size, "scale_factor": scale, "mode": mode, "align_corners": ac,
          "recompute_scale_factor": recompute}
    t_in = torch.tensor(x, dtype=dtype, requires_grad=True)
    expected = tf.interpolate(t_in, **kw)
    c_in = core.tensor(x.astype(str(dtype).rpartition(".")[2]), requires_grad=True)
    np_dtype = c_in.detach().numpy().dtype
    got = F.interpolate(c_in, **kw)
    assert tuple(got.shape) == tuple(expected.shape)
    np.testing.assert_allclose(got.detach().numpy(), expected.detach().numpy(), rtol=tol, atol=tol)
    g = _R.standard_normal(tuple(expected.shape))
    expected.backward(torch.tensor(g, dtype=dtype))
    got.backward(core.tensor(g.astype(np_dtype)))
    np.testing.assert_allclose(c_in.grad.numpy(), t_in.grad.numpy(), rtol=tol, atol=tol)


@pytest.mark.parametrize("mode,ndim,size,scale,recompute,ac", list(_cases()))
def test_interpolate_matches_torch_in_float64(mode, ndim, size, scale, recompute, ac) -> None:
    """Values and the input's gradient equal torch's in double."""
    _compare(mode, ndim, size, scale, recompute, ac, torch.float64, 1e-12)


@pytest.mark.parametrize("mode,ndim", [("nearest", 4), ("nearest-exact", 3), ("bilinear", 4),
                                       ("bicubic", 4), ("trilinear", 5), ("area", 4)])
@pytest.mark.parametrize("scale", [1.7, 0.37, 3])
def test_interpolate_matches_torch_in_float32(mode, ndim, scale) -> None:
    """The float32 index arithmetic picks torch's taps (a wrong nearest tap is off by O(1))."""
    _compare(mode, ndim, None, scale, None, None, torch.float32, 1e-5)


_AA_GEOMETRIES = [(None, 0.5, None), (None, 0.37, None), ((3, 4), None, None),
                  (None, 1.7, None), ((20, 3), None, None), (None, 0.4, True)]


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("size,scale,recompute", _AA_GEOMETRIES)
@pytest.mark.parametrize("ac", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_antialias_matches_torch(mode, size, scale, recompute, ac, dtype, tol) -> None:
    """antialias=True (PIL's filters: shrinking widens the filter by the scale). The shapes
    avoid an output one pixel wide from a taller one: there torch's CPU forward is not the
    adjoint of its own backward (<F x, g> != <x, F^T g>), a torch quirk core does not copy."""
    x = _R.standard_normal((2, 2, 9, 13)) * 3
    kw = {"size": size, "scale_factor": scale, "mode": mode, "align_corners": ac,
          "recompute_scale_factor": recompute, "antialias": True}
    t_in = torch.tensor(x, dtype=dtype, requires_grad=True)
    c_in = core.tensor(x.astype(str(dtype).rpartition(".")[2]), requires_grad=True)
    expected, got = tf.interpolate(t_in, **kw), F.interpolate(c_in, **kw)
    np.testing.assert_allclose(got.detach().numpy(), expected.detach().numpy(), rtol=tol,
                               atol=tol)
    g = _R.standard_normal(tuple(expected.shape))
    expected.backward(torch.tensor(g, dtype=dtype))
    got.backward(core.tensor(g.astype(c_in.detach().numpy().dtype)))
    np.testing.assert_allclose(c_in.grad.numpy(), t_in.grad.numpy(), rtol=tol, atol=tol)


def test_bfloat16_input_resamples_in_float32_and_keeps_its_dtype() -> None:
    """Reduced floats go through float32 and keep their dtype; bound: one bfloat16 ulp
    (2**-7 relative), as torch's CPU kernel may round a separable pass to bfloat16 where core
    rounds once at the end."""
    x = _R.standard_normal((1, 2, 4, 5)) * 3
    t = tf.interpolate(torch.tensor(x).to(torch.bfloat16), scale_factor=1.5, mode="bilinear")
    c = F.interpolate(core.tensor(x).to(core.bfloat16), scale_factor=1.5, mode="bilinear")
    assert c.dtype == core.bfloat16
    np.testing.assert_allclose(c.float().numpy(), t.float().numpy(), rtol=2**-7, atol=2**-7)


def test_nearest_keeps_integer_inputs() -> None:
    """nearest takes integer images (uint8) as torch does; the values are copies, exactly."""
    x = _R.integers(0, 255, (1, 3, 4, 5)).astype(np.uint8)
    t = tf.interpolate(torch.tensor(x), size=(7, 3))
    c = F.interpolate(core.tensor(x), size=(7, 3))
    assert c.dtype == core.uint8
    np.testing.assert_array_equal(c.numpy(), t.numpy())


def test_zero_batch() -> None:
    """An empty batch resamples to an empty batch with the new spatial size."""
    out = F.interpolate(core.zeros(0, 2, 4, 4), scale_factor=2, mode="bilinear")
    assert tuple(out.shape) == (0, 2, 8, 8)


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"size": 4, "scale_factor": 2}, ValueError, "only one of size or scale_factor"),
    ({}, ValueError, "either size or scale_factor"),
    ({"size": (4, 4, 4)}, ValueError, "same number of spatial dimensions"),
    ({"scale_factor": (2,)}, ValueError, "same number of spatial dimensions"),
    ({"size": 4, "align_corners": True}, ValueError, "align_corners option can only be set"),
    ({"size": 4, "mode": "linear"}, NotImplementedError, "Got 4D input, but linear mode"),
    ({"size": 4, "mode": "trilinear"}, NotImplementedError, "Got 4D input, but trilinear"),
    ({"size": 4, "mode": "nope"}, NotImplementedError, "Input Error"),
    ({"size": 4, "recompute_scale_factor": True}, ValueError, "recompute_scale_factor is not"),
    ({"size": 4, "mode": "linear", "antialias": True}, ValueError, "Anti-alias option"),
])
def test_errors_match_torch(kwargs, exc, match) -> None:
    """torch's exception type and message for each bad argument."""
    x = np.zeros((1, 1, 3, 3))
    with pytest.raises(exc, match=match):
        tf.interpolate(torch.tensor(x), **kwargs)
    with pytest.raises(exc, match=match):
        F.interpolate(core.tensor(x), **kwargs)


def test_upsample_modules_match_torch() -> None:
    """Upsample, UpsamplingNearest2d and UpsamplingBilinear2d: outputs and reprs."""
    x = _R.standard_normal((1, 2, 3, 4))
    pairs = [
        (torch.nn.Upsample(scale_factor=2, mode="bicubic"),
         core.nn.Upsample(scale_factor=2, mode="bicubic")),
        (torch.nn.Upsample(size=(5, 2)), core.nn.Upsample(size=(5, 2))),
        (torch.nn.UpsamplingNearest2d(scale_factor=3), core.nn.UpsamplingNearest2d(scale_factor=3)),
        (torch.nn.UpsamplingBilinear2d(size=7), core.nn.UpsamplingBilinear2d(size=7)),
    ]
    for theirs, ours in pairs:
        np.testing.assert_allclose(ours(core.tensor(x)).numpy(), theirs(torch.tensor(x)).numpy(),
                                   rtol=1e-12, atol=1e-12)
        assert repr(ours) == repr(theirs)
