"""Convolutions (conv1d, conv2d) as im2col plus one matrix product, each a single graph node.

The input is padded once (channels-last) and viewed as windows with `as_strided` (no copy);
the windows are laid out as rows of a (N*Ho*Wo, kh*kw*C) matrix, the single copy of the
forward pass, and one GEMM with the (O, kh*kw*C) weight gives the output. The backward pass runs the same two
GEMMs transposed and scatters the window gradients back with one strided add per kernel
position (kh*kw of them, never one per pixel).
"""

from __future__ import annotations

from typing import Any

from shoal.core.amp.autocast_mode import STATE as _AMP
from shoal.core.ops import _autocast
from shoal.core.errors import ShapeError
from shoal.core.ops._util import needs_grad, result, xp_of
from shoal.core.ops.norm import column_sums
from shoal.core.tensor import Tensor


def pair(value: Any, name: str, op: str) -> tuple[int, int]:
    """An int or a pair of ints as a pair (torch's _pair)."""
    if isinstance(value, int):
        return (value, value)
    out = tuple(value)
    if len(out) != 2 or not all(isinstance(v, int) for v in out):
        raise ValueError(f"{op}: {name} must be an int or a pair of ints, got {value!r}.")
    return out  # type: ignore[return-value]


def windows(xpad: Any, kh: int, kw: int, ho: int, wo: int, stride: tuple, dilation: tuple) -> Any:
    """A (N, C, Ho, Wo, kh, kw) strided view of every kernel window of a padded NCHW array."""
    xp = xp_of(xpad)
    sn, sc, sh, sw = xpad.strides
    return xp.lib.stride_tricks.as_strided(
        xpad,
        shape=(xpad.shape[0], xpad.shape[1], ho, wo, kh, kw),
        strides=(sn, sc, sh * stride[0], sw * stride[1], sh * dilation[0], sw * dilation[1]),
        writeable=False,
    )


def scatter_windows(
    gwin: Any, padded_shape: tuple, stride: tuple, dilation: tuple, dtype: Any
) -> Any:
    """The adjoint of `windows`: add each window position's gradient back into a padded array."""
    xp = xp_of(gwin)
    _, _, ho, wo, kh, kw = gwin.shape
    out = xp.zeros(padded_shape, dtype=dtype)
    for i in range(kh):
        r0 = i * dilation[0]
        for j in range(kw):
            c0 = j * dilation[1]
            out[:, :, r0 : r0 + stride[0] * (ho - 1) + 1 : stride[0],
                c0 : c0 + stride[1] * (wo - 1) + 1 : stride[1]] += gwin[:, :, :, :, i, j]
    return out


def windows_nhwc(
    xpad: Any, kh: int, kw: int, ho: int, wo: int, stride: tuple, dilation: tuple
) -> Any:
    """A (N, Ho, Wo, kh, kw, C) strided view of every kernel window of a padded NHWC array."""
    xp = xp_of(xpad)
    sn, sh, sw, sc = xpad.strides
    return xp.lib.stride_tricks.as_strided(
        xpad,
        shape=(xpad.shape[0], ho, wo, kh, kw, xpad.shape[3]),
        strides=(sn, sh * stride[0], sw * stride[1], sh * dilation[0], sw * dilation[1], sc),
        writeable=False,
    )


def scatter_windows_nhwc(
    gwin: Any, padded_shape: tuple, stride: tuple, dilation: tuple, dtype: Any
) -> Any:
    """The adjoint of `windows_nhwc`: one strided add per kernel position into an NHWC array."""
    xp = xp_of(gwin)
    _, ho, wo, kh, kw, _ = gwin.shape
    out = xp.zeros(padded_shape, dtype=dtype)
    for i in range(kh):
        r0 = i * dilation[0]
        for j in range(kw):
            c0 = j * dilation[1]
            out[:, r0 : r0 + stride[0] * (ho - 1) + 1 : stride[0],
                c0 : c0 + stride[1] * (wo - 1) + 1 : stride[1], :] += gwin[:, :, :, i, j, :]
    return out


