"""Reverse-mode autograd: grad mode, graph nodes, hooks and the backward engine.

Each op (in core/ops) computes its forward on raw arrays and hands `Node` a closure that maps
the output's gradient to one gradient per input, reduced to that input's shape. The engine here
walks the graph without recursion. A node runs once all of its consumers have delivered their
gradients, and among ready nodes the most recently created runs first (as torch does), so a
leaf's gradient is accumulated, and its post-accumulate hooks fire, the moment its last
contribution arrives: DDP starts reducing a parameter's gradient while backward goes on.

Ownership contract for backward closures: each returned array is either fresh (nobody else
holds it) or a view of the incoming gradient. The engine then knows which arrays it may adopt
as `.grad` or add into in place, and copies only the rest.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from typing import Any, Callable

from core.errors import ShoalError


class AutogradError(ShoalError, RuntimeError):
    """Misuse of autograd: a freed graph, a missing grad, a non-scalar output without grad."""


class _GradMode(threading.local):
    # Thread-local like torch's: a backward running in an RPC thread must not see another
    # thread's no_grad block.
    enabled = True


_mode = _GradMode()


def is_grad_enabled() -> bool:
    """Whether ops record the graph in this thread."""
    return _mode.enabled


def set_grad_enabled(flag: bool) -> None:
    """Turn graph recording on or off in this thread."""
    _mode.enabled = bool(flag)


class _GradModeContext:
    """Base of no_grad/enable_grad: a context manager and a function decorator."""

    _target = True

    def __enter__(self) -> None:
        self._prev = _mode.enabled
        _mode.enabled = self._target

    def __exit__(self, *exc: object) -> None:
        _mode.enabled = self._prev

    def __call__(self, fn: Callable) -> Callable:
        import functools  # noqa: PLC0415 - only decorators need it

        target = self._target

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            prev = _mode.enabled
            _mode.enabled = target
            try:
                return fn(*args, **kwargs)
            finally:
                _mode.enabled = prev

        return wrapper


class no_grad(_GradModeContext):  # noqa: N801 - torch's name
    """Context manager (or decorator) under which ops record no graph."""

    _target = False


class enable_grad(_GradModeContext):  # noqa: N801 - torch's name
    """Context manager (or decorator) that turns graph recording back on."""

    _target = True


_seq = itertools.count()


class Node:
    """One recorded op: its inputs and the closure that maps its output grad to input grads."""

    __slots__ = ("_name", "backward_fn", "inputs", "seq")

    def __init__(self, name: str, backward_fn: Callable, inputs: tuple) -> None:
        self._name = name
        self.backward_fn = backward_fn
        self.inputs = inputs
        self.seq = next(_seq)

    def name(self) -> str:
        """The op's name, e.g. 'MatmulBackward'."""
        return self._name

    def __repr__(self) -> str:
        return f"<{self._name}>"


class RemovableHandle:
    """Returned by hook registrations; `.remove()` unregisters the hook."""

    __slots__ = ("_hooks", "_key")

    _ids = itertools.count()

    def __init__(self, hooks: dict) -> None:
        self._hooks = hooks
        self._key = next(RemovableHandle._ids)

    def remove(self) -> None:
        """Unregister the hook; removing twice is harmless."""
        self._hooks.pop(self._key, None)

    def __enter__(self) -> "RemovableHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _root(arr: Any) -> Any:
    base = arr.base
    return arr if base is None else base


def _contiguous_owned(arr: Any) -> bool:
    return arr.flags.c_contiguous and getattr(arr.flags, "writeable", True)


def _run_hooks(t: Any, g: Any, owned: bool) -> tuple[Any, bool]:
    """Apply a tensor's grad hooks in order; a hook that returns a tensor replaces the grad."""
    cls = _tensor_cls()
    for hook in list(t._hooks.values()):
        out = hook(cls(g))
        if out is not None:
            g = out.data if isinstance(out, cls) else out
            owned = False
    return g, owned


_Tensor: Any = None


def _tensor_cls() -> type:
    global _Tensor
    if _Tensor is None:
        from core.tensor import Tensor  # noqa: PLC0415 - tensor.py imports this module

        _Tensor = Tensor
    return _Tensor


