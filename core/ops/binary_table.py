"""torch's elementwise binary math beyond + - * / pow: one table row per op.

A row names the numpy forward and the two partial derivatives in terms of the operands `x`, `y`
and the output `z`. Operands promote as torch promotes them (core/ops/_promote.py); "float" rows
(atan2, hypot, logaddexp, ...) compute integer operands in the default float dtype, the others
(fmod, remainder, floor_divide, the logical and bitwise ops) keep integers. 16-bit floats compute
in float32 and round once. lerp, addcmul and addcdiv compose core's ops, so their gradients are
those ops' gradients.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from shoal.core.ops import arith
from shoal.core.ops._opmath import narrow, rounded_number, widen
from shoal.core.ops._promote import default_float, as_dtype, category, promote
from shoal.core.ops._util import (
    broadcast_error, needs_grad, result, unbroadcast, val, wrap, xp_of,
)

_LN2 = float(np.log(2.0))


class Row(NamedTuple):
    """One binary op: forward(xp, x, y), d/dx and d/dy from (xp, x, y, z) (None: no gradient)."""

    forward: Callable[[Any, Any, Any], Any]
    dx: Callable[[Any, Any, Any, Any], Any] | None
    dy: Callable[[Any, Any, Any, Any], Any] | None
    floats: bool  # integer operands compute in the default float dtype


def _floor_divide(xp: Any, x: Any, y: Any) -> Any:
    if x.dtype.kind in "iu":
        if xp.any(y == 0):
            raise RuntimeError("ZeroDivisionError")  # torch's message for integer division by 0
    return xp.floor_divide(x, y)


def _fmod(xp: Any, x: Any, y: Any) -> Any:
    if x.dtype.kind in "iu" and xp.any(y == 0):
        raise RuntimeError("ZeroDivisionError")
    return xp.fmod(x, y)


def _remainder(xp: Any, x: Any, y: Any) -> Any:
    if x.dtype.kind in "iu" and xp.any(y == 0):
        raise RuntimeError("ZeroDivisionError")
    return xp.remainder(x, y)


ROWS: dict[str, Row] = {
    "atan2": Row(lambda xp, x, y: xp.arctan2(x, y),
                 lambda xp, x, y, z: y / (x * x + y * y),
                 lambda xp, x, y, z: -x / (x * x + y * y), floats=True),
    "hypot": Row(lambda xp, x, y: xp.hypot(x, y),
                 lambda xp, x, y, z: x / z, lambda xp, x, y, z: y / z, floats=True),
    "logaddexp": Row(lambda xp, x, y: xp.logaddexp(x, y),
                     lambda xp, x, y, z: xp.exp(x - z), lambda xp, x, y, z: xp.exp(y - z),
                     floats=True),
    "logaddexp2": Row(lambda xp, x, y: xp.logaddexp2(x, y),
                      lambda xp, x, y, z: xp.exp2(x - z), lambda xp, x, y, z: xp.exp2(y - z),
                      floats=True),
    "copysign": Row(lambda xp, x, y: xp.copysign(x, y),
                    lambda xp, x, y, z: xp.where(x == 0, 0, xp.sign(x) * xp.copysign(1, y)),
                    lambda xp, x, y, z: xp.zeros_like(z), floats=True),
    "fmod": Row(_fmod, lambda xp, x, y, z: xp.ones_like(z),
                lambda xp, x, y, z: -xp.trunc(x / y), floats=False),
    "remainder": Row(_remainder, lambda xp, x, y, z: xp.ones_like(z),
                     lambda xp, x, y, z: -xp.floor(x / y), floats=False),
    "floor_divide": Row(_floor_divide, None, None, floats=False),
    "heaviside": Row(lambda xp, x, y: xp.heaviside(x, y), None, None, floats=False),
}


def _operands(name: str, x: Any, y: Any, floats: bool) -> tuple:
    """(dtype, x array, y array) promoted as torch promotes them for this op."""
    try:
        dt, xd, yd = promote(val(x), val(y))
    except TypeError as exc:
        raise TypeError(f"{name}(): {exc}") from exc
    if floats and category(dt) < 2:
        dt = default_float()
        xd = float(xd) if isinstance(xd, (bool, int)) else xd.astype(dt)
        yd = float(yd) if isinstance(yd, (bool, int)) else yd.astype(dt)
    return dt, rounded_number(xd, dt), rounded_number(yd, dt)


def apply(name: str, x: Any, y: Any) -> Any:
    """Run the table's op `name` on (x, y), recording gradients for the tensor operands."""
    row = ROWS[name]
    dt, xd, yd = _operands(name, x, y, row.floats)
    xw, yw = widen(xd), widen(yd)
    xp = xp_of(xw if hasattr(xw, "dtype") else yw)
    try:
        with np.errstate(all="ignore"):  # torch gives nan/inf quietly (fmod by 0.0, ...)
            out = as_dtype(xp.asarray(row.forward(xp, xp.asarray(xw), xp.asarray(yw))), dt)
    except ValueError as exc:
        raise broadcast_error(name, xd, yd, exc) from exc
    if name == "heaviside" and dt != np.bool_:
        out = out.astype(dt)

    def partial(operand: Any, shape: tuple, derivative: Any, g: Any) -> Any:
        if not needs_grad(operand):
            return None
        if derivative is None:
            return xp.zeros(operand.shape, operand.array.dtype)
        with np.errstate(all="ignore"):
            d = derivative(xp, xp.asarray(xw), xp.asarray(yw), widen(out))
        return as_dtype(narrow(unbroadcast(widen(g) * d, shape), dt), operand.array.dtype)

    def backward(g: Any) -> tuple:
        return (partial(x, getattr(xd, "shape", ()), row.dx, g),
                partial(y, getattr(yd, "shape", ()), row.dy, g))

    return result(out, _node_name(name), backward, (x, y), exact_dtype=True)


