"""torch.autograd.Function: a forward and a backward the user writes, run by core's engine.

`MyFn.apply(*args)` runs `forward` without recording, then gives each differentiable output a
node of class `MyFnBackward`, which is also the `ctx` forward saw (as in torch, where
`y.grad_fn` is the ctx). Its backward runs inside core's engine like any op's node: in the
first-order engine it maps array gradients to array gradients (so the profiler names it
"MyFnBackward"); with create_graph=True (core/double_backward.py) it runs the user's backward in
grad mode, so a backward written in core ops is itself differentiable.

A Function with several outputs has one node for all of them, as in torch: a hidden tensor
carries it, and each output's own node hands its gradient to that tensor in one slot of a
`_Slots`, which the engine adds up like any gradient, so the backward runs once, with every
output's gradient.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from shoal.core.autograd import AutogradError, Node, freed_error
from shoal.core.double_backward import sum_to
from shoal.core.grad_mode import grad_mode, no_grad
from shoal.core.ops._util import unbroadcast, xp_of
from shoal.core.tensor import Tensor, wrap

__all__ = ["BackwardCFunction", "Function", "FunctionCtx", "once_differentiable"]


class BackwardCFunction(Node):
    """The `ctx` of one `apply`, and the node its outputs' gradients flow through."""

    _forward_cls: Any = None  # the Function subclass (set on each generated subclass)

    def __init__(self, args: tuple) -> None:
        super().__init__(type(self).__name__, self._backward_arrays, ())
        self.needs_input_grad = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
        self.materialize_grads = True
        self._saved: tuple = ()
        self._non_differentiable: tuple = ()
        self._outputs: tuple = ()  # (shape, dtype, array module) per output, for zero grads

    def save_for_backward(self, *tensors: Any) -> None:
        """Keep tensors for backward (read back as ctx.saved_tensors); None is allowed."""
        versions = []
        for i, t in enumerate(tensors):
            if t is None:
                continue
            if not isinstance(t, Tensor):
                raise TypeError(f"save_for_backward can only save variables, but argument {i} "
                                f"is of type {type(t).__name__}")
            counter = t._vc  # noqa: SLF001 - the version counter is autograd's business
            if counter is None:
                counter = t._vc = [0]  # noqa: SLF001
            versions.append((counter, counter[0]))
        self._saved = tensors
        self.versions = tuple(versions)

    @property
    def saved_tensors(self) -> tuple:
        """The tensors given to save_for_backward (freed once a backward without retain_graph
        ran through this node, as in torch)."""
        if self.backward_fn is None:
            raise freed_error(self.name())
        return self._saved

    def mark_non_differentiable(self, *outputs: Any) -> None:
        """These outputs get no gradient: requires_grad=False, and zeros reach backward."""
        self._non_differentiable = outputs

    def set_materialize_grads(self, value: bool) -> None:
        """False: an output that received no gradient passes None to backward, not zeros."""
        self.materialize_grads = bool(value)

    def _grad_outputs(self, g: Any) -> tuple:
        """The output gradients backward receives, as tensors."""
        if not isinstance(g, _Slots):
            return (g if isinstance(g, Tensor) else wrap(g),)
        grads = []
        for slot, (shape, dtype, xp) in zip(g.slots, self._outputs):
            if slot is None and self.materialize_grads and dtype is not None:
                slot = xp.zeros(shape, dtype)
            grads.append(slot if slot is None or isinstance(slot, Tensor) else wrap(slot))
        return tuple(grads)

    def _call_backward(self, g: Any) -> list:
        """Run the user's backward and check what it returned, as torch does."""
        result = self._forward_cls.backward(self, *self._grad_outputs(g))
        grads = list(result) if isinstance(result, (tuple, list)) else [result]
        n = len(self.inputs)
        if len(grads) > n and all(x is None for x in grads[n:]):
            del grads[n:]  # torch drops surplus Nones
        if len(grads) != n:
            raise AutogradError(f"function {self.name()} returned an incorrect number of "
                                f"gradients (expected {n}, got {len(grads)})")
        for i, (gi, inp) in enumerate(zip(grads, self.inputs)):
            if gi is None:
                continue
            if inp is None:
                raise AutogradError(
                    f"function {self.name()} returned a gradient different than None at "
                    f"position {i + 1}, but the corresponding forward input was not a Variable")
            if not isinstance(gi, Tensor):
                raise TypeError(f"function {self.name()} returned a {type(gi).__name__} as "
                                f"gradient {i}; expected a Tensor or None")
            if not _expandable(inp.shape, gi.shape):
                raise AutogradError(
                    f"Function {self.name()} returned an invalid gradient at index {i} - got "
                    f"{list(gi.shape)} but expected shape compatible with {list(inp.shape)}")
            if not inp.requires_grad:
                grads[i] = None
        return grads

    def _backward_arrays(self, g: Any) -> tuple:
        """The first-order engine's call: array gradients in, fresh array gradients out."""
        grads = self._call_backward(g)
        out = []
        root = g if isinstance(g, _Slots) or g.base is None else g.base
        for gi, inp in zip(grads, self.inputs):
            if gi is None:
                out.append(None)
                continue
            arr = unbroadcast(gi.array, inp.array.shape)
            if arr.dtype != inp.array.dtype:
                arr = arr.astype(inp.array.dtype)
            elif arr is gi.array and arr is not root and arr.base is not root:
                # The engine may adopt the array as .grad and add into it in place: it must
                # not be one the user still holds (a saved tensor, an attribute of ctx).
                arr = arr.copy()
            out.append(arr)
        return tuple(out)

    def _connect(self, args: tuple, output: Any) -> Any:
        """Give the outputs their nodes: self for one output, one each for several."""
        self.inputs = tuple(a if isinstance(a, Tensor) else None for a in args)
        single = not isinstance(output, tuple)
        outs = [output] if single else list(output)
        for i, o in enumerate(outs):
            if isinstance(o, Tensor) and (o.requires_grad or any(o is a for a in args)):
                outs[i] = o.detach()  # an input returned as is: a new tensor sharing its data
        differentiable = [isinstance(o, Tensor) and o.array.dtype.kind in "fV"
                          and not any(o is n for n in self._non_differentiable) for o in outs]
        if single:
            if differentiable[0]:
                outs[0].requires_grad, outs[0].grad_fn = True, self
            return outs[0]
        self._outputs = tuple(
            (o.array.shape, o.array.dtype, xp_of(o.array)) if isinstance(o, Tensor)
            else ((), None, None) for o in outs)
        joint = wrap(np.empty(0))  # carries this node for all the outputs' nodes
        joint.requires_grad, joint.grad_fn = True, self
        for i, o in enumerate(outs):
            if differentiable[i]:
                o.requires_grad = True
                o.grad_fn = _OutputNode(self.name(), joint, i, len(outs))
        return tuple(outs)

    def graph_backward(self, g: Any) -> tuple:
        """The create_graph engine's call: the user's backward, recorded, on tensors."""
        out = []
        for gi, inp in zip(self._call_backward(g), self.inputs):
            if gi is not None:
                gi = sum_to(gi, inp.shape)
                if gi.array.dtype != inp.array.dtype:
                    gi = gi.to(inp.dtype)
            out.append(gi)
        return tuple(out)


