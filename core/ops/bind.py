"""Attach the ops to Tensor as methods and operators (called once from core/tensor.py)."""

from __future__ import annotations

from typing import Any


def bind_methods(cls: type) -> None:
    """Install operators and op methods on the Tensor class."""
    from shoal.core.ops import arith
    from shoal.core.ops import interop
    from shoal.core.ops import linalg
    from shoal.core.ops import logical
    from shoal.core.ops import reduce
    from shoal.core.ops import shape
    from shoal.core.ops import unary  # noqa: PLC0415
    from shoal.core.ops._util import UnsupportedOperand  # noqa: PLC0415

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

    ops = {
        "__add__": r_or_not(arith.add),
        "__radd__": swap(arith.add),
        "__sub__": r_or_not(arith.sub),
        "__rsub__": swap(arith.sub),
        "__mul__": r_or_not(arith.mul),
        "__rmul__": swap(arith.mul),
        "__truediv__": r_or_not(arith.div),
        "__rtruediv__": swap(arith.div),
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
        "max": reduce.max,
        "min": reduce.min,
        "amax": reduce.amax,
        "amin": reduce.amin,
        "argmax": reduce.argmax,
        "argmin": reduce.argmin,
        "var": reduce.var,
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
    for name, fn in ops.items():
        setattr(cls, name, fn)
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
