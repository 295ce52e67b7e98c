"""Pooling (max_pool2d, avg_pool2d, adaptive_avg_pool2d) over strided window views."""

from __future__ import annotations

from typing import Any

from shoal.core.errors import ShapeError
from shoal.core.ops._util import result, xp_of
from shoal.core.ops.conv import pair, scatter_windows, windows, windows_nhwc
from shoal.core.tensor import Tensor


def _geometry(xd: Any, kernel_size: Any, stride: Any, padding: Any, dilation: Any, op: str) -> tuple:
    if xd.ndim not in (3, 4):
        raise ShapeError(f"{op}: expected a 3-d or 4-d input, got shape {tuple(xd.shape)}.")
    k = pair(kernel_size, "kernel_size", op)
    st = k if stride is None or stride == [] or stride == () else pair(stride, "stride", op)
    pd = pair(padding, "padding", op)
    dil = pair(dilation, "dilation", op)
    if min(k) < 1 or min(st) < 1 or min(dil) < 1:
        raise ValueError(f"{op}: kernel_size, stride and dilation must be positive.")
    if pd[0] * 2 > k[0] or pd[1] * 2 > k[1]:
        raise ValueError(
            f"{op}: padding {pd} should be at most half of kernel size {k}."
        )
    h, w = xd.shape[-2:]
    ho = (h + 2 * pd[0] - dil[0] * (k[0] - 1) - 1) // st[0] + 1
    wo = (w + 2 * pd[1] - dil[1] * (k[1] - 1) - 1) // st[1] + 1
    if ho < 1 or wo < 1:
        raise ShapeError(f"{op}: the output would be empty for input shape {tuple(xd.shape)}.")
    return k, st, pd, dil, ho, wo


