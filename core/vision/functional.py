"""torchvision.transforms.functional's tensor kernels: images are (..., C, H, W) tensors.

Resize follows torchvision's tensor path: an integer image is computed in float32 and rounded
back (round half to even), a float image stays in its dtype, and the interpolation is torch's
`interpolate(..., align_corners=False)`:

- "nearest": source index floor(i * in / out) in float32, torch's legacy nearest;
- "bilinear" with antialias=False: source x = (i + 0.5) * in / out - 0.5 clamped at 0, its two
  neighbours weighted linearly, computed as torch does (across the width first, then the
  height, in the image's float dtype);
- "bilinear" with antialias=True (torchvision's default): torch's anti-aliased kernel, a
  triangle filter stretched by the downscaling factor (PIL's), as a matrix product per axis.

Everything is built from core's differentiable ops, so a float image's gradient flows back.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from shoal.core import dtypes
from shoal.core.ops import arith, linalg, shape
from shoal.core.ops._util import result, xp_of
from shoal.core.tensor import Tensor

_MODES = ("nearest", "bilinear")


def _check_image(img: Any, op: str) -> None:
    if not isinstance(img, Tensor):
        raise TypeError(f"{op}: img should be a Tensor, got {type(img).__name__}.")
    if img.ndim < 2:
        raise TypeError(f"{op}: tensor is not a torch image (it has {img.ndim} dimensions; an "
                        "image is (..., H, W)).")


def _size_pair(size: Any, op: str) -> tuple:
    if isinstance(size, int):
        return size, size
    if isinstance(size, (tuple, list)) and len(size) == 1:
        return size[0], size[0]
    if isinstance(size, (tuple, list)) and len(size) == 2:
        return tuple(size)
    raise ValueError(f"{op}: please provide only two dimensions (h, w) for size, got {size!r}.")


def normalize(tensor: Tensor, mean: Sequence[float], std: Sequence[float],
              inplace: bool = False) -> Tensor:
    """(tensor - mean) / std per channel of a float (..., C, H, W) image."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"img should be Tensor Image. Got {type(tensor)}")
    if not tensor.is_floating_point():
        raise TypeError(f"Input tensor should be a float tensor. Got {tensor.dtype!r}.")
    if tensor.ndim < 3:
        raise ValueError("Expected tensor to be a tensor image of size (..., C, H, W). Got "
                         f"tensor.size() = {tuple(tensor.shape)}")
    dt = tensor.array.dtype
    xp = xp_of(tensor.array)
    m = xp.asarray(mean, dtype=dt).reshape(-1, 1, 1)
    s = xp.asarray(std, dtype=dt).reshape(-1, 1, 1)
    if (s == 0).any():
        raise ValueError(f"std evaluated to zero after conversion to {tensor.dtype!r}, leading "
                         "to division by zero.")
    if inplace:
        tensor.array -= m
        tensor.array /= s
        return tensor
    return arith.div(arith.sub(tensor, Tensor(m)), Tensor(s))


def hflip(img: Tensor) -> Tensor:
    """The image mirrored left to right."""
    _check_image(img, "hflip")
    return shape.getitem(img, (Ellipsis, slice(None, None, -1)))


def vflip(img: Tensor) -> Tensor:
    """The image mirrored top to bottom."""
    _check_image(img, "vflip")
    return shape.getitem(img, (Ellipsis, slice(None, None, -1), slice(None)))


def crop(img: Tensor, top: int, left: int, height: int, width: int) -> Tensor:
    """The (height, width) window at (top, left); zero-padded where it leaves the image."""
    _check_image(img, "crop")
    h, w = img.shape[-2:]
    right, bottom = left + width, top + height
    if left < 0 or top < 0 or right > w or bottom > h:
        pads = (max(-left, 0), max(right - w, 0), max(-top, 0), max(bottom - h, 0))
        img = pad(img, pads)
        top, left = max(top, 0), max(left, 0)
    return shape.getitem(img, (Ellipsis, slice(top, top + height), slice(left, left + width)))


def pad(img: Tensor, padding_lrtb: Sequence[int], fill: float = 0) -> Tensor:
    """The image with (left, right, top, bottom) borders of `fill` (constant padding)."""
    left, right, top, bottom = padding_lrtb
    h, w = img.shape[-2:]
    xp = xp_of(img.array)
    out = xp.full(img.shape[:-2] + (h + top + bottom, w + left + right), fill,
                  dtype=img.array.dtype)
    canvas = Tensor(out)
    window = (Ellipsis, slice(top, top + h), slice(left, left + w))
    if not img.requires_grad:
        out[window] = img.array
        return canvas
    return _place(img, canvas, window)  # differentiable: the gradient is the window


