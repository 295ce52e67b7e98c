"""torch.nn.functional.interpolate and the Upsample modules: nearest, nearest-exact, linear,
bilinear, bicubic, trilinear and area resampling of 1-d, 2-d and 3-d inputs, and antialiased
bilinear and bicubic.

Every mode is separable, so each spatial axis is resampled on its own: a gather of K source
positions per output position, weighted and summed (nearest: 1 tap, linear: 2, cubic: 4, area:
the widest bin, antialiased: the widened filter's span). The backward is the transposed map,
computed as a gather too (each input position's readers and their weights), so neither pass
scatters: deterministic on cupy as on numpy. Tap positions and weights follow aten's CPU kernels (UpSample.h): the nearest modes find
their source in float32 whatever the input's dtype, the others in the input's compute type
(float64 for float64, float32 otherwise); float16 and bfloat16 inputs are resampled in float32
and rounded once at the end, as torch's opmath does.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from shoal.core.nn.module import Module
from shoal.core.ops import shape as _shape
from shoal.core.ops._promote import is_reduced_float
from shoal.core.ops._util import result, xp_of
from shoal.core.tensor import Tensor

__all__ = ["interpolate", "upsample", "upsample_nearest", "upsample_bilinear", "Upsample",
           "UpsamplingNearest2d", "UpsamplingBilinear2d"]

_F32 = np.float32
_CUBIC_A = -0.75  # torch's bicubic kernel constant (Keys' a = -0.75)
_INTERPOLATING = ("linear", "bilinear", "bicubic", "trilinear")
_MODE_DIMS = {"linear": 3, "bilinear": 4, "bicubic": 4, "trilinear": 5}


# --- where each output position reads from (one axis) -------------------------------------------

def _scale(in_size: int, out_size: int, align_corners: bool, scale: float | None, ct: type) -> Any:
    """aten's area_pixel_compute_scale in the compute type ct."""
    if align_corners:
        return ct(in_size - 1) / ct(out_size - 1) if out_size > 1 else ct(0)
    if scale is not None and scale > 0:
        return ct(1.0 / scale)
    return ct(in_size) / ct(out_size)


def _nearest_taps(in_size: int, out_size: int, scale: float | None, exact: bool) -> tuple:
    dst = np.arange(out_size)
    if not exact and out_size == in_size:
        idx = dst
    elif not exact and out_size == 2 * in_size:
        idx = dst >> 1
    else:
        s = _scale(in_size, out_size, False, scale, _F32)
        if exact:  # (dst + 0.5) is a double in aten; floorf rounds the product to float first
            src = ((dst + 0.5) * np.float64(s)).astype(_F32)
        else:
            src = dst.astype(_F32) * s
        idx = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
    return idx[:, None], np.ones((out_size, 1))


def _linear_taps(in_size: int, out_size: int, scale: float | None, align_corners: bool,
                 ct: type) -> tuple:
    s = _scale(in_size, out_size, align_corners, scale, ct)
    dst = np.arange(out_size, dtype=ct)
    src = s * dst if align_corners else np.maximum(s * (dst + ct(0.5)) - ct(0.5), ct(0))
    i0 = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
    lam1 = np.clip(src - i0.astype(ct), 0, 1)
    i1 = i0 + (i0 < in_size - 1)
    return np.stack([i0, i1], 1), np.stack([1 - lam1, lam1], 1)


def _cubic_taps(in_size: int, out_size: int, scale: float | None, align_corners: bool,
                ct: type) -> tuple:
    s = _scale(in_size, out_size, align_corners, scale, ct)
    dst = np.arange(out_size, dtype=ct)
    src = s * dst if align_corners else s * (dst + ct(0.5)) - ct(0.5)  # no clamp for cubic
    i0 = np.floor(src).astype(np.int64)
    t = src - i0.astype(ct)
    a = ct(_CUBIC_A)

    def near(x: Any) -> Any:  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x: Any) -> Any:  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    weights = np.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], 1)
    idx = np.clip(i0[:, None] + np.arange(-1, 3), 0, in_size - 1)  # the border repeats
    return idx, weights


