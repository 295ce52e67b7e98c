"""torch's elementwise math beyond exp/log/sqrt/tanh: one table row per op, not one function each.

A row names the op, its numpy function and its derivative in terms of the input `x` and the
output `y`. Every row gets torch's dtype rules: integer and bool inputs compute in the default
float dtype (torch's "int-to-float" ops), bfloat16 and float16 compute in float32 and round once
(core/ops/_opmath.py), and the rounding ops (floor, ceil, round, trunc, sign) keep integer inputs
as they are. Each op also gets its in-place method `name_` through core/ops/inplace.py.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from shoal.core.ops._opmath import narrow, widen
from shoal.core.ops._promote import default_float, category
from shoal.core.ops._util import result, xp_of
from shoal.core.tensor import Tensor

_LN2 = float(np.log(2.0))
_LN10 = float(np.log(10.0))


class Row(NamedTuple):
    """One unary op: numpy forward, derivative dy/dx from (xp, x, y), and its integer rule."""

    forward: Callable[[Any, Any], Any]
    derivative: Callable[[Any, Any, Any], Any] | None  # None: zero gradient (floor, sign, ...)
    keeps_integers: bool = False  # floor/ceil/round/trunc/sign/abs of an int stay ints


def _zero(xp: Any, x: Any, y: Any) -> Any:
    return xp.zeros_like(x)


ROWS: dict[str, Row] = {
    "log1p": Row(lambda xp, x: xp.log1p(x), lambda xp, x, y: 1 / (1 + x)),
    "expm1": Row(lambda xp, x: xp.expm1(x), lambda xp, x, y: y + 1),
    "log2": Row(lambda xp, x: xp.log2(x), lambda xp, x, y: 1 / (x * _LN2)),
    "log10": Row(lambda xp, x: xp.log10(x), lambda xp, x, y: 1 / (x * _LN10)),
    "exp2": Row(lambda xp, x: xp.exp2(x), lambda xp, x, y: y * _LN2),
    "rsqrt": Row(lambda xp, x: 1 / xp.sqrt(x), lambda xp, x, y: -0.5 * y * y * y),
    "reciprocal": Row(lambda xp, x: 1 / x, lambda xp, x, y: -y * y),
    "sinh": Row(lambda xp, x: xp.sinh(x), lambda xp, x, y: xp.cosh(x)),
    "cosh": Row(lambda xp, x: xp.cosh(x), lambda xp, x, y: xp.sinh(x)),
    "asin": Row(lambda xp, x: xp.arcsin(x), lambda xp, x, y: 1 / xp.sqrt(1 - x * x)),
    "acos": Row(lambda xp, x: xp.arccos(x), lambda xp, x, y: -1 / xp.sqrt(1 - x * x)),
    "atan": Row(lambda xp, x: xp.arctan(x), lambda xp, x, y: 1 / (1 + x * x)),
    "asinh": Row(lambda xp, x: xp.arcsinh(x), lambda xp, x, y: 1 / xp.sqrt(x * x + 1)),
    "acosh": Row(lambda xp, x: xp.arccosh(x), lambda xp, x, y: 1 / xp.sqrt(x * x - 1)),
    "atanh": Row(lambda xp, x: xp.arctanh(x), lambda xp, x, y: 1 / (1 - x * x)),
    "deg2rad": Row(lambda xp, x: x * (np.pi / 180), lambda xp, x, y: xp.full_like(x, np.pi / 180)),
    "rad2deg": Row(lambda xp, x: x * (180 / np.pi), lambda xp, x, y: xp.full_like(x, 180 / np.pi)),
    "square": Row(lambda xp, x: x * x, lambda xp, x, y: 2 * x, keeps_integers=True),
    "floor": Row(lambda xp, x: xp.floor(x), None, keeps_integers=True),
    "ceil": Row(lambda xp, x: xp.ceil(x), None, keeps_integers=True),
    "trunc": Row(lambda xp, x: xp.trunc(x), None, keeps_integers=True),
    "frac": Row(lambda xp, x: x - xp.trunc(x), lambda xp, x, y: xp.ones_like(x)),
    "sign": Row(lambda xp, x: xp.sign(x), None, keeps_integers=True),
}
# aliases torch keeps for NumPy's names
ALIASES = {"arcsin": "asin", "arccos": "acos", "arctan": "atan", "arcsinh": "asinh",
           "arccosh": "acosh", "arctanh": "atanh", "fix": "trunc"}


def _input_for(row: Row, x: Any) -> Any:
    """The array the row computes on: ints in the default float unless the row keeps them."""
    xd = x.array
    if category(xd.dtype) < 2:
        if row.keeps_integers and xd.dtype != np.bool_:
            return xd
        if row.keeps_integers:  # torch: sign/square of a bool is a bool/int64
            return xd.astype(np.int64) if row.derivative is not None else xd
        return xd.astype(default_float())
    return xd


def apply(name: str, x: Tensor) -> Tensor:
    """Run the table's op `name` on x, recording its gradient."""
    row = ROWS[name]
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}(): argument 'input' (position 1) must be Tensor, not "
                        f"{type(x).__name__}")
    xd = _input_for(row, x)
    xp = xp_of(xd)
    dt = xd.dtype
    wide = widen(xd)
    with np.errstate(all="ignore"):  # torch returns nan/inf for out-of-domain input silently
        out = narrow(xp.asarray(row.forward(xp, wide)).astype(wide.dtype, copy=False), dt)
    if dt == np.bool_ and name == "sign":
        out = out.astype(np.bool_)

    def backward(g: Any) -> tuple:
        if row.derivative is None:
            return (xp.zeros_like(g),)
        with np.errstate(all="ignore"):
            return (narrow(widen(g) * row.derivative(xp, wide, widen(out)), dt),)

    return result(out, name.capitalize() + "Backward", backward, (x,), exact_dtype=True)


def _op(name: str) -> Callable[[Tensor], Tensor]:
    def op(x: Tensor) -> Tensor:
        return apply(name, x)

    op.__name__ = name
    op.__doc__ = f"torch.{name}: elementwise, with its gradient."
    return op


OPS: dict[str, Callable[[Tensor], Tensor]] = {name: _op(name) for name in ROWS}
OPS.update({alias: OPS[target] for alias, target in ALIASES.items()})


def round(x: Tensor, decimals: int = 0) -> Tensor:  # noqa: A001 - torch's name
    """Round half to even, as torch does; `decimals` rounds to that many decimal places."""
    if decimals == 0:
        return _rounded(x)
    xd = x.array
    xp = xp_of(xd)
    dt = xd.dtype
    out = narrow(xp.round(widen(xd), decimals), dt)
    return result(out, "RoundBackward", lambda g: (xp.zeros_like(g),), (x,), exact_dtype=True)


ROWS["round"] = Row(lambda xp, x: xp.round(x), None, keeps_integers=True)
_rounded = _op("round")