def _place(img: Tensor, canvas: Tensor, window: tuple) -> Tensor:
    """canvas with img written into window, as an op with img's gradient the window's."""
    out = canvas.array.copy()
    out[window] = img.array

    def backward(g: Any) -> tuple:
        return (g[window],)

    return result(out, "PadBackward", backward, (img,), exact_dtype=True)


def center_crop(img: Tensor, output_size: Any) -> Tensor:
    """The central (h, w) window (torchvision's rounding); padded with zeros when larger."""
    _check_image(img, "center_crop")
    crop_h, crop_w = _size_pair(output_size, "center_crop")
    h, w = img.shape[-2:]
    if crop_w > w or crop_h > h:
        pads = ((crop_w - w) // 2 if crop_w > w else 0, (crop_w - w + 1) // 2 if crop_w > w else 0,
                (crop_h - h) // 2 if crop_h > h else 0, (crop_h - h + 1) // 2 if crop_h > h else 0)
        img = pad(img, pads)
        h, w = img.shape[-2:]
        if crop_w == w and crop_h == h:
            return img
    top = int(round((h - crop_h) / 2.0))
    left = int(round((w - crop_w) / 2.0))
    return crop(img, top, left, crop_h, crop_w)


def resized_output_size(image_size: tuple, size: Any, max_size: int | None = None) -> list:
    """torchvision's output (h, w): an int (or one-element list) sets the smaller edge and keeps
    the aspect ratio (the longer edge truncated), bounded by max_size; a pair is (h, w)."""
    h, w = image_size
    if isinstance(size, (list, tuple)) and len(size) == 2:
        if max_size is not None:
            raise ValueError(
                "max_size should only be passed if size specifies the length of the smaller "
                f"edge, i.e. size should be an int or a sequence of length 1 in torchscript "
                f"mode, got size={size!r}.")
        return [size[0], size[1]]
    requested = size if isinstance(size, int) else size[0]
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = requested, int(requested * long / short)
    if max_size is not None:
        if max_size <= requested:
            raise ValueError(f"max_size = {max_size} must be strictly greater than the requested "
                             f"size for the smaller edge size (size = {size})")
        if new_long > max_size:
            new_short, new_long = int(max_size * new_short / new_long), max_size
    return [new_long, new_short] if w <= h else [new_short, new_long]


def resize(img: Tensor, size: Any, interpolation: str = "bilinear", max_size: int | None = None,
           antialias: bool | None = True) -> Tensor:
    """The image resized to `size` (see resized_output_size) with torchvision's tensor kernel."""
    _check_image(img, "resize")
    interpolation = getattr(interpolation, "value", interpolation)
    if interpolation not in _MODES:
        raise ValueError(f"resize: interpolation must be one of {_MODES}, got {interpolation!r}.")
    h, w = img.shape[-2:]
    out_h, out_w = resized_output_size((h, w), size, max_size)
    if (out_h, out_w) == (h, w):
        return img
    if out_h < 1 or out_w < 1:
        raise ValueError(f"resize: the output size ({out_h}, {out_w}) must be positive.")
    integer = not img.is_floating_point()
    work = img.to(dtypes.float32) if integer else img
    if interpolation == "nearest":
        out = _nearest(work, out_h, out_w)
    elif antialias and (out_h < h or out_w < w):
        out = _bilinear_aa(work, out_h, out_w)
    else:
        out = _bilinear(work, out_h, out_w)
    if integer:
        # torchvision's _cast_squeeze_out: round half to even, then cast (bilinear stays in
        # [0, max] as a convex combination, so no clamp is needed).
        arr = np.round(out.array) if isinstance(out.array, np.ndarray) else out.array.round()
        return Tensor(arr.astype(img.array.dtype))
    return out


def _nearest_index(n_in: int, n_out: int) -> np.ndarray:
    if n_out == n_in:
        return np.arange(n_out)
    if n_out == 2 * n_in:
        return np.arange(n_out) >> 1
    scale = np.float32(n_in) / np.float32(n_out)
    idx = np.floor(np.arange(n_out, dtype=np.float32) * scale).astype(np.int64)
    return np.minimum(idx, n_in - 1)


def _nearest(img: Tensor, out_h: int, out_w: int) -> Tensor:
    h, w = img.shape[-2:]
    rows = _nearest_index(h, out_h)
    cols = _nearest_index(w, out_w)
    wide = shape.getitem(img, (Ellipsis, cols))
    return shape.getitem(wide, (Ellipsis, rows, slice(None)))


def _linear_taps(n_in: int, n_out: int, dt: np.dtype) -> tuple:
    """(index0, index1, lambda0, lambda1) of torch's align_corners=False linear interpolation,
    with torch's weights in the image's float dtype. torch's vectorised kernel then fuses the
    multiply-adds (FMA) in an order that depends on its code path, so sums can differ from
    core's in the last bit (a few 1e-8 relative in float32)."""
    scale = dt.type(n_in) / dt.type(n_out)
    # torch: a float scale times (i + 0.5), a double, so the source index is computed in
    # double and rounded once to the image's dtype.
    src = (np.float64(scale) * (np.arange(n_out) + 0.5) - 0.5).astype(dt)
    src = np.maximum(src, dt.type(0))
    i0 = src.astype(np.int64)
    lam1 = np.clip(src - i0.astype(dt), 0, 1).astype(dt)
    i1 = i0 + (i0 < n_in - 1)
    return i0, i1, (1 - lam1).astype(dt), lam1


def _bilinear(img: Tensor, out_h: int, out_w: int) -> Tensor:
    h, w = img.shape[-2:]
    dt = img.array.dtype
    xp = xp_of(img.array)
    c0, c1, cw0, cw1 = (xp.asarray(a) for a in _linear_taps(w, out_w, dt))
    r0, r1, rw0, rw1 = (xp.asarray(a) for a in _linear_taps(h, out_h, dt))
    # torch's order: w0 * x[., c0] + w1 * x[., c1] within each row, then the same across rows.
    across = arith.add(arith.mul(shape.getitem(img, (Ellipsis, c0)), Tensor(cw0)),
                       arith.mul(shape.getitem(img, (Ellipsis, c1)), Tensor(cw1)))
    top = shape.getitem(across, (Ellipsis, r0, slice(None)))
    bottom = shape.getitem(across, (Ellipsis, r1, slice(None)))
    return arith.add(arith.mul(top, Tensor(rw0[:, None])), arith.mul(bottom, Tensor(rw1[:, None])))


def _aa_weights(n_in: int, n_out: int, dt: np.dtype) -> np.ndarray:
    """torch's anti-aliased linear weights (n_out, n_in): a triangle filter whose support grows
    with the downscaling factor, each row normalised to sum 1."""
    scale = n_in / n_out
    support = scale if scale >= 1.0 else 1.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    weights = np.zeros((n_out, n_in), dtype=np.float64)
    for i in range(n_out):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), n_in)
        x = (np.arange(lo, hi) - center + 0.5) * invscale
        tap = np.maximum(1.0 - np.abs(x), 0.0)
        total = tap.sum()
        weights[i, lo:hi] = tap / total if total != 0 else tap
    return weights.astype(dt)


