"""Elementwise functions: exp, log, sqrt, tanh, sigmoid, relu, gelu, abs, clamp."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shoal.core import kernels as _kernels
from shoal.core.amp.autocast_mode import STATE as _AMP
from shoal.core.ops import _autocast
from shoal.core.ops import _special
from shoal.core.ops._promote import as_dtype, promote
from shoal.core.ops._util import needs_grad, result, unbroadcast, val, xp_of

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def exp(x: Any) -> Any:
    """e ** x."""
    if _AMP.active:
        (x,) = _autocast.cast("exp", x)
    xd = x.data
    out = xp_of(xd).exp(xd)

    def backward(g: Any) -> tuple:
        return (g * out,)

    return result(out, "ExpBackward", backward, (x,))


def log(x: Any) -> Any:
    """Natural logarithm."""
    if _AMP.active:
        (x,) = _autocast.cast("log", x)
    xd = x.data
    out = xp_of(xd).log(xd)

    def backward(g: Any) -> tuple:
        return (g / xd,)

    return result(out, "LogBackward", backward, (x,))


def sqrt(x: Any) -> Any:
    """Square root."""
    xd = x.data
    out = xp_of(xd).sqrt(xd)

    def backward(g: Any) -> tuple:
        return (g / (2 * out),)

    return result(out, "SqrtBackward", backward, (x,))


def tanh(x: Any) -> Any:
    """Hyperbolic tangent."""
    xd = x.data
    out = xp_of(xd).tanh(xd)

    def backward(g: Any) -> tuple:
        return (g * (1 - out * out),)

    return result(out, "TanhBackward", backward, (x,))


def sigmoid(x: Any) -> Any:
    """1 / (1 + e ** -x), computed as (1 + tanh(x/2)) / 2 so large |x| cannot overflow."""
    xd = x.data
    out = xp_of(xd).tanh(xd * 0.5)
    out += 1
    out *= 0.5

    def backward(g: Any) -> tuple:
        return (g * (out * (1 - out)),)

    return result(out, "SigmoidBackward", backward, (x,))


def relu(x: Any) -> Any:
    """max(x, 0)."""
    xd = x.data
    out = xp_of(xd).maximum(xd, 0)

    def backward(g: Any) -> tuple:
        # One boolean mask and one multiply into a fresh buffer, as torch's threshold_backward.
        return (g * (out > 0),)

    return result(out, "ReluBackward", backward, (x,))


def gelu(x: Any, approximate: str = "none") -> Any:
    """Gaussian error linear unit: x * Phi(x); approximate='tanh' uses the tanh formula."""
    xd = x.data
    xp = xp_of(xd)
    if xp is not np:  # cupy: one fused CUDA kernel each way (core/kernels/gelu.py)
        out = _kernels.gelu_forward_cuda(xd, approximate)

        def backward_cuda(g: Any) -> tuple:
            return (_kernels.gelu_backward_cuda(xd, g, approximate),)

        return result(out, "GeluBackward", backward_cuda, (x,))
    if approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (xd + 0.044715 * xd * xd * xd)
        t = xp.tanh(inner)
        out = 0.5 * xd * (1 + t)

        def backward(g: Any) -> tuple:
            dinner = _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * xd * xd)
            return (g * (0.5 * (1 + t) + 0.5 * xd * (1 - t * t) * dinner),)

        return result(out, "GeluBackward", backward, (x,))
    if approximate != "none":
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}.")
    cdf = 0.5 * (1 + _special.erf(xd * _INV_SQRT_2))
    out = xd * cdf

    def backward_exact(g: Any) -> tuple:
        pdf = _INV_SQRT_2PI * xp.exp(-0.5 * xd * xd)
        return (g * (cdf + xd * pdf),)

    return result(out, "GeluBackward", backward_exact, (x,))


def abs(x: Any) -> Any:  # noqa: A001 - torch's name
    """|x|; the gradient at 0 is 0, as in torch."""
    xd = x.data
    xp = xp_of(xd)
    out = xp.abs(xd)

    def backward(g: Any) -> tuple:
        return (g * xp.sign(xd),)

    return result(out, "AbsBackward", backward, (x,))


def clamp(x: Any, min: Any = None, max: Any = None) -> Any:  # noqa: A002 - torch's names
    """Limit x to [min, max]; numbers or tensors as bounds, promoted with x as torch does
    (a bfloat16 x with a float32 tensor bound gives float32; with a Python float, bfloat16).

    Gradients as torch's: x's flows where min <= x <= max, a tensor bound's where it replaced
    x (min where x < min < max, max where x > max or max < min, since max wins a crossing).
    """
    if min is None and max is None:
        raise ValueError("clamp: at least one of min and max must be given, got both None.")
    dt, xd, lo, hi = promote(x.data, _bound(min), _bound(max))
    out = as_dtype(xp_of(xd).clip(xd, lo, hi), dt)

    def backward(g: Any) -> tuple:
        gx = gmin = gmax = None
        if x.requires_grad:
            inside = (xd >= lo) if lo is not None else None
            if hi is not None:
                inside = (xd <= hi) if inside is None else inside & (xd <= hi)
            gx = as_dtype(unbroadcast(g * inside, xd.shape), x.data.dtype)
        if needs_grad(min):
            below = xd < lo
            if hi is not None:
                below &= lo < hi
            gmin = as_dtype(unbroadcast(g * below, lo.shape), min.data.dtype)
        if needs_grad(max):
            above = xd > hi
            if lo is not None:
                above |= hi < lo
            gmax = as_dtype(unbroadcast(g * above, hi.shape), max.data.dtype)
        return gx, gmin, gmax

    return result(out, "ClampBackward", backward, (x, min, max), exact_dtype=True)


def _bound(b: Any) -> Any:
    """A clamp bound as the op sees it (None stays None: that side is open)."""
    return None if b is None else val(b)