def max_pool2d(
    input: Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0,  # noqa: A002
    dilation: Any = 1, ceil_mode: bool = False, return_indices: bool = False,
) -> Tensor:
    """The maximum of each window (padding counts as -inf); the gradient goes to the first
    maximum in the window's row-major order, as torch's."""
    if ceil_mode or return_indices:
        raise NotImplementedError("max_pool2d: ceil_mode and return_indices are not supported.")
    xd = input.array
    k, st, pd, dil, ho, wo = _geometry(xd, kernel_size, stride, padding, dilation, "max_pool2d")
    xp = xp_of(xd)
    x4 = xd if xd.ndim == 4 else xd[None]
    n, c, h, w = x4.shape
    # Channels-last, one pass per kernel position over output-sized arrays: no window copy.
    x_nhwc = x4.transpose(0, 2, 3, 1)
    if pd != (0, 0):
        xpad = xp.full((n, h + 2 * pd[0], w + 2 * pd[1], c), -xp.inf, dtype=xd.dtype)
        xpad[:, pd[0] : pd[0] + h, pd[1] : pd[1] + w, :] = x_nhwc
    else:
        xpad = x_nhwc
    win = windows_nhwc(xpad, k[0], k[1], ho, wo, st, dil)
    taps = k[0] * k[1]
    # One pass per kernel position over output-sized arrays. `arg` keeps the first position
    # holding the maximum (a later one wins only when strictly greater, as torch): positions
    # count up, so the last one that beat the running maximum is the largest t with `better`.
    # Masked copies (copyto where=, arg[mask] = t, where) are several times slower here.
    best = win[:, :, :, 0, 0, :].copy()
    arg = xp.zeros(best.shape, dtype=xp.uint8 if taps <= 256 else xp.int32)
    for t in range(1, taps):
        tap = win[:, :, :, t // k[1], t % k[1], :]
        better = tap > best
        xp.maximum(best, tap, out=best)  # NaN propagates to the output, as torch's
        xp.maximum(arg, better * arg.dtype.type(t), out=arg)
    out = best.transpose(0, 3, 1, 2)
    if xd.ndim == 3:
        out = out[0]
    # Windows that never share an input pixel let each position write its slice outright.
    disjoint = all(kk == 1 or s >= d * (kk - 1) + 1 for kk, s, d in zip(k, st, dil))
    tiled = disjoint and pd == (0, 0) and dil == (1, 1) and st == k and (ho * k[0], wo * k[1]) == (h, w)

    def backward(g: Any) -> tuple:
        g4 = (g if g.ndim == 4 else g[None]).transpose(0, 2, 3, 1)
        # When the windows tile the input exactly every pixel is written below: skip the zeros.
        gpad = (xp.empty if tiled else xp.zeros)(xpad.shape, dtype=xd.dtype)
        for t in range(taps):
            i, j = divmod(t, k[1])
            r0, c0 = i * dil[0], j * dil[1]
            view = gpad[:, r0 : r0 + st[0] * (ho - 1) + 1 : st[0],
                        c0 : c0 + st[1] * (wo - 1) + 1 : st[1], :]
            if disjoint:
                xp.multiply(g4, arg == t, out=view)
            else:
                view += g4 * (arg == t)
        gx = gpad[:, pd[0] : pd[0] + h, pd[1] : pd[1] + w, :].transpose(0, 3, 1, 2)
        return (gx if xd.ndim == 4 else gx[0],)

    return result(out, "MaxPool2DBackward", backward, (input,))


def avg_pool2d(
    input: Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0,  # noqa: A002
    ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: int | None = None,
) -> Tensor:
    """The mean of each window; padded zeros count unless count_include_pad=False."""
    if ceil_mode:
        raise NotImplementedError("avg_pool2d: ceil_mode is not supported.")
    xd = input.array
    k, st, pd, dil, ho, wo = _geometry(xd, kernel_size, stride, padding, 1, "avg_pool2d")
    xp = xp_of(xd)
    x4 = xd if xd.ndim == 4 else xd[None]
    pads = ((0, 0), (0, 0), (pd[0], pd[0]), (pd[1], pd[1]))
    xpad = xp.pad(x4, pads) if pd != (0, 0) else x4
    sums = windows(xpad, k[0], k[1], ho, wo, st, dil).sum(axis=(4, 5))
    if divisor_override:
        divisor: Any = float(divisor_override)
    elif count_include_pad or pd == (0, 0):
        divisor = float(k[0] * k[1])
    else:
        ones = xp.pad(xp.ones((1, 1) + x4.shape[2:], dtype=xd.dtype), pads)
        divisor = windows(ones, k[0], k[1], ho, wo, st, dil).sum(axis=(4, 5))
    out = sums / divisor
    if xd.ndim == 3:
        out = out[0]

    def backward(g: Any) -> tuple:
        g4 = (g if g.ndim == 4 else g[None]) / divisor
        gwin = xp.broadcast_to(g4[..., None, None], g4.shape + k)
        gpad = scatter_windows(gwin, xpad.shape, st, dil, xd.dtype)
        gx = gpad[:, :, pd[0] : pd[0] + x4.shape[2], pd[1] : pd[1] + x4.shape[3]]
        return (gx if xd.ndim == 4 else gx[0],)

    return result(out, "AvgPool2DBackward", backward, (input,))


def adaptive_avg_pool2d(input: Tensor, output_size: Any) -> Tensor:  # noqa: A002
    """Average over the bins torch uses: rows floor(i*H/oh) to ceil((i+1)*H/oh)."""
    xd = input.array
    if xd.ndim not in (3, 4):
        raise ShapeError(f"adaptive_avg_pool2d: expected a 3-d or 4-d input, got {tuple(xd.shape)}.")
    h, w = xd.shape[-2:]
    if isinstance(output_size, int):
        output_size = (output_size, output_size)
    oh, ow = (h if output_size[0] is None else output_size[0],
              w if output_size[1] is None else output_size[1])
    xp = xp_of(xd)
    rows = [(i * h // oh, -(-(i + 1) * h // oh)) for i in range(oh)]
    cols = [(j * w // ow, -(-(j + 1) * w // ow)) for j in range(ow)]
    out = xp.empty(xd.shape[:-2] + (oh, ow), dtype=xd.dtype)
    # One mean per output cell: outputs are small (1x1 to 7x7), inputs arbitrary.
    for i, (r0, r1) in enumerate(rows):
        for j, (c0, c1) in enumerate(cols):
            out[..., i, j] = xd[..., r0:r1, c0:c1].mean(axis=(-2, -1))

    def backward(g: Any) -> tuple:
        if oh == 1 and ow == 1:
            # Global pooling: every pixel gets its channel's share, a broadcast view (no copy).
            return (xp.broadcast_to(g / (h * w), xd.shape),)
        # zeros_like keeps the input's memory layout (channels-last stays channels-last), so
        # the ops upstream see their own layout and need no copy.
        gx = xp.zeros_like(xd)
        for i, (r0, r1) in enumerate(rows):
            for j, (c0, c1) in enumerate(cols):
                gx[..., r0:r1, c0:c1] += (g[..., i, j] / ((r1 - r0) * (c1 - c0)))[..., None, None]
        return (gx,)

    return result(out, "AdaptiveAvgPool2DBackward", backward, (input,))