def _accumulate_leaf(leaf: Any, g: Any, owned: bool) -> None:
    """Add a finished gradient into a leaf's .grad, then fire its post-accumulate hooks."""
    if leaf._hooks:
        g, owned = _run_hooks(leaf, g, owned)
    data = leaf.data
    if g.shape != data.shape:
        raise AutogradError(
            f"Gradient of shape {tuple(g.shape)} does not match its tensor's shape "
            f"{tuple(data.shape)}; a backward function returned a wrongly reduced gradient."
        )
    if g.dtype != data.dtype:
        g, owned = g.astype(data.dtype), True
    grad = leaf.grad
    if grad is None:
        if not (owned and _contiguous_owned(g)):
            g = g.copy()
        leaf.grad = _tensor_cls()(g)
    else:
        gd = grad.data
        if _contiguous_owned(gd) and gd.shape == g.shape:
            gd += g
        else:
            grad.data = gd + g
    if leaf._post_hooks:
        for hook in list(leaf._post_hooks.values()):
            hook(leaf)


def _retain(t: Any, g: Any) -> None:
    if t.grad is None:
        t.grad = _tensor_cls()(g.copy())
    else:
        t.grad.data = t.grad.data + g


def _freed_error(name: str) -> AutogradError:
    return AutogradError(
        f"Trying to backward through the graph a second time (node {name} was freed by an "
        "earlier backward); pass retain_graph=True to the first backward() to keep it."
    )


def backward(root: Any, grad: Any = None, retain_graph: bool = False) -> None:
    """Backpropagate from `root` with `grad` (an array; None means ones for a scalar root)."""
    g, owned = grad, False
    if g is None:
        if root.data.size != 1:
            raise AutogradError(
                f"backward() without a gradient needs a scalar output, got shape "
                f"{tuple(root.data.shape)}; pass grad= with that shape."
            )
        g = root.data.copy()
        g[...] = 1
        owned = True
    elif g.shape != root.data.shape:
        raise AutogradError(
            f"backward(): grad has shape {tuple(g.shape)} but the output has shape "
            f"{tuple(root.data.shape)}."
        )
    if not root.requires_grad:
        raise AutogradError(
            "backward(): the tensor does not require grad and has no grad_fn; nothing to "
            "differentiate (was it computed under no_grad, or from tensors without "
            "requires_grad=True?)."
        )
    prev_mode = _mode.enabled
    _mode.enabled = False  # hooks and accumulation must not record a graph
    try:
        if root.grad_fn is None:
            _accumulate_leaf(root, g, owned)
            return
        deps = _count_dependencies(root)
        _run(root, g, owned, deps, retain_graph)
    finally:
        _mode.enabled = prev_mode


def _count_dependencies(root: Any) -> dict:
    """How many gradient contributions each tensor in root's graph will receive (iterative)."""
    deps: dict[int, int] = {}
    node = root.grad_fn
    if node.backward_fn is None:
        raise _freed_error(node._name)
    stack = [root]
    while stack:
        t = stack.pop()
        for inp in t.grad_fn.inputs:
            if inp is None or not inp.requires_grad:
                continue
            k = id(inp)
            n = deps.get(k)
            if n is None:
                deps[k] = 1
                fn = inp.grad_fn
                if fn is not None:
                    if fn.backward_fn is None:
                        raise _freed_error(fn._name)
                    stack.append(inp)
            else:
                deps[k] = n + 1
    return deps


def _run(root: Any, g: Any, owned: bool, deps: dict, retain_graph: bool) -> None:
    pending: dict[int, list] = {id(root): [g, owned]}
    heap = [(-root.grad_fn.seq, root)]
    heappop, heappush = heapq.heappop, heapq.heappush
    while heap:
        _, t = heappop(heap)
        g, owned = pending.pop(id(t))
        if t._hooks:
            g, owned = _run_hooks(t, g, owned)
        if t._retains_grad:
            _retain(t, g)
        node = t.grad_fn
        fn = node.backward_fn
        grads = fn(g)
        if not retain_graph:
            node.backward_fn = None  # frees the arrays the closure saved
        # Ownership: the incoming grad (if owned) passes to at most one output that is a view
        # of it; a fresh array is owned unless two outputs are the same buffer.
        root_in = _root(g)
        seen: list = []
        for inp, gi in zip(node.inputs, grads):
            if gi is None or inp is None or not inp.requires_grad:
                continue
            r = _root(gi)
            if r is root_in:
                own = owned
                owned = False
            else:
                own = True
                for s in seen:
                    if s is r:
                        own = False
                        break
                seen.append(r)
            k = id(inp)
            entry = pending.get(k)
            if entry is None:
                pending[k] = [gi, own]
            else:
                prev = entry[0]
                if entry[1] and _contiguous_owned(prev) and prev.shape == gi.shape:
                    prev += gi
                else:
                    entry[0] = prev + gi
                    entry[1] = True
            n = deps[k] - 1
            deps[k] = n
            if n == 0:
                fn_in = inp.grad_fn
                if fn_in is None:
                    gl, ol = pending.pop(k)
                    _accumulate_leaf(inp, gl, ol)
                else:
                    heappush(heap, (-fn_in.seq, inp))
