"""Elementwise functions: exp, log, sqrt, tanh, sigmoid, relu, gelu, abs, clamp.

bfloat16 and float16 operands are computed in float32 (a lone ufunc numpy runs well on float16
excepted) and rounded once to their dtype, forward and backward, as torch's CPU kernels do
(_opmath.py).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shoal.core import kernels as _kernels
from shoal.core.amp.autocast_mode import STATE as _AMP
from shoal.core.ops import _autocast
from shoal.core.ops import _special
from shoal.core.ops._opmath import narrow, widen, widen_bf16
from shoal.core.ops._promote import as_dtype, floating, promote
from shoal.core.ops._util import cj, needs_grad, result, unbroadcast, val, xp_of

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def exp(x: Any) -> Any:
    """e ** x."""
    if _AMP.active:
        (x,) = _autocast.cast("exp", x)
    xd = floating(x.array)
    dt = xd.dtype
    out = narrow(xp_of(xd).exp(widen_bf16(xd)), dt)

    def backward(g: Any) -> tuple:
        return (narrow(widen_bf16(g) * cj(widen_bf16(out)), dt),)

    return result(out, "ExpBackward", backward, (x,))


def log(x: Any) -> Any:
    """Natural logarithm."""
    if _AMP.active:
        (x,) = _autocast.cast("log", x)
    xd = floating(x.array)
    dt = xd.dtype
    out = narrow(xp_of(xd).log(widen_bf16(xd)), dt)

    def backward(g: Any) -> tuple:
        return (narrow(widen_bf16(g) / cj(widen_bf16(xd)), dt),)

    return result(out, "LogBackward", backward, (x,))


def sqrt(x: Any) -> Any:
    """Square root."""
    xd = floating(x.array)
    dt = xd.dtype
    out = narrow(xp_of(xd).sqrt(widen_bf16(xd)), dt)

    def backward(g: Any) -> tuple:
        return (narrow(widen_bf16(g) / (2 * cj(widen_bf16(out))), dt),)

    return result(out, "SqrtBackward", backward, (x,))


def tanh(x: Any) -> Any:
    """Hyperbolic tangent."""
    xd = floating(x.array)
    dt = xd.dtype
    out = narrow(xp_of(xd).tanh(widen_bf16(xd)), dt)

    def backward(g: Any) -> tuple:
        # torch's tanh_backward: from the rounded output, in float32, rounded once.
        t = cj(widen(out))
        return (narrow(widen(g) * (1 - t * t), dt),)

    return result(out, "TanhBackward", backward, (x,))


def sigmoid(x: Any) -> Any:
    """1 / (1 + e ** -x), torch's formula: accurate in both tails (a far negative x gives a
    huge e ** -x, so a tiny result, and one past float32's range an inf, so 0, as torch)."""
    xd = floating(x.array)
    dt = xd.dtype
    xp = xp_of(xd)
    with np.errstate(over="ignore"):
        out = narrow(1 / (1 + xp.exp(-widen(xd))), dt)

    def backward(g: Any) -> tuple:
        # torch's sigmoid_backward: g * (1 - y) * y from the rounded output y, rounded once.
        y = cj(widen(out))
        return (narrow(widen(g) * (1 - y) * y, dt),)

    return result(out, "SigmoidBackward", backward, (x,))


def relu(x: Any) -> Any:
    """max(x, 0)."""
    xd = x.array
    dt = xd.dtype
    out = narrow(xp_of(xd).maximum(widen_bf16(xd), 0), dt)

    def backward(g: Any) -> tuple:
        # One boolean mask and one multiply into a fresh buffer, as torch's threshold_backward
        # (the mask from a widened output: ml_dtypes' bfloat16 comparisons are slow too).
        return (narrow(widen_bf16(g) * (widen_bf16(out) > 0), dt),)

    return result(out, "ReluBackward", backward, (x,))