def _antialias_taps(in_size: int, out_size: int, scale: float | None, align_corners: bool,
                    ct: type, cubic: bool) -> tuple:
    """aten's antialiased taps (PIL's resampling): when shrinking, the filter widens by the
    scale so every input pixel contributes; weights normalised to sum to 1 over in-range taps.
    The cubic filter here is Keys' with a = -0.5, as PIL's."""
    s = _scale(in_size, out_size, align_corners, scale, ct)
    half = ct(2.0 if cubic else 1.0)  # half the filter's width: interp_size / 2
    support = half * s if s >= 1 else half
    invscale = ct(1) / s if s >= 1 else ct(1)
    center = s * (np.arange(out_size, dtype=ct) + ct(0.5))
    xmin = np.maximum(np.trunc(center - support + ct(0.5)).astype(np.int64), 0)
    xsize = np.minimum(np.trunc(center + support + ct(0.5)).astype(np.int64), in_size) - xmin
    j = np.arange(int(xsize.max()))
    x = np.abs((j + xmin[:, None] - center[:, None] + ct(0.5)) * invscale).astype(ct)
    if cubic:
        a = ct(-0.5)
        near = ((a + 2) * x - (a + 3)) * x * x + 1
        far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
        w = np.where(x < 1, near, np.where(x < 2, far, ct(0)))
    else:
        w = np.maximum(ct(1) - x, ct(0))
    w = np.where(j < xsize[:, None], w, ct(0))
    total = w.sum(1, keepdims=True)
    w = np.where(total != 0, w / np.where(total != 0, total, ct(1)), w)
    return np.minimum(xmin[:, None] + j, in_size - 1), w


