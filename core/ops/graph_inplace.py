"""copy_, zero_ and fill_ inside an autograd graph, as torch records them.

Tensor's own copy_/zero_/fill_ (core/tensor.py) write raw arrays and refuse a tensor that is
part of a graph. torch records them instead: `x = a * 2; x.copy_(w)` leaves x with a node that
sends the gradient to w (and none to the overwritten a * 2), and `x.zero_()` cuts a's gradient.
These wrappers take the recorded path (core/ops/inplace.py's update: the node's input holds a
copy of the old value) exactly when torch would record, and the plain methods otherwise, so the
optimizer's hot path (no grad) keeps its speed.
"""

from __future__ import annotations

from typing import Any, Callable

from shoal.core import backend
from shoal.core.grad_mode import grad_mode
from shoal.core.ops import inplace
from shoal.core.ops._util import needs_grad, result, unbroadcast, xp_of
from shoal.core.tensor import Tensor

# The class's own methods, read before bind_methods installs these wrappers over them.
_PLAIN: dict[str, Callable] = {name: getattr(Tensor, name) for name in ("copy_", "zero_", "fill_")}


def _records(t: Tensor, other: Any) -> bool:
    """torch records an in-place write when grad mode is on and t or the source needs grad;
    a leaf that requires grad is refused by update(), as torch refuses it."""
    return grad_mode.enabled and (t.requires_grad or needs_grad(other))


def _overwrite(old: Tensor, src: Any) -> Tensor:
    """The value of `old` after copy_(src): src broadcast and cast to old's shape and dtype;
    the gradient reaches src (summed over broadcast dims), none reaches old."""
    od = old.array
    xp = xp_of(od)
    sd = src.array
    if backend.device_of(sd) != backend.device_of(od):
        sd = backend.to_device(sd, backend.device_of(od))
    out = xp.empty_like(od)
    xp.copyto(out, sd, casting="unsafe")

    def backward(g: Any) -> tuple:
        gs = unbroadcast(g, sd.shape).astype(src.array.dtype, copy=False)
        return (xp.zeros_like(g), gs)  # torch sends the overwritten value zeros, not nothing

    return result(out, "CopyBackwards", backward, (old, src), exact_dtype=True)


def _filled(old: Tensor, value: Any) -> Tensor:
    """The value of `old` after fill_(value): value's gradient is the sum of g, old's none."""
    od = old.array
    out = xp_of(od).full_like(od, value.array if isinstance(value, Tensor) else value)

    def backward(g: Any) -> tuple:
        gv = g.sum().reshape(()).astype(value.array.dtype) if needs_grad(value) else None
        return (xp_of(g).zeros_like(g), gv)

    return result(out, "FillBackward", backward, (old, value), exact_dtype=True)


def copy_(self: Tensor, src: Any, non_blocking: bool = False) -> Tensor:
    """Copy src's values into this tensor in place, recorded in the graph as torch records it."""
    if isinstance(src, Tensor) and _records(self, src):
        return inplace.update(self, _overwrite, src)
    return _PLAIN["copy_"](self, src)


def zero_(self: Tensor) -> Tensor:
    """Fill with zeros in place (inside a graph: the old value's gradient is cut)."""
    if _records(self, None):
        return inplace.update(self, _filled, 0)
    return _PLAIN["zero_"](self)


def fill_(self: Tensor, value: Any) -> Tensor:
    """Fill with a value in place (a 0-d tensor value that requires grad gets the sum of g)."""
    if _records(self, value):
        if isinstance(value, Tensor) and value.numel() != 1:
            raise RuntimeError("fill_ only supports 0-dimension value tensor but got tensor "
                               f"with {value.ndim} dimensions.")
        return inplace.update(self, _filled, value)
    return _PLAIN["fill_"](self, value)


METHODS = {"copy_": copy_, "zero_": zero_, "fill_": fill_}
