"""Attach the ops to Tensor as methods and operators (called once from core/tensor.py).

Every op module imports Tensor from core/tensor.py, and tensor.py calls `bind_methods` at its
end, once Tensor exists: so the functions here import the op modules late. That is core's one
deliberate import cycle (tests/unit/test_layout.py allows exactly it).
"""

from __future__ import annotations

from typing import Any, Callable


def bind_methods(cls: type) -> None:
    """Install operators and op methods on the Tensor class."""
    from shoal.core.ops import complex as complex_ops  # noqa: PLC0415 - the cycle below
    from shoal.core.ops import derived, everyday, inplace  # noqa: PLC0415 - the cycle below

    more = {name: getattr(derived, name) for name in _DERIVED}
    more.update(complex_ops.METHODS)
    for name, prop in complex_ops.PROPERTIES.items():
        setattr(cls, name, prop)
    # everyday's registry first: an op bound under the same name by the older tables wins
    for name, fn in {**everyday.METHODS, **_operators(), **_methods(), **inplace.OPERATORS,
                     **inplace.METHODS, **more}.items():
        setattr(cls, name, fn)
    _bind_views(cls)


# core/ops/derived.py's ops, bound under their own names.
_DERIVED = ("sin", "cos", "tan", "mm", "bmm", "norm", "narrow", "repeat")


def _operators() -> dict[str, Callable]:
    """Python's operators: a binary one reflects, and answers NotImplemented to an operand that
    no op takes, so that Python tries the other side."""
    from shoal.core.ops import arith, linalg, shape, unary  # noqa: PLC0415 - the cycle above
    from shoal.core.ops._util import UnsupportedOperand  # noqa: PLC0415 - the cycle above

    def swap(fn: Any) -> Any:
        def reflected(self: Any, other: Any) -> Any:
            return fn(other, self)

        reflected.__name__ = f"r{fn.__name__}"
        return reflected

    def r_or_not(fn: Any) -> Any:
        def forward(self: Any, other: Any) -> Any:
            try:
                return fn(self, other)
            except UnsupportedOperand:
                return NotImplemented

        forward.__name__ = fn.__name__
        return forward

    return {
        "__add__": r_or_not(arith.add),
        "__radd__": swap(arith.add),
        "__sub__": r_or_not(arith.sub),
        "__rsub__": swap(arith.sub),
        "__mul__": r_or_not(arith.mul),
        "__rmul__": swap(arith.mul),
        "__truediv__": r_or_not(arith.div),
        "__rtruediv__": swap(arith.div),
        # Python 2's names, which torch.Tensor still carries (old code calls them directly)
        "__div__": r_or_not(arith.div),
        "__rdiv__": swap(arith.div),
        "__pow__": r_or_not(arith.pow),
        "__rpow__": swap(arith.pow),
        "__matmul__": r_or_not(linalg.matmul),
        "__rmatmul__": swap(linalg.matmul),
        "__neg__": arith.neg,
        "__pos__": lambda self: self,
        "__abs__": unary.abs,
        "__eq__": arith.eq,
        "__ne__": arith.ne,
        "__lt__": arith.lt,
        "__le__": arith.le,
        "__gt__": arith.gt,
        "__ge__": arith.ge,
        "__getitem__": shape.getitem,
        "__setitem__": shape.setitem,
    }


def _methods() -> dict[str, Callable]:
    """The ops that are also Tensor methods, under torch's method names."""
    from shoal.core.ops import (  # noqa: PLC0415 - the cycle above
        arith, linalg, logical, reduce, scans, shape, unary,
    )

    return {
        "add": arith.add,
        "sub": arith.sub,
        "mul": arith.mul,
        "div": arith.div,
        "pow": arith.pow,
        "neg": arith.neg,
        "eq": arith.eq,
        "ne": arith.ne,
        "lt": arith.lt,
        "le": arith.le,
        "gt": arith.gt,
        "ge": arith.ge,
        "matmul": linalg.matmul,
        "exp": unary.exp,
        "log": unary.log,
        "sqrt": unary.sqrt,
        "tanh": unary.tanh,
        "sigmoid": unary.sigmoid,
        "relu": unary.relu,
        "gelu": unary.gelu,
        "abs": unary.abs,
        "clamp": unary.clamp,
        "clip": unary.clamp,
        "sum": reduce.sum,
        "mean": reduce.mean,
        "prod": reduce.prod,
        "max": reduce.max,
        "min": reduce.min,
        "amax": reduce.amax,
        "amin": reduce.amin,
        "argmax": reduce.argmax,
        "argmin": reduce.argmin,
        "var": scans.var,
        "softmax": reduce.softmax,
        "log_softmax": reduce.log_softmax,
        "logsumexp": reduce.logsumexp,
        "reshape": shape.reshape,
        "view": shape.view,
        "flatten": shape.flatten,
        "unsqueeze": shape.unsqueeze,
        "squeeze": shape.squeeze,
        "transpose": shape.transpose,
        "permute": shape.permute,
        "expand": shape.expand,
        "contiguous": shape.contiguous,
        "clone": shape.clone,
        "split": shape.split,
        "chunk": shape.chunk,
        "maximum": shape.maximum,
        "minimum": shape.minimum,
        "t": shape.t,
        "all": logical.all,
        "any": logical.any,
        "equal": logical.equal,
        "isclose": logical.isclose,
        "allclose": logical.allclose,
        "nonzero": logical.nonzero,
    }


def _bind_views(cls: type) -> None:
    """The properties (T, mT) and the methods that adapt an op's arguments."""
    from shoal.core.ops import interop, shape  # noqa: PLC0415 - the cycle above

    cls.T = property(shape.T, doc="All dims reversed (the matrix transpose for 2-D).")
    cls.mT = property(
        lambda self: shape.transpose(self, -2, -1), doc="The last two dims swapped."
    )

    def expand_as(self: Any, other: Any) -> Any:
        return shape.expand(self, other.shape)

    def view_as(self: Any, other: Any) -> Any:
        return shape.reshape(self, other.shape)

    def dlpack(self: Any, *args: Any, **kwargs: Any) -> Any:
        return interop.to_dlpack(self, *args, **kwargs)

    cls.expand_as = expand_as
    cls.view_as = view_as
    cls.__dlpack__ = dlpack