def _area_taps(in_size: int, out_size: int) -> tuple:
    """adaptive_avg_pool's bins: floor(i * in / out) to ceil((i + 1) * in / out)."""
    i = np.arange(out_size)
    start = (i * in_size) // out_size
    end = -((-(i + 1) * in_size) // out_size)
    count = end - start
    k = np.arange(int(count.max()))
    idx = np.minimum(start[:, None] + k, in_size - 1)
    weights = np.where(k < count[:, None], 1.0 / count[:, None], 0.0)
    return idx, weights


# --- the differentiable op: resample one axis -------------------------------------------------

def _transpose_taps(idx: np.ndarray, weights: np.ndarray | None, n_in: int) -> tuple:
    """The same sparse map seen from the source side: for each input position, the outputs
    that read it and with which weight (zero-padded to the most readers), so the backward is a
    gather too: no scatter, no atomics, the same kernel as the forward."""
    n_out, k = idx.shape
    flat = idx.ravel()
    wf = np.ones(flat.size) if weights is None else weights.ravel()
    rows = np.repeat(np.arange(n_out), k)
    keep = wf != 0
    flat, wf, rows = flat[keep], wf[keep], rows[keep]
    order = np.argsort(flat, kind="stable")  # readers in ascending output order
    flat, wf, rows = flat[order], wf[order], rows[order]
    counts = np.bincount(flat, minlength=n_in)
    rank = np.arange(flat.size) - (np.cumsum(counts) - counts)[flat]
    width = max(int(counts.max()), 1)
    readers = np.zeros((n_in, width), dtype=np.int64)
    reader_w = np.zeros((n_in, width))
    readers[flat, rank] = rows
    reader_w[flat, rank] = wf
    return readers, reader_w


def _gather_sum(xp: Any, data: Any, axis: int, idx: Any, weights: Any) -> Any:
    """sum over k of weights[:, k] * take(data, idx[:, k], axis): one strided gather per tap
    (a take along the axis copies whole trailing rows), no small-axis reduction."""
    per_position = (-1,) + (1,) * (data.ndim - axis - 1)
    out = None
    for k in range(idx.shape[1]):
        part = xp.take(data, idx[:, k], axis=axis)
        if weights is not None:
            part *= weights[:, k].reshape(per_position)
        out = part if out is None else xp.add(out, part, out=out)
    return out


def _resample_axis(x: Tensor, axis: int, idx: np.ndarray, weights: np.ndarray | None) -> Tensor:
    """out[..., j, ...] = sum_k weights[j, k] * x[..., idx[j, k], ...] along axis."""
    xd = x.array
    xp = xp_of(xd)
    n_in = xd.shape[axis]
    w_d = None if weights is None else xp.asarray(weights.astype(xd.dtype))
    out = _gather_sum(xp, xd, axis, xp.asarray(idx), w_d)

    def backward(g: Any) -> tuple:
        readers, reader_w = _transpose_taps(idx, weights, n_in)
        return (_gather_sum(xp, g, axis, xp.asarray(readers),
                            xp.asarray(reader_w.astype(g.dtype))),)

    return result(out, "UpsampleBackward", backward, (x,))


# --- torch's functional surface -----------------------------------------------------------------

def _sizes_and_scales(input: Tensor, size: Any, scale_factor: Any,  # noqa: A002
                      recompute_scale_factor: bool | None, mode: str) -> tuple:
    """(output sizes, the scales the kernels see or None) as torch's interpolate derives them."""
    dim = input.ndim - 2
    spatial = list(input.shape[2:])
    if size is not None and scale_factor is not None:
        raise ValueError("only one of size or scale_factor should be defined")
    scales: list | None = None
    if size is not None:
        if isinstance(size, (list, tuple)):
            if len(size) != dim:
                raise ValueError(
                    f"Input and output must have the same number of spatial dimensions, but got "
                    f"input with spatial dimensions of {spatial} and output size of {size}. "
                    f"Please provide input tensor in (N, C, d1, d2, ...,dK) format and output "
                    f"size in (o1, o2, ...,oK) format.")
            sizes = [int(s) for s in size]
        else:
            sizes = [int(size)] * dim
    elif scale_factor is not None:
        if isinstance(scale_factor, (list, tuple)):
            if len(scale_factor) != dim:
                raise ValueError(
                    f"Input and scale_factor must have the same number of spatial dimensions, "
                    f"but got input with spatial dimensions of {spatial} and scale_factor of "
                    f"shape {scale_factor}. Please provide input tensor in (N, C, d1, d2, ...,dK) "
                    f"format and scale_factor in (s1, s2, ...,sK) format.")
            scales = [float(s) for s in scale_factor]
        else:
            scales = [float(scale_factor)] * dim
        sizes = [math.floor(float(n) * s) for n, s in zip(spatial, scales)]
    else:
        raise ValueError("either size or scale_factor should be defined")
    if recompute_scale_factor and size is not None:
        raise ValueError("recompute_scale_factor is not meaningful with an explicit size.")
    if recompute_scale_factor or mode == "area":
        scales = None
    if min(spatial, default=1) <= 0 or min(sizes, default=1) <= 0:
        raise RuntimeError(f"Input and output sizes should be greater than 0, but got input "
                           f"{tuple(spatial)} and output {tuple(sizes)}.")
    return sizes, scales or [None] * dim


def _check_align_corners(mode: str, align_corners: bool | None) -> None:
    if mode in ("nearest", "area", "nearest-exact") and align_corners is not None:
        raise ValueError("align_corners option can only be set with the interpolating "
                         "modes: linear | bilinear | bicubic | trilinear")


def _check_mode(input: Tensor, mode: str, antialias: bool) -> None:  # noqa: A002
    """torch's checks after the sizes, in its order: antialias, then the mode's input rank."""
    if antialias:
        if not (mode in ("bilinear", "bicubic") and input.ndim == 4):
            raise ValueError("Anti-alias option is restricted to bilinear and bicubic modes and "
                             "requires a 4-D tensor as input")
    if mode not in _INTERPOLATING + ("nearest", "area", "nearest-exact"):
        raise NotImplementedError(
            f"Input Error: Only 3D, 4D and 5D input Tensors supported (got {input.ndim}D) for "
            f"the modes: nearest | linear | bilinear | bicubic | trilinear | area | "
            f"nearest-exact (got {mode})")
    if input.ndim not in (3, 4, 5):
        raise NotImplementedError(
            f"Input Error: Only 3D, 4D and 5D input Tensors supported (got {input.ndim}D) for "
            f"the modes: nearest | linear | bilinear | bicubic | trilinear | area | "
            f"nearest-exact (got {mode})")
    needed = _MODE_DIMS.get(mode)
    if needed is not None and input.ndim != needed:
        raise NotImplementedError(
            f"Got {input.ndim}D input, but {mode} mode needs {needed}D input")
    if mode not in ("nearest", "nearest-exact") and input.array.dtype.kind not in "fcV":
        raise RuntimeError(f"interpolate: mode {mode!r} needs a floating-point input, got "
                           f"{input.dtype}.")


def interpolate(input: Tensor, size: Any = None, scale_factor: Any = None,  # noqa: A002
                mode: str = "nearest", align_corners: bool | None = None,
                recompute_scale_factor: bool | None = None, antialias: bool = False) -> Tensor:
    """Resample the spatial dimensions of (N, C, d1[, d2[, d3]]) to `size` or by
    `scale_factor`, with torch's modes, index rules and errors."""
    _check_align_corners(mode, align_corners)
    sizes, scales = _sizes_and_scales(input, size, scale_factor, recompute_scale_factor, mode)
    _check_mode(input, mode, antialias)
    corners = bool(align_corners)
    dtype = input.array.dtype
    x = _shape.to(input, None, np.float32) if is_reduced_float(dtype) else input
    ct = np.float64 if x.array.dtype == np.float64 else _F32
    for i, (n_out, s) in enumerate(zip(sizes, scales)):
        axis = 2 + i
        n_in = x.shape[axis]
        if mode in ("nearest", "nearest-exact"):
            idx, _ = _nearest_taps(n_in, n_out, s, mode == "nearest-exact")
            x = _resample_axis(x, axis, idx, None)
        elif mode == "area":
            x = _resample_axis(x, axis, *_area_taps(n_in, n_out))
        elif antialias:
            x = _resample_axis(x, axis, *_antialias_taps(n_in, n_out, s, corners, ct,
                                                          mode == "bicubic"))
        elif mode == "bicubic":
            x = _resample_axis(x, axis, *_cubic_taps(n_in, n_out, s, corners, ct))
        else:
            x = _resample_axis(x, axis, *_linear_taps(n_in, n_out, s, corners, ct))
    return _shape.to(x, None, dtype) if x.array.dtype != dtype else x


def upsample(input: Tensor, size: Any = None, scale_factor: Any = None,  # noqa: A002
             mode: str = "nearest", align_corners: bool | None = None) -> Tensor:
    """Deprecated alias of interpolate (torch keeps it)."""
    return interpolate(input, size, scale_factor, mode, align_corners)


def upsample_nearest(input: Tensor, size: Any = None, scale_factor: Any = None) -> Tensor:  # noqa: A002
    """Deprecated: interpolate(..., mode='nearest')."""
    return interpolate(input, size, scale_factor, mode="nearest")


def upsample_bilinear(input: Tensor, size: Any = None, scale_factor: Any = None) -> Tensor:  # noqa: A002
    """Deprecated: interpolate(..., mode='bilinear', align_corners=True)."""
    return interpolate(input, size, scale_factor, mode="bilinear", align_corners=True)


# --- modules ------------------------------------------------------------------------------------

class Upsample(Module):
    """Module form of interpolate, with torch's constructor arguments and repr."""

    def __init__(self, size: Any = None, scale_factor: Any = None, mode: str = "nearest",
                 align_corners: bool | None = None,
                 recompute_scale_factor: bool | None = None) -> None:
        super().__init__()
        self.name = type(self).__name__
        self.size = size
        if isinstance(scale_factor, tuple):
            self.scale_factor: Any = tuple(float(f) for f in scale_factor)
        else:
            self.scale_factor = float(scale_factor) if scale_factor else None
        self.mode = mode
        self.align_corners = align_corners
        self.recompute_scale_factor = recompute_scale_factor

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        """interpolate(input) with this module's settings."""
        return interpolate(input, self.size, self.scale_factor, self.mode, self.align_corners,
                           recompute_scale_factor=self.recompute_scale_factor)

    def extra_repr(self) -> str:
        """scale_factor (or size) and mode, as torch prints them."""
        if self.scale_factor is not None:
            info = "scale_factor=" + repr(self.scale_factor)
        else:
            info = "size=" + repr(self.size)
        return info + ", mode=" + repr(self.mode)


class UpsamplingNearest2d(Upsample):
    """Upsample with mode='nearest'."""

    def __init__(self, size: Any = None, scale_factor: Any = None) -> None:
        super().__init__(size, scale_factor, mode="nearest")


class UpsamplingBilinear2d(Upsample):
    """Upsample with mode='bilinear' and align_corners=True."""

    def __init__(self, size: Sequence[int] | int | None = None, scale_factor: Any = None) -> None:
        super().__init__(size, scale_factor, mode="bilinear", align_corners=True)