def _input_grad_stride1(g: Any, wd: Any, pad: tuple, size: tuple, dil: tuple) -> Any:
    """dL/dx of a stride-1 convolution as one more im2col GEMM (a full convolution of the
    output gradient with the flipped kernel), cheaper than scattering kh*kw window gradients.

    g is (N, Ho, Wo, O) channels-last; returns (N, H, W, C) channels-last.
    """
    xp = xp_of(g)
    n, ho, wo, o = g.shape
    _, c, kh, kw = wd.shape
    eh, ew = dil[0] * (kh - 1), dil[1] * (kw - 1)
    gfull = xp.zeros((n, ho + 2 * eh, wo + 2 * ew, o), dtype=g.dtype)
    gfull[:, eh : eh + ho, ew : ew + wo, :] = g
    # Row y of the input sits at padded row y + pad[0]: start the windows there.
    cols = windows_nhwc(gfull[:, pad[0] :, pad[1] :, :], kh, kw, size[0], size[1], (1, 1), dil)
    flipped = wd[:, :, ::-1, ::-1].transpose(2, 3, 0, 1).reshape(kh * kw * o, c)
    return (cols.reshape(n * size[0] * size[1], kh * kw * o) @ flipped).reshape(n, size[0], size[1], c)


def _padding(padding: Any, kernel: tuple, stride: tuple, dilation: tuple, op: str) -> tuple:
    """((top, bottom), (left, right)) from an int, a pair, 'valid' or 'same' (torch's rules)."""
    if isinstance(padding, str):
        if padding == "valid":
            return ((0, 0), (0, 0))
        if padding != "same":
            raise ValueError(
                f"{op}: padding must be 'valid', 'same', an int or a pair of ints, got {padding!r}."
            )
        if stride != (1, 1):
            raise ValueError(f"{op}: padding='same' is not supported for strided convolutions.")
        out = []
        for k, d in zip(kernel, dilation):
            total = d * (k - 1)
            out.append((total // 2, total - total // 2))  # the odd pixel goes last, as torch
        return tuple(out)
    ph, pw = pair(padding, "padding", op)
    if ph < 0 or pw < 0:
        raise ValueError(f"{op}: padding must not be negative, got {padding!r}.")
    return ((ph, ph), (pw, pw))


def conv2d(
    input: Tensor,  # noqa: A002 - torch's name
    weight: Tensor,
    bias: Tensor | None = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
) -> Tensor:
    """2-D convolution (cross-correlation, as torch) over an (N, C, H, W) or (C, H, W) input."""
    if _AMP.active:
        input, weight, bias = _autocast.cast(  # noqa: A001 - torch's parameter name
            "conv2d", input, weight, bias)
    return _conv(input, weight, bias, stride, padding, dilation, groups, "conv2d", spatial=2)


def conv1d(
    input: Tensor,  # noqa: A002
    weight: Tensor,
    bias: Tensor | None = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
) -> Tensor:
    """1-D convolution over an (N, C, L) or (C, L) input: a conv2d of height 1."""
    if _AMP.active:
        input, weight, bias = _autocast.cast(  # noqa: A001 - torch's parameter name
            "conv1d", input, weight, bias)

    def one(v: Any, name: str) -> Any:
        if isinstance(v, str):
            return v
        if not isinstance(v, int):
            seq = tuple(v)
            if len(seq) != 1:
                raise ValueError(f"conv1d: {name} must be an int or a 1-tuple, got {v!r}.")
            v = seq[0]
        return (1 if name != "padding" else 0, v)

    return _conv(
        input, weight, bias, one(stride, "stride"), one(padding, "padding"),
        one(dilation, "dilation"), groups, "conv1d", spatial=1,
    )


def _conv(
    x: Tensor, weight: Tensor, bias: Tensor | None, stride: Any, padding: Any, dilation: Any,
    groups: int, op: str, spatial: int,
) -> Tensor:
    """The convolution conv1d and conv2d share (conv1d runs as a conv2d of height 1)."""
    xd, wd, st, dil, pads, (ho, wo) = _conv_geometry(
        x, weight, bias, stride, padding, dilation, groups, op, spatial)
    bd = None if bias is None else bias.array
    batched = x.array.ndim == spatial + 2
    n, c, h, w = xd.shape
    o, cg, kh, kw = wd.shape
    (pt, pb), (pl, pr) = pads
    xp = xp_of(xd)
    hp, wp = h + pt + pb, w + pl + pr
    # Channels-last throughout: the output, a (N*Ho*Wo, O) GEMM result, is returned as an NCHW
    # view of that NHWC memory, so the next conv's channels-last view of it costs nothing.
    cols = _im2col(xd, pads, (hp, wp), (kh, kw), (ho, wo), st, dil)
    og = o // groups
    k = cg * kh * kw
    rows = n * ho * wo
    taps = kh * kw
    if groups == 1:
        w2 = wd.transpose(0, 2, 3, 1).reshape(o, k)  # (O, kh, kw, C), matching the rows
        out2 = cols @ w2.T
    else:
        colsg = cols.reshape(rows, taps, groups, cg).transpose(2, 0, 1, 3).reshape(groups, rows, k)
        w2 = wd.reshape(groups, og, cg, kh, kw).transpose(0, 1, 3, 4, 2).reshape(groups, og, k)
        out2 = (colsg @ w2.transpose(0, 2, 1)).transpose(1, 0, 2).reshape(rows, o)
    if bd is not None:
        out2 += bd
    out = out2.reshape(n, ho, wo, o).transpose(0, 3, 1, 2)
    if spatial == 1:
        out = out[:, :, 0, :]
    if not batched:
        out = out[0]

    def backward(g: Any) -> tuple:
        if not batched:
            g = g[None]
        if spatial == 1:
            g = g[:, :, None, :]
        g2 = g.transpose(0, 2, 3, 1).reshape(rows, o)  # free when g is channels-last already
        gx = gw = gb = None
        if needs_grad(weight):
            if groups == 1:
                # (K, O) then transposed: as fast as g2.T @ cols for wide K, faster for K ~ 9.
                gw = (cols.T @ g2).T.reshape(o, kh, kw, cg).transpose(0, 3, 1, 2)
            else:
                g3 = g2.reshape(rows, groups, og).transpose(1, 2, 0)
                gw = (g3 @ colsg).reshape(groups, og, kh, kw, cg).transpose(0, 1, 4, 2, 3)
                gw = gw.reshape(o, cg, kh, kw)
            gw = xp.ascontiguousarray(gw)
            if spatial == 1:
                gw = gw[:, :, 0, :]
        if bias is not None and bias.requires_grad:
            gb = column_sums(g2) if g2.dtype.kind != "c" else g2.sum(axis=0)
        if needs_grad(x):
            if groups == 1 and st == (1, 1):
                gx = _input_grad_stride1(g2.reshape(n, ho, wo, o), wd, (pt, pl), (h, w), dil)
                gx = gx.transpose(0, 3, 1, 2)
                if spatial == 1:
                    gx = gx[:, :, 0, :]
                return (gx if batched else gx[0]), gw, gb
            if groups == 1:
                gcols = g2 @ w2
            else:
                g3 = g2.reshape(rows, groups, og).transpose(1, 0, 2)
                gcols = (g3 @ w2).reshape(groups, rows, taps, cg).transpose(1, 2, 0, 3)
            gwin = gcols.reshape(n, ho, wo, kh, kw, c)
            gpad = scatter_windows_nhwc(gwin, (n, hp, wp, c), st, dil, xd.dtype)
            gx = gpad[:, pt : pt + h, pl : pl + w, :].transpose(0, 3, 1, 2)
            if spatial == 1:
                gx = gx[:, :, 0, :]
            if not batched:
                gx = gx[0]
        return gx, gw, gb

    if out.dtype.kind == "c":
        backward = _conjugated(backward)
    return result(out, "ConvolutionBackward", backward, (x, weight, bias))


def _conjugated(backward: Any) -> Any:
    """torch's complex gradient of a bilinear op from its real formula: the formula sums g times
    the other operand, torch's sums g times its conjugate, which is conj(formula(conj(g)))."""

    def complex_backward(g: Any) -> tuple:
        return tuple(None if r is None else r.conj() for r in backward(g.conj()))

    return complex_backward


def _im2col(
    xd: Any, pads: tuple, padded: tuple, kernel: tuple, out_hw: tuple, st: tuple, dil: tuple
) -> Any:
    """The (N*Ho*Wo, kh*kw*C) matrix of every kernel window of NCHW `xd`, padded: a window row
    is kh*kw runs of C contiguous values (a fast gather from channels-last memory)."""
    (pt, pb), (pl, pr) = pads
    n, c, h, w = xd.shape
    x_nhwc = xd.transpose(0, 2, 3, 1)
    if pt or pb or pl or pr:
        xpad = xp_of(xd).zeros((n, padded[0], padded[1], c), dtype=xd.dtype)
        xpad[:, pt : pt + h, pl : pl + w, :] = x_nhwc
    else:
        xpad = x_nhwc
    ho, wo = out_hw
    view = windows_nhwc(xpad, kernel[0], kernel[1], ho, wo, st, dil)
    return view.reshape(n * ho * wo, kernel[0] * kernel[1] * c)


def _conv_geometry(
    x: Tensor, weight: Tensor, bias: Tensor | None, stride: Any, padding: Any, dilation: Any,
    groups: int, op: str, spatial: int,
) -> tuple:
    """The checked arguments of a convolution: the input and weight as 4-d NCHW and OIHW views,
    stride, dilation, ((top, bottom), (left, right)) padding and the output's (height, width)."""
    xd, wd = x.array, weight.array
    bd = None if bias is None else bias.array
    if xd.ndim not in (spatial + 1, spatial + 2) or wd.ndim != spatial + 2:
        raise ShapeError(
            f"{op}: expected a {spatial + 1}-d (unbatched) or {spatial + 2}-d input and a "
            f"{spatial + 2}-d weight, got input {tuple(xd.shape)} and weight {tuple(wd.shape)}."
        )
    if xd.ndim == spatial + 1:
        xd = xd[None]
    if spatial == 1:
        xd, wd = xd[:, :, None, :], wd[:, :, None, :]
    _, c, h, w = xd.shape
    o, cg, kh, kw = wd.shape
    if not isinstance(groups, int) or groups < 1 or c % groups or o % groups:
        raise ValueError(
            f"{op}: groups={groups!r} must be a positive int dividing both in_channels ({c}) "
            f"and out_channels ({o})."
        )
    if cg * groups != c:
        raise ShapeError(
            f"{op}: weight of shape {tuple(weight.shape)} expects {cg * groups} input channels "
            f"(groups={groups}), but the input of shape {tuple(x.shape)} has {c}."
        )
    if bd is not None and tuple(bd.shape) != (o,):
        raise ShapeError(f"{op}: bias of shape {tuple(bd.shape)} does not match {o} out channels.")
    st = pair(stride, "stride", op)
    dil = pair(dilation, "dilation", op)
    if min(st) < 1 or min(dil) < 1:
        raise ValueError(f"{op}: stride and dilation must be positive, got {stride!r}, {dilation!r}.")
    pads = _padding(padding, (kh, kw), st, dil, op)
    hp, wp = h + sum(pads[0]), w + sum(pads[1])
    ho = (hp - dil[0] * (kh - 1) - 1) // st[0] + 1
    wo = (wp - dil[1] * (kw - 1) - 1) // st[1] + 1
    if ho < 1 or wo < 1:
        raise ShapeError(
            f"{op}: the kernel (dilated size {dil[0] * (kh - 1) + 1}x{dil[1] * (kw - 1) + 1}) "
            f"is larger than the padded input ({hp}x{wp}) of shape {tuple(x.shape)}."
        )
    return xd, wd, st, dil, pads, (ho, wo)
