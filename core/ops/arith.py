"""Elementwise arithmetic with broadcasting: + - * / pow neg, and comparisons (no grad).

The binary ops promote their operands as torch does (core/ops/_promote.py), compute in the
result dtype (16-bit floats in float32, rounded once: core/ops/_opmath.py), and hand each operand
its gradient in its own dtype.
"""

from __future__ import annotations

import cmath
import math
from typing import Any

from shoal.core.amp.autocast_mode import STATE as _AMP
from shoal.core.ops import _autocast
from shoal.core.ops._opmath import rounded_number, widen, widen_bf16
from shoal.core.ops._promote import default_float, as_dtype, category, promote
from shoal.core.ops._util import (
    UnsupportedOperand,
    broadcast_error,
    cj,
    needs_grad,
    real_grad,
    result,
    unbroadcast,
    val,
    wrap,
    xp_of,
)


def add(x: Any, y: Any) -> Any:
    """x + y."""
    dt, xd, yd = promote(val(x), val(y))
    xd, yd = rounded_number(xd, dt), rounded_number(yd, dt)
    try:
        out = as_dtype(widen(xd) + widen(yd), dt)
    except ValueError as exc:
        raise broadcast_error("add", xd, yd, exc) from exc

    def backward(g: Any) -> tuple:
        return (
            _grad_for(x, unbroadcast(g, xd.shape)) if needs_grad(x) else None,
            _grad_for(y, unbroadcast(g, yd.shape)) if needs_grad(y) else None,
        )

    return result(out, "AddBackward", backward, (x, y), exact_dtype=True)


def sub(x: Any, y: Any) -> Any:
    """x - y."""
    dt, xd, yd = promote(val(x), val(y))
    xd, yd = rounded_number(xd, dt), rounded_number(yd, dt)
    try:
        out = as_dtype(widen(xd) - widen(yd), dt)
    except ValueError as exc:
        raise broadcast_error("sub", xd, yd, exc) from exc

    def backward(g: Any) -> tuple:
        return (
            _grad_for(x, unbroadcast(g, xd.shape)) if needs_grad(x) else None,
            _grad_for(y, unbroadcast(-g, yd.shape)) if needs_grad(y) else None,
        )

    return result(out, "SubBackward", backward, (x, y), exact_dtype=True)


def rsub(x: Any, y: Any) -> Any:
    """y - x (the reflected form)."""
    return sub(y, x)


def mul(x: Any, y: Any) -> Any:
    """x * y."""
    dt, xd, yd = promote(val(x), val(y))
    try:
        out = as_dtype(widen(xd) * widen(yd), dt)
    except ValueError as exc:
        raise broadcast_error("mul", xd, yd, exc) from exc

    def backward(g: Any) -> tuple:
        g = widen(g)
        return (
            _grad_for(x, unbroadcast(g * cj(widen(yd)), xd.shape)) if needs_grad(x) else None,
            _grad_for(y, unbroadcast(g * cj(widen(xd)), yd.shape)) if needs_grad(y) else None,
        )

    return result(out, "MulBackward", backward, (x, y), exact_dtype=True)


def div(x: Any, y: Any) -> Any:
    """x / y (true division: integer operands give the default float dtype, as in torch)."""
    dt, xd, yd = promote(val(x), val(y))
    if category(dt) < 2:
        dt, xd, yd = promote(_as_float(xd), _as_float(yd))
    try:
        out = as_dtype(widen(xd) / widen(yd), dt)
    except ValueError as exc:
        raise broadcast_error("div", xd, yd, exc) from exc

    def backward(g: Any) -> tuple:
        g, yw = widen(g), cj(widen(yd))
        return (
            _grad_for(x, unbroadcast(g / yw, xd.shape)) if needs_grad(x) else None,
            _grad_for(y, unbroadcast(-g * cj(widen(out)) / yw, yd.shape))
            if needs_grad(y) else None,
        )

    return result(out, "DivBackward", backward, (x, y), exact_dtype=True)


def rdiv(x: Any, y: Any) -> Any:
    """y / x (the reflected form)."""
    return div(y, x)