def _bilinear_aa(img: Tensor, out_h: int, out_w: int) -> Tensor:
    h, w = img.shape[-2:]
    dt = img.array.dtype
    xp = xp_of(img.array)
    across = linalg.matmul(img, Tensor(xp.asarray(_aa_weights(w, out_w, dt).T)))
    return linalg.matmul(Tensor(xp.asarray(_aa_weights(h, out_h, dt))), across)


def convert_image_dtype(image: Tensor, dtype: Any = dtypes.float32) -> Tensor:
    """torchvision's dtype conversion: integers scale by the type's maximum, floats are in
    [0, 1]; integer to integer shifts bits, float to integer scales by max + 1 - 1e-3."""
    if not isinstance(image, Tensor):
        raise TypeError("Input img should be Tensor Image")
    target = dtypes.get(dtype)
    src = image.dtype
    if src is target:
        return image
    if src.is_floating_point:
        if target.is_floating_point:
            return image.to(target)
        if (src is dtypes.float32 and target in (dtypes.int32, dtypes.int64)) or (
                src is dtypes.float64 and target is dtypes.int64):
            raise RuntimeError(f"The cast from torch.{src.name} to torch.{target.name} cannot "
                               "be performed safely.")
        # 1 - eps keeps 1.0 at max and spreads [0, 1) evenly over the integer values.
        return arith.mul(image, _max_value(target) + 1.0 - 1e-3).to(target)
    input_max = _max_value(src)
    if target.is_floating_point:
        return arith.div(image.to(target), input_max)
    output_max = _max_value(target)
    if input_max > output_max:
        factor = (input_max + 1) // (output_max + 1)
        return Tensor((image.array // factor).astype(target.np))
    factor = (output_max + 1) // (input_max + 1)
    return Tensor(image.array.astype(target.np) * target.np.type(factor))


def _max_value(dt: dtypes.DType) -> int:
    if dt is dtypes.bool_:
        return 1
    return int(np.iinfo(dt.np).max)

