"""create_graph formulas for ops core/double_backward.py has none for, which jvp, jacfwd and
hessian (double-vjp) need: registered only where the table has no entry of its own."""

from __future__ import annotations

from typing import Any

from shoal.core.double_backward import FORMULAS
from shoal.core.ops import arith, derived


def _sin(node: Any, g: Any) -> tuple:
    (x,) = node.inputs
    return (arith.mul(g, derived.cos(x)),)


def _cos(node: Any, g: Any) -> tuple:
    (x,) = node.inputs
    return (arith.neg(arith.mul(g, derived.sin(x))),)


def _tan(node: Any, g: Any) -> tuple:
    (x,) = node.inputs
    t = derived.tan(x)
    return (arith.mul(g, arith.add(arith.mul(t, t), 1.0)),)


def _abs(node: Any, g: Any) -> tuple:
    (x,) = node.inputs
    sign = arith.sub(arith.gt(x, 0).to(x.dtype), arith.lt(x, 0).to(x.dtype))
    return (arith.mul(g, sign),)


for _name, _formula in (("SinBackward", _sin), ("CosBackward", _cos), ("TanBackward", _tan),
                        ("AbsBackward", _abs)):
    FORMULAS.setdefault(_name, _formula)
