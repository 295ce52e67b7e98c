"""Convolutions over any number of spatial dims as im2col plus one matrix product, and conv3d.

conv1d and conv2d keep their own tuned 2-d path (core/ops/conv.py); this module holds the same
machinery for N spatial dims, channels-last throughout: a padded (N, *S, C) array is viewed as
its (N, *O, *K, C) kernel windows with `as_strided` (no copy), the windows become the rows of
one (N*prod(O), prod(K)*C) matrix, and one GEMM with the weight gives the output. The adjoints
are the same GEMMs transposed plus one strided add per kernel position (`scatter_windows`), so
conv_transpose (core/ops/conv_transpose.py), the input gradient of a convolution, reuses them.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Any

from shoal.core.amp.autocast_mode import STATE as _AMP
from shoal.core.errors import ShapeError
from shoal.core.ops import _autocast
from shoal.core.ops._util import needs_grad, result, xp_of
from shoal.core.ops.conv import _conjugated
from shoal.core.ops.norm import column_sums
from shoal.core.tensor import Tensor


def ntuple(value: Any, n: int, name: str, op: str) -> tuple:
    """An int or n ints as an n-tuple (torch's _ntuple), or a ShapeError naming it.

    Bad geometry is a ShapeError throughout: torch raises RuntimeError, and ShapeError is one
    (and a ValueError, as the older conv1d/conv2d raise)."""
    try:
        return (operator.index(value),) * n  # numpy ints too, as torch takes them
    except TypeError:
        pass
    try:
        out = tuple(operator.index(v) for v in value)
    except TypeError:
        out = ()
    if len(out) != n:
        raise ShapeError(f"{op}: {name} must be an int or a tuple of {n} ints, got {value!r}.")
    return out


def windows(xpad: Any, kernel: tuple, out_sp: tuple, stride: tuple, dilation: tuple) -> Any:
    """A (N, *O, *K, C) strided view of every kernel window of a padded (N, *S, C) array."""
    strides = xpad.strides
    inner = strides[1:-1]
    return xp_of(xpad).lib.stride_tricks.as_strided(
        xpad,
        shape=(xpad.shape[0],) + tuple(out_sp) + tuple(kernel) + (xpad.shape[-1],),
        strides=((strides[0],) + tuple(s * t for s, t in zip(inner, stride))
                 + tuple(s * d for s, d in zip(inner, dilation)) + (strides[-1],)),
        writeable=False,
    )


def scatter_windows(gwin: Any, padded_shape: tuple, stride: tuple, dilation: tuple) -> Any:
    """The adjoint of `windows`: each kernel position's (N, *O, C) gradient added back into a
    zero (N, *S, C) array with one strided add (prod(K) adds, never one per pixel)."""
    sp = len(stride)
    out_sp, kernel = gwin.shape[1 : 1 + sp], gwin.shape[1 + sp : 1 + 2 * sp]
    out = xp_of(gwin).zeros(padded_shape, dtype=gwin.dtype)
    everything = slice(None)
    for tap in itertools.product(*(range(k) for k in kernel)):
        region = tuple(
            slice(t * d, t * d + s * (o - 1) + 1, s)
            for t, d, s, o in zip(tap, dilation, stride, out_sp))
        out[(everything,) + region + (everything,)] += gwin[(everything,) * (1 + sp) + tap]
    return out


def im2col(x_cl: Any, pads: tuple, kernel: tuple, out_sp: tuple, stride: tuple,
           dilation: tuple) -> Any:
    """The (N*prod(O), prod(K)*C) matrix of every window of channels-last `x_cl`, zero-padded
    by `pads` ((low, high) per spatial dim): each row is prod(K) runs of C contiguous values."""
    n, c = x_cl.shape[0], x_cl.shape[-1]
    if any(lo or hi for lo, hi in pads):
        padded = tuple(s + lo + hi for s, (lo, hi) in zip(x_cl.shape[1:-1], pads))
        xpad = xp_of(x_cl).zeros((n,) + padded + (c,), dtype=x_cl.dtype)
        inner = tuple(slice(lo, lo + s) for s, (lo, _) in zip(x_cl.shape[1:-1], pads))
        xpad[(slice(None),) + inner + (slice(None),)] = x_cl
    else:
        xpad = x_cl
    view = windows(xpad, kernel, out_sp, stride, dilation)
    return view.reshape(n * math.prod(out_sp), math.prod(kernel) * c)


def weight_matrix(wd: Any, groups: int) -> Any:
    """The (O, *K, Cg) weight as an (O, prod(K)*Cg) matrix matching im2col's rows, or one
    (Og, prod(K)*Cg) matrix per group stacked as (G, Og, prod(K)*Cg)."""
    o, cg = wd.shape[:2]
    sp = wd.ndim - 2
    cl = wd.transpose((0,) + tuple(range(2, 2 + sp)) + (1,))
    if groups == 1:
        return cl.reshape(o, -1)
    return cl.reshape(groups, o // groups, -1)


def _grouped_cols(cols: Any, groups: int, taps: int) -> Any:
    """im2col's (rows, taps*C) matrix split per group: (G, rows, taps*Cg)."""
    rows = cols.shape[0]
    cg = cols.shape[1] // (taps * groups)
    return cols.reshape(rows, taps, groups, cg).transpose(2, 0, 1, 3).reshape(groups, rows, -1)


def apply_weight(cols: Any, w2: Any, groups: int, taps: int) -> Any:
    """The (rows, O) convolution output of im2col's matrix and `weight_matrix`'s result."""
    if groups == 1:
        return cols @ w2.T
    out = _grouped_cols(cols, groups, taps) @ w2.transpose(0, 2, 1)  # (G, rows, Og)
    return out.transpose(1, 0, 2).reshape(cols.shape[0], -1)


def window_grads(g2: Any, w2: Any, groups: int, taps: int) -> Any:
    """The adjoint of `apply_weight` in the windows: (rows, O) gradient to (rows, taps*C)."""
    if groups == 1:
        return g2 @ w2
    rows = g2.shape[0]
    g3 = g2.reshape(rows, groups, -1).transpose(1, 0, 2)  # (G, rows, Og)
    gcols = (g3 @ w2).reshape(groups, rows, taps, -1).transpose(1, 2, 0, 3)
    return gcols.reshape(rows, -1)


def weight_grad(cols: Any, g2: Any, groups: int, wshape: tuple) -> Any:
    """dL/dweight, (O, Cg, *K), from im2col's matrix and the (rows, O) output gradient."""
    o, cg = wshape[:2]
    kernel = tuple(wshape[2:])
    sp, taps = len(kernel), math.prod(kernel)
    to_oik = (0, sp + 1) + tuple(range(1, sp + 1))  # (O, *K, Cg) -> (O, Cg, *K)
    if groups == 1:
        # (K, O) then transposed: as fast as g2.T @ cols for wide K, faster for narrow K.
        gw = (cols.T @ g2).T.reshape((o,) + kernel + (cg,)).transpose(to_oik)
    else:
        g3 = g2.reshape(g2.shape[0], groups, -1).transpose(1, 2, 0)  # (G, Og, rows)
        gw = (g3 @ _grouped_cols(cols, groups, taps)).reshape((o,) + kernel + (cg,))
        gw = gw.transpose(to_oik)
    return xp_of(gw).ascontiguousarray(gw)


def scatter_products(g2: Any, w2: Any, groups: int, padded: tuple, out_sp: tuple,
                     kernel: tuple, stride: tuple, dilation: tuple) -> Any:
    """The zero-padded (N, *S, C) input gradient of a convolution from its (rows, O) output
    gradient: `window_grads` then `scatter_windows`, or without groups one GEMM per kernel
    position added straight into place, which skips the (rows, prod(K)*C) intermediate and its
    strided reads (half the time for a 3x3x3 kernel)."""
    taps = math.prod(kernel)
    c = padded[-1]
    if groups != 1:
        gwin = window_grads(g2, w2, groups, taps).reshape(padded[:1] + out_sp + kernel + (c,))
        return scatter_windows(gwin, padded, stride, dilation)
    per_tap = w2.reshape(w2.shape[0], taps, c)
    out = xp_of(g2).zeros(padded, dtype=g2.dtype)
    everything = slice(None)
    for i, tap in enumerate(itertools.product(*(range(k) for k in kernel))):
        region = tuple(
            slice(t * d, t * d + s * (o - 1) + 1, s)
            for t, d, s, o in zip(tap, dilation, stride, out_sp))
        out[(everything,) + region + (everything,)] += (g2 @ per_tap[:, i, :]).reshape(
            padded[:1] + out_sp + (c,))
    return out


def bias_grad(g2: Any) -> Any:
    """dL/dbias: the per-channel sums of the (rows, O) output gradient."""
    return column_sums(g2) if g2.dtype.kind != "c" else g2.sum(axis=0)


def channels_last(a: Any) -> Any:
    """An (N, C, *S) array as an (N, *S, C) view."""
    return a.transpose((0,) + tuple(range(2, a.ndim)) + (1,))


def channels_first(a: Any) -> Any:
    """An (N, *S, C) array as an (N, C, *S) view."""
    return a.transpose((0, a.ndim - 1) + tuple(range(1, a.ndim - 1)))


def conv_padding(padding: Any, kernel: tuple, stride: tuple, dilation: tuple, op: str) -> tuple:
    """((low, high), ...) per spatial dim from an int, a tuple, 'valid' or 'same' (torch's
    rules: 'same' puts the odd pixel last and refuses strides)."""
    n = len(kernel)
    if isinstance(padding, str):
        if padding == "valid":
            return ((0, 0),) * n
        if padding != "same":
            raise ShapeError(f"{op}: invalid padding string {padding!r}; expected 'valid', "
                             f"'same', an int or a tuple of {n} ints.")
        if any(s != 1 for s in stride):
            raise ShapeError(f"{op}: padding='same' is not supported for strided convolutions.")
        totals = [d * (k - 1) for k, d in zip(kernel, dilation)]
        return tuple((t // 2, t - t // 2) for t in totals)
    pads = ntuple(padding, n, "padding", op)
    if min(pads) < 0:
        raise ShapeError(f"{op}: negative padding is not supported, got {padding!r}.")
    return tuple((p, p) for p in pads)


def check_operands(xd: Any, wd: Any, bd: Any, groups: int, spatial: int, op: str,
                   transposed: bool) -> Any:
    """The input as a batched array after torch's checks of the input, weight, bias and groups
    (the weight is (O, C/G, *K), or (C, O/G, *K) when transposed)."""
    if xd.ndim not in (spatial + 1, spatial + 2) or wd.ndim != spatial + 2:
        raise ShapeError(
            f"{op}: expected a {spatial + 1}-d (unbatched) or {spatial + 2}-d input and a "
            f"{spatial + 2}-d weight, got input {tuple(xd.shape)} and weight {tuple(wd.shape)}.")
    batched = xd if xd.ndim == spatial + 2 else xd[None]
    c = batched.shape[1]
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise ShapeError(f"{op}: groups must be a positive int, got {groups!r}.")
    if wd.shape[0] % groups:
        raise ShapeError(f"{op}: groups={groups} must divide the weight's dim 0, but the weight "
                         f"has shape {tuple(wd.shape)}.")
    expected = wd.shape[0] if transposed else wd.shape[1] * groups
    if c != expected:
        raise ShapeError(
            f"{op}: weight of shape {tuple(wd.shape)} (groups={groups}) expects an input with "
            f"{expected} channels, but the input of shape {tuple(xd.shape)} has {c}.")
    out_channels = wd.shape[1] * groups if transposed else wd.shape[0]
    if bd is not None and tuple(bd.shape) != (out_channels,):
        raise ShapeError(f"{op}: bias of shape {tuple(bd.shape)} does not match the "
                         f"{out_channels} output channels of weight {tuple(wd.shape)}.")
    return batched


def strides_and_dilation(stride: Any, dilation: Any, spatial: int, op: str) -> tuple:
    """The checked (stride, dilation) tuples: positive ints, one per spatial dim."""
    st = ntuple(stride, spatial, "stride", op)
    dil = ntuple(dilation, spatial, "dilation", op)
    if min(st) < 1 or min(dil) < 1:
        raise ShapeError(f"{op}: stride and dilation must be positive, got {stride!r}, "
                         f"{dilation!r}.")
    return st, dil


def conv_output_size(in_sp: tuple, kernel: tuple, pads: tuple, st: tuple, dil: tuple,
                     op: str) -> tuple:
    """The output's spatial size, or a ShapeError when a dilated kernel outgrows the input."""
    padded = tuple(s + lo + hi for s, (lo, hi) in zip(in_sp, pads))
    spans = tuple(d * (k - 1) + 1 for k, d in zip(kernel, dil))
    if any(p < span for p, span in zip(padded, spans)):
        raise ShapeError(
            f"{op}: the dilated kernel {'x'.join(map(str, spans))} is larger than the padded "
            f"input {'x'.join(map(str, padded))}.")
    return tuple((p - span) // s + 1 for p, span, s in zip(padded, spans, st))


def conv_nd(x: Tensor, weight: Tensor, bias: Tensor | None, stride: Any, padding: Any,
            dilation: Any, groups: int, op: str, spatial: int) -> Tensor:
    """A convolution over `spatial` dims as one graph node: im2col and one GEMM forward, the
    transposed GEMMs and a strided scatter backward."""
    xd, wd = x.array, weight.array
    bd = None if bias is None else bias.array
    xb = check_operands(xd, wd, bd, groups, spatial, op, transposed=False)
    st, dil = strides_and_dilation(stride, dilation, spatial, op)
    kernel = tuple(wd.shape[2:])
    pads = conv_padding(padding, kernel, st, dil, op)
    in_sp = tuple(xb.shape[2:])
    out_sp = conv_output_size(in_sp, kernel, pads, st, dil, op)
    n, c, o, taps = xb.shape[0], xb.shape[1], wd.shape[0], math.prod(kernel)
    cols = im2col(channels_last(xb), pads, kernel, out_sp, st, dil)
    w2 = weight_matrix(wd, groups)
    out2 = apply_weight(cols, w2, groups, taps)
    if bd is not None:
        out2 += bd
    out = channels_first(out2.reshape((n,) + out_sp + (o,)))
    batched = xd.ndim == spatial + 2
    padded = (n,) + tuple(s + lo + hi for s, (lo, hi) in zip(in_sp, pads)) + (c,)

    def backward(g: Any) -> tuple:
        g2 = channels_last(g if batched else g[None]).reshape(cols.shape[0], o)
        gx = gw = gb = None
        if needs_grad(weight):
            gw = weight_grad(cols, g2, groups, wd.shape)
        if bias is not None and bias.requires_grad:
            gb = bias_grad(g2)
        if needs_grad(x):
            gpad = scatter_products(g2, w2, groups, padded, out_sp, kernel, st, dil)
            inner = tuple(slice(lo, lo + s) for s, (lo, _) in zip(in_sp, pads))
            gx = channels_first(gpad[(slice(None),) + inner + (slice(None),)])
            gx = gx if batched else gx[0]
        return gx, gw, gb

    if out.dtype.kind == "c":
        backward = _conjugated(backward)
    return result(out if batched else out[0], "ConvolutionBackward", backward, (x, weight, bias))


def conv3d(
    input: Tensor,  # noqa: A002 - torch's name
    weight: Tensor,
    bias: Tensor | None = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
) -> Tensor:
    """3-D convolution (cross-correlation, as torch) over an (N, C, D, H, W) or (C, D, H, W)
    input."""
    if _AMP.active:
        input, weight, bias = _autocast.cast(  # noqa: A001 - torch's parameter name
            "conv3d", input, weight, bias)
    return conv_nd(input, weight, bias, stride, padding, dilation, groups, "conv3d", spatial=3)
