"""Elementwise arithmetic with broadcasting: + - * / pow neg, and comparisons (no grad).

The binary ops promote their operands as torch does (core/ops/_promote.py), compute in the
result dtype, and hand each operand its gradient in its own dtype.
"""

from __future__ import annotations

import math
from typing import Any

from shoal.core.amp.autocast_mode import STATE as _AMP
from shoal.core.ops import _autocast
from shoal.core.ops._promote import DEFAULT_FLOAT, as_dtype, category, promote
from shoal.core.ops._util import (
    UnsupportedOperand,
    broadcast_error,
    needs_grad,
    result,
    unbroadcast,
    val,
    wrap,
)


def add(x: Any, y: Any) -> Any:
    """x + y."""
    dt, xd, yd = promote(val(x), val(y))
    try:
        out = as_dtype(xd + yd, dt)
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
    try:
        out = as_dtype(xd - yd, dt)
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
        out = as_dtype(xd * yd, dt)
    except ValueError as exc:
        raise broadcast_error("mul", xd, yd, exc) from exc

    def backward(g: Any) -> tuple:
        return (
            _grad_for(x, unbroadcast(g * yd, xd.shape)) if needs_grad(x) else None,
            _grad_for(y, unbroadcast(g * xd, yd.shape)) if needs_grad(y) else None,
        )

    return result(out, "MulBackward", backward, (x, y), exact_dtype=True)


def div(x: Any, y: Any) -> Any:
    """x / y (true division: integer operands give the default float dtype, as in torch)."""
    dt, xd, yd = promote(val(x), val(y))
    if category(dt) < 2:
        dt, xd, yd = promote(_as_float(xd), _as_float(yd))
    try:
        out = as_dtype(xd / yd, dt)
    except ValueError as exc:
        raise broadcast_error("div", xd, yd, exc) from exc

    def backward(g: Any) -> tuple:
        return (
            _grad_for(x, unbroadcast(g / yd, xd.shape)) if needs_grad(x) else None,
            _grad_for(y, unbroadcast(-g * out / yd, yd.shape)) if needs_grad(y) else None,
        )

    return result(out, "DivBackward", backward, (x, y), exact_dtype=True)


def rdiv(x: Any, y: Any) -> Any:
    """y / x (the reflected form)."""
    return div(y, x)


def pow(x: Any, y: Any) -> Any:  # noqa: A001 - torch's name
    """x ** y; y may be a tensor or a Python number."""
    if _AMP.active:
        x, y = _autocast.cast("pow", x, y)
    dt, xd, yd = promote(val(x), val(y))
    try:
        out = as_dtype(xd**yd, dt)
    except ValueError as exc:
        raise broadcast_error("pow", xd, yd, exc) from exc

    def backward(g: Any) -> tuple:
        gx = gy = None
        if needs_grad(x):
            if isinstance(yd, (int, float)):
                gx = g * (2 * xd) if yd == 2 else g * (yd * xd ** (yd - 1))
            else:
                gx = unbroadcast(g * (yd * xd ** (yd - 1)), xd.shape)
            gx = _grad_for(x, gx)
        if needs_grad(y):
            if isinstance(xd, (int, float)):
                gy = g * (out * math.log(xd))
            else:
                gy = unbroadcast(g * (out * _xp_log(xd)), yd.shape)
            gy = _grad_for(y, gy)
        return gx, gy

    return result(out, "PowBackward", backward, (x, y), exact_dtype=True)


def rpow(x: Any, y: Any) -> Any:
    """y ** x (the reflected form)."""
    return pow(y, x)


def _grad_for(operand: Any, g: Any) -> Any:
    """A gradient in its operand's dtype: the op may have computed in a promoted one."""
    return as_dtype(g, operand.data.dtype)


def _as_float(d: Any) -> Any:
    """An integer or bool operand of true division in the default float dtype (a Python int
    becomes a Python float, which stays weak)."""
    if isinstance(d, (bool, int)):
        return float(d)
    return d if category(d.dtype) >= 2 else d.astype(DEFAULT_FLOAT)


def _xp_log(a: Any) -> Any:
    from shoal.core.ops._util import xp_of  # noqa: PLC0415

    return xp_of(a).log(a)


def neg(x: Any) -> Any:
    """-x."""
    out = -x.data

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
            return wrap(fn(xd, yd))
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