def pow(x: Any, y: Any) -> Any:  # noqa: A001 - torch's name
    """x ** y; y may be a tensor or a Python number.

    Integer (and bool) operands follow torch: a negative Python exponent is refused, and a
    tensor exponent's negative entries give 1 ** -n = 1, (-1) ** -n = +-1 and 0 otherwise
    (numpy refuses both).
    """
    if _AMP.active:
        x, y = _autocast.cast("pow", x, y)
    dt, xd, yd = promote(val(x), val(y))
    xd, yd = rounded_number(xd, dt), rounded_number(yd, dt)
    try:
        if category(dt) < 2:
            out = as_dtype(_integer_pow(xd, yd), dt)
        else:
            out = as_dtype(widen(xd) ** widen(yd), dt)
    except ValueError as exc:
        raise broadcast_error("pow", xd, yd, exc) from exc

    def backward(g: Any) -> tuple:
        gx = gy = None
        gw, xw, yw = widen(g), widen(xd), widen(yd)
        if needs_grad(x):
            if isinstance(yw, (int, float)):
                gx = gw * cj(2 * xw) if yw == 2 else gw * cj(yw * xw ** (yw - 1))
            else:
                gx = unbroadcast(gw * cj(yw * xw ** (yw - 1)), xd.shape)
            gx = _grad_for(x, gx)
        if needs_grad(y):
            ow = widen(out)
            if isinstance(xw, (int, float)):
                gy = gw * cj(ow * (cmath.log(xw) if isinstance(xw, complex) else math.log(xw)))
            else:
                gy = unbroadcast(gw * cj(ow * _xp_log(xw)), yd.shape)
            gy = _grad_for(y, gy)
        return gx, gy

    return result(out, "PowBackward", backward, (x, y), exact_dtype=True)


def _integer_pow(xd: Any, yd: Any) -> Any:
    """x ** y for integer (or bool) operands, with torch's answers for negative exponents."""
    if isinstance(yd, int):  # bool included
        if yd < 0:
            raise RuntimeError(
                f"pow: Integers to negative integer powers are not allowed (an integer tensor "
                f"to the power {yd}); make the base or the exponent a float."
            )
        return xd**yd
    xp = xp_of(yd)
    negative = yd < 0
    if not negative.any():
        return xd**yd
    # torch's integer pow: 1 ** -n is 1, (-1) ** -n is 1 or -1 by n's parity, anything else 0.
    out = xd ** xp.where(negative, 0, yd)
    odd = (yd % 2) != 0
    at_negative = xp.where(xd == 1, 1, xp.where(xd == -1, xp.where(odd, -1, 1), 0))
    return xp.where(negative, at_negative, out)


def rpow(x: Any, y: Any) -> Any:
    """y ** x (the reflected form)."""
    return pow(y, x)


def _grad_for(operand: Any, g: Any) -> Any:
    """A gradient in its operand's dtype: the op may have computed in a promoted one (a real
    operand of a complex result gets the gradient's real part, as in torch)."""
    return as_dtype(real_grad(g, operand.array), operand.array.dtype)


def _as_float(d: Any) -> Any:
    """An integer or bool operand of true division in the default float dtype (a Python int
    becomes a Python float, which stays weak)."""
    if isinstance(d, (bool, int)):
        return float(d)
    return d if category(d.dtype) >= 2 else d.astype(default_float())


def _xp_log(a: Any) -> Any:
    return xp_of(a).log(a)


def neg(x: Any) -> Any:
    """-x."""
    out = -x.array

    def backward(g: Any) -> tuple:
        return (-g,)

    return result(out, "NegBackward", backward, (x,))


def _compare(op: str, fn: Any) -> Any:
    def compare(x: Any, y: Any) -> Any:
        try:
            xd, yd = val(x), val(y)
        except UnsupportedOperand:
            return NotImplemented  # `t == None` falls back to identity, as in torch
        try:
            # torch compares in the promoted dtype: a number is rounded to a 16-bit one first
            # (bfloat16(0.1) == 0.1 is True); bfloat16 arrays widen exactly, and float32
            # comparisons are ~20x faster than ml_dtypes' loops.
            dt, xd, yd = promote(xd, yd)
            xd, yd = rounded_number(xd, dt), rounded_number(yd, dt)
            return wrap(fn(widen_bf16(xd), widen_bf16(yd)))
        except ValueError as exc:
            raise broadcast_error(op, xd, yd, exc) from exc

    compare.__name__ = op
    compare.__doc__ = f"Elementwise {op}; a bool tensor without grad."
    return compare


eq = _compare("eq", lambda a, b: a == b)
ne = _compare("ne", lambda a, b: a != b)
lt = _compare("lt", lambda a, b: a < b)
le = _compare("le", lambda a, b: a <= b)
gt = _compare("gt", lambda a, b: a > b)
ge = _compare("ge", lambda a, b: a >= b)
