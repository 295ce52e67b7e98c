"""In-place arithmetic with torch's semantics: `t += x` and friends, `add_`, `sub_`, `mul_`, `div_`.

The update lands in t's own array (so views and other references see it) and counts in its
version counter. torch's rules: a leaf that requires grad is refused in grad mode; the result
dtype must cast to t's without leaving its kind (float into int is refused); the broadcast
shape must be t's. When t or the operand is part of a graph (grad mode on), the update is
recorded: t takes the op's node, and the node's inputs hold a copy of t's old value, so the
graph keeps no edge from t to itself.
"""

from __future__ import annotations

from typing import Any, Callable

from shoal.core.autograd import AutogradError
from shoal.core.grad_mode import grad_mode
from shoal.core.ops import arith
from shoal.core.ops._util import UnsupportedOperand, needs_grad, xp_of
from shoal.core.tensor import LEAF_INPLACE, Tensor, bump_version, wrap

# torch's names for dtypes in its cast error ("result type Float can't be cast to ... Long").
_TORCH_NAMES = {
    "float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16",
    "int64": "Long", "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte",
    "bool": "Bool",
}
_KIND_RANK = {"b": 0, "u": 1, "i": 1, "f": 2, "V": 2}  # bfloat16 is kind 'V' in ml_dtypes


def update(t: Tensor, fn: Callable, other: Any) -> Tensor:
    """t = fn(t, other), written into t's own array; returns t."""
    if grad_mode.enabled and (t.requires_grad or needs_grad(other)):
        if t.requires_grad and t.grad_fn is None:
            raise AutogradError(LEAF_INPLACE)
        old = wrap(t.array.copy())
        old.requires_grad, old.grad_fn = t.requires_grad, t.grad_fn
        out = fn(old, other)
        _store(t, out.array)
        t.grad_fn, t.requires_grad = out.grad_fn, out.requires_grad
        return t
    _store(t, fn(t, other).array)
    return t


def _store(t: Tensor, new: Any) -> None:
    dst = t.array
    if new.shape != dst.shape:
        raise RuntimeError(
            f"output with shape {list(dst.shape)} doesn't match the broadcast shape "
            f"{list(new.shape)}"
        )
    if _KIND_RANK.get(new.dtype.kind, 2) > _KIND_RANK.get(dst.dtype.kind, 2):
        raise RuntimeError(
            f"result type {_TORCH_NAMES.get(new.dtype.name, new.dtype.name)} can't be cast to "
            f"the desired output type {_TORCH_NAMES.get(dst.dtype.name, dst.dtype.name)}"
        )
    xp_of(dst).copyto(dst, new, casting="unsafe")
    bump_version(t)


def _scaled(fn: Callable, alpha: Any) -> Callable:
    """fn(a, alpha * b): add_/sub_'s alpha."""
    return lambda a, b: fn(a, arith.mul(b, alpha))


def add_(self: Tensor, other: Any, alpha: Any = 1) -> Tensor:
    """self += alpha * other, in place."""
    return update(self, arith.add if alpha == 1 else _scaled(arith.add, alpha), other)


def sub_(self: Tensor, other: Any, alpha: Any = 1) -> Tensor:
    """self -= alpha * other, in place."""
    return update(self, arith.sub if alpha == 1 else _scaled(arith.sub, alpha), other)


def mul_(self: Tensor, other: Any) -> Tensor:
    """self *= other, in place."""
    return update(self, arith.mul, other)


def div_(self: Tensor, other: Any) -> Tensor:
    """self /= other, in place."""
    return update(self, arith.div, other)


def pow_(self: Tensor, exponent: Any) -> Tensor:
    """self **= exponent, in place."""
    return update(self, arith.pow, exponent)


def augmented(fn: Callable) -> Callable:
    """Python's augmented assignment: NotImplemented for an operand no op takes."""

    def inplace(self: Tensor, other: Any) -> Any:
        try:
            return update(self, fn, other)
        except UnsupportedOperand:
            return NotImplemented

    inplace.__name__ = f"i{fn.__name__}"
    return inplace


OPERATORS = {
    "__iadd__": augmented(arith.add),
    "__isub__": augmented(arith.sub),
    "__imul__": augmented(arith.mul),
    "__itruediv__": augmented(arith.div),
    "__ipow__": augmented(arith.pow),
}  # no __imatmul__: torch has none, so `a @= b` rebinds a to a new tensor there too
METHODS = {"add_": add_, "sub_": sub_, "mul_": mul_, "div_": div_, "pow_": pow_}
