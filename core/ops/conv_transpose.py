"""Transposed convolutions (conv_transpose1d/2d/3d): the input gradient of a convolution.

A transposed convolution of x with weight (C_in, C_out/G, *K) is what a convolution from
C_out to C_in channels with that weight sends back to its input: so its forward pass is
conv_nd's input-gradient kernel (`scatter_products`: a GEMM and one strided add per kernel
position), and its backward pass is a convolution forward (im2col of the output gradient and
one GEMM) for the input and conv_nd's weight-gradient GEMM for the weight.
"""

from __future__ import annotations

import math
from typing import Any

from shoal.core.amp.autocast_mode import STATE as _AMP
from shoal.core.errors import ShapeError
from shoal.core.ops import _autocast
from shoal.core.ops._util import needs_grad, result
from shoal.core.ops.conv import _conjugated
from shoal.core.ops.conv_nd import (
    apply_weight, bias_grad, channels_first, channels_last, check_operands, im2col, ntuple,
    scatter_products, strides_and_dilation, weight_grad, weight_matrix,
)
from shoal.core.tensor import Tensor


def transposed_geometry(in_sp: tuple, kernel: tuple, stride: Any, padding: Any,
                        output_padding: Any, dilation: Any, op: str) -> tuple:
    """The checked (stride, dilation, padding, output size) of a transposed convolution:
    out = (in - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1."""
    spatial = len(kernel)
    if isinstance(padding, str):
        raise TypeError(f"{op}(): argument 'padding' must be an int or a tuple of ints, not "
                        f"str {padding!r}.")
    st, dil = strides_and_dilation(stride, dilation, spatial, op)
    pads = ntuple(padding, spatial, "padding", op)
    extra = ntuple(output_padding, spatial, "output_padding", op)
    if min(pads) < 0 or min(extra) < 0:
        raise ShapeError(f"{op}: negative padding is not supported, got padding={padding!r}, "
                         f"output_padding={output_padding!r}.")
    if any(e >= s and e >= d for e, s, d in zip(extra, st, dil)):
        raise ShapeError(f"{op}: output padding must be smaller than either stride or dilation, "
                         f"got output_padding={extra}, stride={st}, dilation={dil}.")
    out_sp = tuple((i - 1) * s - 2 * p + d * (k - 1) + e + 1
                   for i, s, p, d, k, e in zip(in_sp, st, pads, dil, kernel, extra))
    if min(out_sp) < 1:
        raise ShapeError(f"{op}: the output size {out_sp} of input size {in_sp} with padding "
                         f"{pads} is too small (every dim must be at least 1).")
    return st, dil, pads, out_sp


def conv_transpose_nd(x: Tensor, weight: Tensor, bias: Tensor | None, stride: Any,
                      padding: Any, output_padding: Any, groups: int, dilation: Any, op: str,
                      spatial: int) -> Tensor:
    """A transposed convolution over `spatial` dims as one graph node."""
    xd, wd = x.array, weight.array
    bd = None if bias is None else bias.array
    xb = check_operands(xd, wd, bd, groups, spatial, op, transposed=True)
    kernel, in_sp = tuple(wd.shape[2:]), tuple(xb.shape[2:])
    st, dil, pads, out_sp = transposed_geometry(
        in_sp, kernel, stride, padding, output_padding, dilation, op)
    n, c_in, c_out, taps = xb.shape[0], xb.shape[1], wd.shape[1] * groups, math.prod(kernel)
    # In the terms of the convolution this one transposes: its input is our output (c_out
    # channels, padded by `pads`), its output is our input, its weight is ours as it stands.
    w2 = weight_matrix(wd, groups)
    x2 = channels_last(xb).reshape(n * math.prod(in_sp), c_in)
    padded = (n,) + tuple(o + 2 * p for o, p in zip(out_sp, pads)) + (c_out,)
    inner = (slice(None),) + tuple(slice(p, p + o) for o, p in zip(out_sp, pads)) + (slice(None),)
    y = scatter_products(x2, w2, groups, padded, in_sp, kernel, st, dil)[inner]
    if bd is not None:
        y += bd  # a view into the scatter's own buffer, free to write
    out = channels_first(y)
    batched = xd.ndim == spatial + 2
    conv_pads = tuple((p, p) for p in pads)

    def backward(g: Any) -> tuple:
        g_cl = channels_last(g if batched else g[None])
        gx = gw = gb = None
        cols = None
        if needs_grad(x) or needs_grad(weight):
            cols = im2col(g_cl, conv_pads, kernel, in_sp, st, dil)
        if needs_grad(weight):
            gw = weight_grad(cols, x2, groups, wd.shape)
        if bias is not None and bias.requires_grad:
            gb = bias_grad(g_cl.reshape(-1, c_out))
        if needs_grad(x):
            gx2 = apply_weight(cols, w2, groups, taps)
            gx = channels_first(gx2.reshape((n,) + in_sp + (c_in,)))
            gx = gx if batched else gx[0]
        return gx, gw, gb

    if out.dtype.kind == "c":
        backward = _conjugated(backward)
    return result(out if batched else out[0], "ConvolutionBackward", backward, (x, weight, bias))


def _transposed(spatial: int) -> Any:
    name = f"conv_transpose{spatial}d"

    def conv_transpose(
        input: Tensor,  # noqa: A002 - torch's name
        weight: Tensor,
        bias: Tensor | None = None,
        stride: Any = 1,
        padding: Any = 0,
        output_padding: Any = 0,
        groups: int = 1,
        dilation: Any = 1,
    ) -> Tensor:
        if _AMP.active:
            input, weight, bias = _autocast.cast(  # noqa: A001 - torch's parameter name
                name, input, weight, bias)
        return conv_transpose_nd(input, weight, bias, stride, padding, output_padding, groups,
                                 dilation, name, spatial)

    conv_transpose.__name__ = conv_transpose.__qualname__ = name
    conv_transpose.__doc__ = (
        f"{spatial}-D transposed convolution (torch's {name}): the input gradient of a "
        f"conv{spatial}d, over a batched or unbatched input; groups comes before dilation.")
    return conv_transpose


conv_transpose1d = _transposed(1)
conv_transpose2d = _transposed(2)
conv_transpose3d = _transposed(3)