FunctionCtx = BackwardCFunction


def _expandable(shape: tuple, grad_shape: tuple) -> bool:
    """Whether `shape` broadcasts to `grad_shape` (torch then sums the gradient down)."""
    if len(shape) > len(grad_shape):
        return False
    tail = grad_shape[len(grad_shape) - len(shape):]
    return all(a == b or a == 1 for a, b in zip(shape, tail))


class _Slots:
    """One gradient (or None) per output of a multi-output Function; `+` adds slot by slot.

    The engines treat it as a gradient they never add into in place (`flags`); it has no base,
    and owns no bytes the profiler should count.
    """

    __slots__ = ("slots", "__weakref__")

    base = None
    nbytes = 0
    flags = type("_NotInPlace", (), {"c_contiguous": False, "writeable": False})()

    def __init__(self, slots: list) -> None:
        self.slots = slots

    def __add__(self, other: "_Slots") -> "_Slots":
        return _Slots([b if a is None else a if b is None else a + b
                       for a, b in zip(self.slots, other.slots)])


class _OutputNode(Node):
    """Output i of a multi-output Function: puts its gradient into slot i for the shared node."""

    __slots__ = ("index", "count")

    def __init__(self, name: str, joint: Tensor, index: int, count: int) -> None:
        super().__init__(name, self._to_slot, (joint,))
        self.index = index
        self.count = count

    def _to_slot(self, g: Any) -> tuple:
        slots = [None] * self.count
        slots[self.index] = g
        return (_Slots(slots),)

    graph_backward = _to_slot


