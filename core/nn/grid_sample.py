"""torch.nn.functional.grid_sample (2-D: bilinear, nearest and bicubic; 3-D: trilinear and
nearest; zeros, border and reflection padding) and affine_grid (2-D and 3-D), with gradients
for the input and the grid.

grid_sample reads each output pixel from the input at a point of the grid ((x, y[, z]) in
[-1, 1]), as a weighted sum of a few taps, the product of each axis's (linear 2 per axis,
cubic 4, nearest 1). The taps and their
weights follow aten's GridSampler.h: the point is unnormalised (align_corners decides whether
-1 and 1 are the corner pixels' centres or their outer edges), border and reflection padding
move it into the image (bicubic moves each tap instead), and a tap outside the image reads 0.
The input's gradient scatters the output's gradient back onto the taps; the grid's is the
weights' derivative along x and y times the taps' values, through the padding's derivative.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.core.determinism import alert_not_deterministic
from shoal.core.ops import creation
from shoal.core.ops._util import result, xp_of
from shoal.core.tensor import Tensor

__all__ = ["grid_sample", "affine_grid"]

_MODES = ("bilinear", "nearest", "bicubic")
_PADDINGS = ("zeros", "border", "reflection")
_CUBIC_A = -0.75


def _unnormalise(coord: Any, size: int, align_corners: bool) -> tuple:
    """Pixel coordinate of a normalised one, and its derivative."""
    if align_corners:
        return (coord + 1) * ((size - 1) / 2), (size - 1) / 2
    return ((coord + 1) * size - 1) / 2, size / 2


def _clip(xp: Any, ix: Any, size: int) -> tuple:
    """Clamp into [0, size - 1]; the derivative is 0 at and beyond either end (aten's)."""
    inside = (ix > 0) & (ix < size - 1)
    return xp.clip(ix, 0, size - 1), inside.astype(ix.dtype)


def _reflect(xp: Any, ix: Any, twice_low: int, twice_high: int) -> tuple:
    """Reflect into [twice_low / 2, twice_high / 2] as often as needed, and the sign (+-1)."""
    if twice_low == twice_high:
        return xp.zeros_like(ix), xp.zeros_like(ix)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    shifted = ix - low
    sign = xp.where(shifted < 0, -1.0, 1.0).astype(ix.dtype)
    shifted = xp.abs(shifted)
    extra = xp.fmod(shifted, span)
    even = (xp.floor(shifted / span).astype(np.int64) % 2) == 0
    return xp.where(even, extra + low, span - extra + low), xp.where(even, sign, -sign)


def _pad_coordinate(xp: Any, ix: Any, size: int, padding: str, align_corners: bool) -> tuple:
    """The coordinate border or reflection padding reads from, and its derivative."""
    if padding == "border":
        return _clip(xp, ix, size)
    if padding == "reflection":
        bounds = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
        ix, d_reflect = _reflect(xp, ix, *bounds)
        ix, d_clip = _clip(xp, ix, size)
        return ix, d_reflect * d_clip
    return ix, xp.ones_like(ix)


def _cubic_weights(xp: Any, t: Any) -> tuple:
    """Keys' cubic weights for the 4 taps at offsets -1..2 from floor, and their d/dt."""
    a = _CUBIC_A

    def near(x: Any) -> tuple:
        return ((a + 2) * x - (a + 3)) * x * x + 1, (3 * (a + 2) * x - 2 * (a + 3)) * x

    def far(x: Any) -> tuple:
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a, (3 * a * x - 10 * a) * x + 8 * a

    (w0, d0), (w1, d1) = far(t + 1), near(t)
    (w2, d2), (w3, d3) = near(1 - t), far(2 - t)
    return [w0, w1, w2, w3], [d0, d1, -d2, -d3]


def _axis_choices(xp: Any, coord: Any, size: int, mode: str, padding: str,
                  align_corners: bool) -> list:
    """(position, weight, d weight / d coord) for each tap along one axis."""
    if mode == "nearest":
        return [(xp.rint(coord).astype(np.int64), xp.ones_like(coord), xp.zeros_like(coord))]
    low = xp.floor(coord)
    if mode == "bilinear":
        return [(low.astype(np.int64), low + 1 - coord, -xp.ones_like(coord)),
                ((low + 1).astype(np.int64), coord - low, xp.ones_like(coord))]
    weights, derivs = _cubic_weights(xp, coord - low)
    # bicubic pads each tap's integer position, not the point (aten's get_value_bounded)
    return [(_pad_coordinate(xp, low - 1 + k, size, padding, align_corners)[0].astype(np.int64),
             weights[k], derivs[k]) for k in range(4)]


def _taps(per_axis: list) -> list:
    """Every combination of the axes' taps: (positions, weight, d weight / d coord per axis),
    the weight the product of the axes' weights."""
    taps = [((), 1.0, ())]
    for choices in per_axis:
        grown = []
        for positions, weight, derivs in taps:
            for pos, w_axis, d_axis in choices:
                grown.append((positions + (pos,), weight * w_axis,
                              tuple(d * w_axis for d in derivs) + (weight * d_axis,)))
        taps = grown
    return taps


def _check(input: Tensor, grid: Tensor, mode: str, padding_mode: str) -> None:  # noqa: A002
    if mode not in _MODES:
        raise ValueError(f"nn.functional.grid_sample(): expected mode to be 'bilinear', "
                         f"'nearest' or 'bicubic', but got: '{mode}'")
    if padding_mode not in _PADDINGS:
        raise ValueError(f"nn.functional.grid_sample(): expected padding_mode to be 'zeros', "
                         f"'border', or 'reflection', but got: '{padding_mode}'")
    if input.shape[0] != grid.shape[0]:
        raise RuntimeError(f"grid_sampler(): expected grid and input to have same batch size, "
                           f"but got input with sizes {list(input.shape)} and grid with sizes "
                           f"{list(grid.shape)}")
    if grid.shape[-1] != input.ndim - 2:
        raise RuntimeError(f"grid_sampler(): expected grid to have size {input.ndim - 2} in "
                           f"last dimension, but got grid with sizes {list(grid.shape)}")
    if input.ndim not in (4, 5) or grid.ndim != input.ndim:
        raise RuntimeError(f"grid_sampler(): expected 4D or 5D input and grid with same number "
                           f"of dimensions, but got input with sizes {list(input.shape)} and "
                           f"grid with sizes {list(grid.shape)}")
    if input.dtype != grid.dtype:
        raise RuntimeError(f"grid_sampler(): expected input and grid to have the same dtype, "
                           f"got {input.dtype} and {grid.dtype}")
    if mode == "bicubic" and input.ndim != 4:
        raise RuntimeError("grid_sampler(): bicubic interpolation only supports 4D input")


def grid_sample(input: Tensor, grid: Tensor, mode: str = "bilinear",  # noqa: A002
                padding_mode: str = "zeros", align_corners: bool | None = None) -> Tensor:
    """Sample (N, C, H, W) input at the (N, Ho, Wo, 2) grid's (x, y) points into
    (N, C, Ho, Wo), or (N, C, D, H, W) at (N, Do, Ho, Wo, 3) (x, y, z) points; 'bilinear' is
    trilinear for 5-D inputs."""
    _check(input, grid, mode, padding_mode)
    xd, gd = input.array, grid.array
    xp = xp_of(xd)
    n, c = xd.shape[:2]
    sizes = xd.shape[:1:-1]  # (W, H[, D]): the grid's last dimension lists x first
    corners = bool(align_corners)
    coords, scales = [], []
    for a, size in enumerate(sizes):
        coord, scale = _unnormalise(gd[..., a], size, corners)
        if mode != "bicubic":  # bicubic pads its taps instead
            coord, d_pad = _pad_coordinate(xp, coord, size, padding_mode, corners)
            scale = scale * d_pad
        coords.append(coord)
        scales.append(scale)
    taps = _taps([_axis_choices(xp, coord, size, mode, padding_mode, corners)
                  for coord, size in zip(coords, sizes)])
    flat = xd.reshape(n, c, -1)
    points = int(np.prod(gd.shape[1:-1]))
    strides = np.cumprod((1,) + tuple(sizes[:-1]))
    reads = []  # (linear index, weight with out-of-image taps zeroed, value) per tap
    for positions, weight, _ in taps:
        inside = xp.ones(positions[0].shape, dtype=bool)
        for pos, size in zip(positions, sizes):
            inside &= (pos >= 0) & (pos < size)
        lin = sum(pos * int(st) for pos, st in zip(positions, strides))
        lin = xp.where(inside, lin, 0).reshape(n, 1, points)
        inside = inside.reshape(n, 1, points)
        value = xp.take_along_axis(flat, lin, axis=2) * inside
        reads.append((lin, weight.reshape(n, 1, points) * inside, value))
    out = sum(wt * value for _, wt, value in reads).reshape((n, c) + gd.shape[1:-1])

    def backward(g: Any) -> tuple:
        g3 = g.reshape(n, c, points)
        gx = _scatter_input(xp, g3, reads, flat.shape).reshape(xd.shape) \
            if input.requires_grad else None
        gg = None
        if grid.requires_grad:
            along = [(g3 * value).sum(1) for _, _, value in reads]  # d loss / d tap weight
            gg = xp.stack([
                sum(a_t * tap[2][a].reshape(n, points) for a_t, tap in zip(along, taps))
                .reshape(gd.shape[:-1]) * scales[a] for a in range(len(sizes))], -1)
        return gx, gg

    return result(out, "GridSamplerBackward", backward, (input, grid))


def _scatter_input(xp: Any, g3: Any, reads: list, shape: tuple) -> Any:
    """The input's gradient: each tap's share of the output gradient added at its pixel (taps
    outside the image carry weight 0)."""
    n, c, pixels = shape
    rows = (xp.arange(n * c) * pixels).reshape(n, c, 1)
    index = xp.concatenate([xp.broadcast_to(rows + lin, g3.shape).ravel() for lin, _, _ in reads])
    weights = xp.concatenate([(g3 * wt).ravel() for _, wt, _ in reads])
    if xp is not np:
        alert_not_deterministic("grid_sample's backward on cuda (a scatter-add)")
    return xp.bincount(index, weights, minlength=n * c * pixels).astype(g3.dtype, copy=False)


def affine_grid(theta: Tensor, size: Any, align_corners: bool | None = None) -> Tensor:
    """The sampling grid of a batch of affine maps: (N, H, W, 2) for theta (N, 2, 3) and size
    (N, C, H, W), or (N, D, H, W, 3) for theta (N, 3, 4) and size (N, C, D, H, W)."""
    size = [int(s) for s in size]
    spatial = size[2:]
    rows = len(spatial)
    if rows not in (2, 3):
        raise NotImplementedError(f"affine_grid only supports 4D and 5D sizes, for 2D and 3D "
                                  f"affine transforms, respectively. Got size {tuple(size)}.")
    if theta.ndim != 3 or tuple(theta.shape[1:]) != (rows, rows + 1):
        raise ValueError(f"Expected a batch of {rows}D affine matrices of shape "
                         f"Nx{rows}x{rows + 1} for size {tuple(size)}. Got {list(theta.shape)}.")
    if min(spatial) <= 0:
        raise ValueError(f"Expected non-zero, positive output size. Got {size}")
    dtype = theta.array.dtype
    axes = []
    for steps in reversed(spatial):  # x (width) first, as the grid's last dimension is (x, y[, z])
        line = np.linspace(-1.0, 1.0, steps) if steps > 1 else np.zeros(1)
        axes.append(line if align_corners or steps == 1 else line * (steps - 1) / steps)
    mesh = np.meshgrid(*axes[::-1], indexing="ij")  # each spatial-shaped, slowest axis first
    base = np.stack([m for m in mesh[::-1]] + [np.ones(spatial)], -1).astype(dtype)
    base_t = creation.tensor(base.reshape(1, -1, rows + 1), device=theta.device)
    grid = base_t @ theta.transpose(1, 2)
    return grid.reshape(size[0], *spatial, rows)