def gelu(x: Any, approximate: str = "none") -> Any:
    """Gaussian error linear unit: x * Phi(x); approximate='tanh' uses the tanh formula."""
    xd = x.array
    xp = xp_of(xd)
    if xp is not np:  # cupy: one fused CUDA kernel each way (core/kernels/gelu.py)
        out = _kernels.gelu_forward_cuda(xd, approximate)

        def backward_cuda(g: Any) -> tuple:
            return (_kernels.gelu_backward_cuda(xd, g, approximate),)

        return result(out, "GeluBackward", backward_cuda, (x,))
    dt = xd.dtype
    # One fused formula, as torch's gelu kernels: float32 throughout for a 16-bit input, one
    # rounding at the end (the backward widens x again rather than keep a float32 copy alive).
    xw = widen(xd)
    if approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (xw + 0.044715 * xw * xw * xw)
        t = xp.tanh(inner)
        out = narrow(0.5 * xw * (1 + t), dt)

        def backward(g: Any) -> tuple:
            xb = widen(xd)
            dinner = _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * xb * xb)
            gw = widen(g)
            return (narrow(gw * (0.5 * (1 + t) + 0.5 * xb * (1 - t * t) * dinner), dt),)

        return result(out, "GeluBackward", backward, (x,))
    if approximate != "none":
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}.")
    cdf = 0.5 * (1 + _special.erf(xw * _INV_SQRT_2))
    out = narrow(xw * cdf, dt)

    def backward_exact(g: Any) -> tuple:
        xb = widen(xd)
        pdf = _INV_SQRT_2PI * xp.exp(-0.5 * xb * xb)
        return (narrow(widen(g) * (cdf + xb * pdf), dt),)

    return result(out, "GeluBackward", backward_exact, (x,))


def abs(x: Any) -> Any:  # noqa: A001 - torch's name
    """|x|; the gradient at 0 is 0, as in torch."""
    xd = x.array
    xp = xp_of(xd)
    dt = xd.dtype
    out = xp.abs(xd)  # exact in every dtype: no widening needed

    def backward(g: Any) -> tuple:
        if dt.kind == "c":  # d|z| is z / |z| (0 at 0), torch's sgn
            return (g * _sgn(xd, out),)
        return (narrow(widen_bf16(g) * xp.sign(widen_bf16(xd)), dt),)

    return result(out, "AbsBackward", backward, (x,))


def _sgn(z: Any, magnitude: Any) -> Any:
    """z / |z| for complex z, 0 where z is 0 (torch's sgn; cupy's sign differs on complex)."""
    xp = xp_of(z)
    safe = xp.where(magnitude == 0, 1, magnitude)
    return xp.where(magnitude == 0, 0, z / safe)


def clamp(x: Any, min: Any = None, max: Any = None) -> Any:  # noqa: A002 - torch's names
    """Limit x to [min, max]; numbers or tensors as bounds, promoted with x as torch does
    (a bfloat16 x with a float32 tensor bound gives float32; with a Python float, bfloat16).

    Gradients as torch's: x's flows where min <= x <= max, a tensor bound's where it replaced
    x (min where x < min < max, max where x > max or max < min, since max wins a crossing).
    """
    if min is None and max is None:
        raise ValueError("clamp: at least one of min and max must be given, got both None.")
    dt, xd, lo, hi = promote(x.array, _bound(min), _bound(max))
    # Exact in any dtype, but ml_dtypes' bfloat16 loops are slow.
    xd, lo, hi = widen_bf16(xd), widen_bf16(lo), widen_bf16(hi)
    out = as_dtype(xp_of(xd).clip(xd, lo, hi), dt)

    def backward(g: Any) -> tuple:
        gx = gmin = gmax = None
        g = widen(g)  # the masked sums below accumulate in float32, as torch's
        if x.requires_grad:
            inside = (xd >= lo) if lo is not None else None
            if hi is not None:
                inside = (xd <= hi) if inside is None else inside & (xd <= hi)
            gx = as_dtype(unbroadcast(g * inside, xd.shape), x.array.dtype)
        if needs_grad(min):
            below = xd < lo
            if hi is not None:
                below &= lo < hi
            gmin = as_dtype(unbroadcast(g * below, lo.shape), min.array.dtype)
        if needs_grad(max):
            above = xd > hi
            if lo is not None:
                above |= hi < lo
            gmax = as_dtype(unbroadcast(g * above, hi.shape), max.array.dtype)
        return gx, gmin, gmax

    return result(out, "ClampBackward", backward, (x, min, max), exact_dtype=True)


def _bound(b: Any) -> Any:
    """A clamp bound as the op sees it (None stays None: that side is open)."""
    return None if b is None else val(b)