def _node_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_")) + "Backward"


def _op(name: str) -> Callable[[Any, Any], Any]:
    def op(input: Any, other: Any) -> Any:  # noqa: A002 - torch's argument name
        return apply(name, input, other)

    op.__name__ = name
    op.__doc__ = f"torch.{name}: elementwise with broadcasting."
    return op


OPS: dict[str, Callable[[Any, Any], Any]] = {name: _op(name) for name in ROWS}
OPS["arctan2"] = OPS["atan2"]


def _logical(name: str, fn: Callable) -> Callable:
    def op(input: Any, other: Any) -> Any:  # noqa: A002
        a, b = val(input), val(other)
        try:
            return wrap(xp_of(a if hasattr(a, "dtype") else b).asarray(fn(a != 0, b != 0)))
        except ValueError as exc:
            raise broadcast_error(name, a, b, exc) from exc

    op.__name__ = name
    op.__doc__ = f"torch.{name}: a bool tensor, no gradient."
    return op


def _bitwise(name: str, fn: Callable) -> Callable:
    def op(input: Any, other: Any) -> Any:  # noqa: A002
        dt, a, b = promote(val(input), val(other))
        if category(dt) >= 2:
            raise RuntimeError(f'"{name}_cpu" not implemented for '
                               f"'{'Float' if dt == np.float32 else dt.name}'")
        try:
            return wrap(as_dtype(xp_of(a if hasattr(a, "dtype") else b).asarray(fn(a, b)), dt))
        except ValueError as exc:
            raise broadcast_error(name, a, b, exc) from exc

    op.__name__ = name
    op.__doc__ = f"torch.{name}: integer and bool tensors, no gradient."
    return op


OPS.update({
    "logical_and": _logical("logical_and", np.logical_and),
    "logical_or": _logical("logical_or", np.logical_or),
    "logical_xor": _logical("logical_xor", np.logical_xor),
    "bitwise_and": _bitwise("bitwise_and", lambda a, b: a & b),
    "bitwise_or": _bitwise("bitwise_or", lambda a, b: a | b),
    "bitwise_xor": _bitwise("bitwise_xor", lambda a, b: a ^ b),
    "gcd": _bitwise("gcd", np.gcd),
    "lcm": _bitwise("lcm", np.lcm),
})


def logical_not(input: Any) -> Any:  # noqa: A002
    """torch.logical_not: a bool tensor."""
    return wrap(val(input) == 0)


def bitwise_not(input: Any) -> Any:  # noqa: A002
    """torch.bitwise_not: ~x for integers, not x for bools."""
    a = val(input)
    if category(a.dtype) >= 2:
        raise RuntimeError("bitwise_not is only supported for integer and boolean tensors")
    return wrap(~a)


def float_power(input: Any, exponent: Any) -> Any:  # noqa: A002
    """torch.float_power: pow computed and returned in float64."""
    return arith.pow(_as_double(input), _as_double(exponent))


def _as_double(x: Any) -> Any:
    if hasattr(x, "array"):
        return x.to(np.float64) if x.array.dtype != np.float64 else x
    return float(x)


def lerp(input: Any, end: Any, weight: Any) -> Any:  # noqa: A002
    """input + weight * (end - input)."""
    return arith.add(input, arith.mul(weight, arith.sub(end, input)))


def addcmul(input: Any, tensor1: Any, tensor2: Any, *, value: Any = 1) -> Any:  # noqa: A002
    """input + value * tensor1 * tensor2."""
    return arith.add(input, arith.mul(arith.mul(tensor1, tensor2), value))


def addcdiv(input: Any, tensor1: Any, tensor2: Any, *, value: Any = 1) -> Any:  # noqa: A002
    """input + value * tensor1 / tensor2 (integer operands refused, as torch does)."""
    for t in (tensor1, tensor2):
        if hasattr(t, "array") and category(t.array.dtype) < 2:
            raise RuntimeError(
                "Integer division with addcdiv is no longer supported, and in a future release "
                "addcdiv will perform a true division of tensor1 and tensor2.")
    return arith.add(input, arith.mul(arith.div(tensor1, tensor2), value))