class Function:
    """Subclass with static forward(ctx, *args) and backward(ctx, *grads); call .apply(...)."""

    _backward_cls: type = BackwardCFunction

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._backward_cls = type(cls.__name__ + "Backward", (BackwardCFunction,),
                                 {"_forward_cls": cls, "__module__": cls.__module__})

    def __call__(self, *args: Any) -> Any:
        raise RuntimeError(
            "Legacy autograd function with non-static forward method is deprecated. Please use "
            "new-style autograd function with static forward method. (Example: "
            "https://pytorch.org/docs/stable/autograd.html#torch.autograd.Function)")

    @staticmethod
    def forward(ctx: Any, *args: Any) -> Any:
        """The computation, on tensors, run without recording (override it)."""
        raise NotImplementedError(
            "You must implement the forward function for custom autograd.Function.")

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        """Newer style: save what backward needs here; forward then takes no ctx."""
        raise NotImplementedError("setup_context is not implemented.")

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        """One gradient (or None) per forward input, from one gradient per output."""
        raise NotImplementedError(
            "You must implement either the backward or vjp method for your custom "
            "autograd.Function to use it with backward mode AD.")

    @classmethod
    def apply(cls, *args: Any) -> Any:
        """Run forward on args and record backward for the outputs (when grad is needed)."""
        ctx = cls._backward_cls(args)
        recording = grad_mode.enabled and any(ctx.needs_input_grad)
        prev = grad_mode.enabled
        grad_mode.enabled = False
        try:
            if cls.setup_context is not Function.setup_context:
                output = cls.forward(*args)
                cls.setup_context(ctx, args, output)
            else:
                output = cls.forward(ctx, *args)
        finally:
            grad_mode.enabled = prev
        if not recording:
            return output
        return ctx._connect(args, output)  # noqa: SLF001 - its ctx, made above


class _DelayedErrorNode(Node):
    """Stands behind a once_differentiable backward's results: differentiating them fails."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__("DelayedError", _differentiated_twice, ())


def _differentiated_twice(g: Any) -> tuple:
    raise AutogradError(
        "trying to differentiate twice a function that was marked with @once_differentiable")


def once_differentiable(fn: Callable) -> Callable:
    """Run a backward without recording; differentiating its results again raises, as torch."""

    @functools.wraps(fn)
    def wrapper(ctx: Any, *args: Any) -> Any:
        with no_grad():
            outputs = fn(ctx, *args)
        if not grad_mode.enabled:
            return outputs
        if not any(isinstance(a, Tensor) and a.requires_grad for a in args):
            return outputs
        single = not isinstance(outputs, tuple)
        marked = []
        for o in [outputs] if single else outputs:
            if isinstance(o, Tensor):
                o = o.detach()
                o.requires_grad, o.grad_fn = True, _DelayedErrorNode()
            marked.append(o)
        return marked[0] if single else tuple(marked)

    return wrapper
