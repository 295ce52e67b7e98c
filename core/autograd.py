"""Reverse-mode autograd: graph nodes, hooks and the backward engine.

Grad mode (no_grad and friends) lives in core/grad_mode.py; its names are re-exported here.

Each op (in core/ops) computes its forward on raw arrays and hands `Node` a closure that maps
the output's gradient to one gradient per input, reduced to that input's shape. The engine here
walks the graph without recursion. A node runs once all of its consumers have delivered their
gradients, and among ready nodes the most recently created runs first (as torch does), so a
leaf's gradient is accumulated, and its post-accumulate hooks fire, the moment its last
contribution arrives: DDP starts reducing a parameter's gradient while backward goes on.

Ownership contract for backward closures: each returned array is either fresh (nobody else
holds it) or a view of the incoming gradient. The engine then knows which arrays it may adopt
as `.grad` or add into in place, and copies only the rest.

The engine is Tensor's friend: it reads the hook slots (`_hooks`, `_post_hooks`,
`_retains_grad`) that Tensor's registration methods fill, directly, once per node, where a
property call would tax every backward; those reads carry `noqa: SLF001` markers.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable, Iterable, Optional

from shoal.core.autograd_bindings import autograd_getattr as __getattr__, graph_engine  # noqa: F401
from shoal.core.errors import ShoalError
from shoal.core.grad_mode import enable_grad, grad_mode, is_grad_enabled, no_grad, set_grad_enabled

__all__ = [
    "AutogradError", "GraphTask", "Node", "RemovableHandle", "backward", "check_root",
    "check_versions", "count_dependencies", "enable_grad", "freed_error", "grad",
    "grad_mode", "is_grad_enabled", "no_grad", "post_accumulate_hooks", "run_backward",
    "set_grad_enabled", "set_graph_engine", "set_profile_hook", "zero_grads",
]


class AutogradError(ShoalError, RuntimeError):
    """Misuse of autograd: a freed graph, a missing grad, a non-scalar output without grad."""


_seq = itertools.count()


# The profiler's backward hook, set only while a profiler records (core/profiler/instrument.py):
# the engine's one test per node when profiling is off.
_profile_hook: Callable | None = None


def set_profile_hook(hook: Callable | None) -> None:
    """Install the profiler's backward hook, `hook(node, fn, grad) -> grads`; None removes it."""
    global _profile_hook
    _profile_hook = hook


# The create_graph engine (core/double_backward.py registers it when core is imported): it
# computes gradients as tensors with their own graph. This engine never builds graphs, so the
# first-order path pays nothing for it.
_graph_engine: Callable | None = None


def set_graph_engine(engine: Callable) -> None:
    """Install the create_graph engine, `engine(roots, grads, retain_graph, capture)`."""
    global _graph_engine
    _graph_engine = engine


class Node:
    """One recorded op: its inputs and the closure that maps its output grad to input grads."""

    __slots__ = ("_name", "backward_fn", "inputs", "seq", "versions")

    def __init__(self, name: str, backward_fn: Callable, inputs: tuple) -> None:
        self._name = name
        self.backward_fn = backward_fn
        self.inputs = inputs
        self.seq = next(_seq)
        # (version counter, its value when recorded) for each tensor the closure saved: an
        # in-place update since then would make the gradient silently wrong (torch's check).
        self.versions: tuple = ()

    def name(self) -> str:
        """The op's name, e.g. 'MatmulBackward'."""
        return self._name

    def __repr__(self) -> str:
        return f"<{self._name}>"


class RemovableHandle:
    """Returned by hook registrations; `.remove()` unregisters the hook."""

    __slots__ = ("_hooks", "id")

    _ids = itertools.count()

    def __init__(self, hooks: dict) -> None:
        self._hooks = hooks
        self.id = next(RemovableHandle._ids)  # the hook's key in `hooks`, as torch's handle

    def remove(self) -> None:
        """Unregister the hook; removing twice is harmless."""
        self._hooks.pop(self.id, None)

    def __enter__(self) -> "RemovableHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def zero_grads(tensors: Iterable[Any], set_to_none: bool = True) -> None:
    """Reset the tensors' gradients: to None (default) or to zeros in place, detached."""
    for t in tensors:
        if t.grad is None:
            continue
        if set_to_none:
            t.grad = None
        else:
            t.grad.grad_fn = None
            t.grad.requires_grad = False
            t.grad.array[...] = 0


def _root(arr: Any) -> Any:
    base = arr.base
    return arr if base is None else base


def _contiguous_owned(arr: Any) -> bool:
    return arr.flags.c_contiguous and getattr(arr.flags, "writeable", True)


def _run_hooks(t: Any, g: Any, owned: bool) -> tuple[Any, bool]:
    """Apply a tensor's grad hooks in order; a hook that returns a tensor replaces the grad."""
    cls = _tensor_cls()
    for hook in list(t._hooks.values()):  # noqa: SLF001 - the engine is Tensor's friend
        out = hook(cls(g))
        if out is not None:
            g = out.array if isinstance(out, cls) else out
            owned = False
    return g, owned


_Tensor: Any = None


def _tensor_cls() -> type:
    global _Tensor
    if _Tensor is None:
        from shoal.core.tensor import Tensor  # noqa: PLC0415 - tensor.py imports this module

        _Tensor = Tensor
    return _Tensor


def _accumulate_leaf(leaf: Any, g: Any, owned: bool) -> None:
    """Add a finished gradient into a leaf's .grad, then fire its post-accumulate hooks."""
    if leaf._hooks:  # noqa: SLF001 - the engine is Tensor's friend
        g, owned = _run_hooks(leaf, g, owned)
    data = leaf.array
    if g.shape != data.shape:
        raise AutogradError(
            f"Gradient of shape {tuple(g.shape)} does not match its tensor's shape "
            f"{tuple(data.shape)}; a backward function returned a wrongly reduced gradient."
        )
    if g.dtype != data.dtype:
        g = g.real if g.dtype.kind == "c" and data.dtype.kind != "c" else g  # torch's rule
        g, owned = g.astype(data.dtype), True
    grad = leaf.grad
    if grad is None:
        if not (owned and _contiguous_owned(g)):
            g = g.copy()
        leaf.grad = _tensor_cls()(g)
    else:
        gd = grad.array
        if _contiguous_owned(gd) and gd.shape == g.shape:
            gd += g
        else:
            grad.array = gd + g
    if leaf._post_hooks:  # noqa: SLF001 - the engine is Tensor's friend
        for hook in list(leaf._post_hooks.values()):  # noqa: SLF001 - the engine is Tensor's friend
            hook(leaf)


def post_accumulate_hooks(leaf: Any) -> list:
    """`leaf`'s post-accumulate-grad hooks, in order, for an engine that accumulates leaves."""
    hooks = leaf._post_hooks  # noqa: SLF001 - the engine is Tensor's friend
    return list(hooks.values()) if hooks else []


def _retain(t: Any, g: Any) -> None:
    if t.grad is None:
        t.grad = _tensor_cls()(g.copy())
    else:
        t.grad.array = t.grad.array + g


def check_versions(node: Node) -> None:
    """Raise torch's error when a tensor `node` saved was updated in place after it was saved."""
    for counter, seen in node.versions:
        if counter[0] != seen:
            raise AutogradError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: a tensor saved by {node.name()} is at version {counter[0]}; "
                f"expected version {seen} instead. Hint: update a clone, or do the in-place "
                "update after backward()."
            )


def freed_error(name: str) -> AutogradError:
    """torch's error for a graph (or saved tensors) an earlier backward freed."""
    return AutogradError(
        f"Trying to backward through the graph a second time (or directly access saved tensors "
        f"after they have already been freed: node {name} was freed by an earlier backward); "
        "pass retain_graph=True to the first backward() to keep it."
    )


def check_root(root: Any, grad: Any) -> None:
    """Refuse a root backward cannot start from (as torch does), given its grad or None."""
    if not root.requires_grad:
        raise AutogradError(
            "element 0 of tensors does not require grad and does not have a grad_fn (was it "
            "computed under no_grad, or from tensors without requires_grad=True?)."
        )
    if grad is None and root.array.size != 1:
        raise AutogradError(
            "grad can be implicitly created only for scalar outputs: backward() without a "
            f"gradient needs a scalar output, got shape {tuple(root.array.shape)}."
        )
    if grad is not None and tuple(grad.shape) != root.array.shape:
        raise AutogradError(f"backward(): grad has shape {tuple(grad.shape)} but the output "
                            f"has shape {tuple(root.array.shape)}.")


def _seed(root: Any, grad: Any) -> tuple[Any, bool]:
    """The starting gradient for one root, validated; (array, owned by the engine)."""
    check_root(root, grad)
    if grad is not None:
        return grad, False
    g = root.array.copy()
    g[...] = 1
    return g, True


def backward(
    roots: Any, grads: Any = None, retain_graph: bool | None = None, create_graph: bool = False
) -> None:
    """Backpropagate from one tensor or several, accumulating into the leaves' .grad.

    `grads` holds one gradient (or None for a scalar root, meaning 1) per root: arrays, or
    tensors. With create_graph=True the leaves' .grad get a graph of their own (double backward).
    """
    if not isinstance(roots, (list, tuple)):
        roots, grads = [roots], [grads]
    elif grads is None:
        grads = [None] * len(roots)
    if create_graph:
        (_graph_engine or graph_engine())(list(roots), list(grads), retain_graph is not False, None)
    else:
        run_backward(list(roots), [getattr(g, "array", g) for g in grads], bool(retain_graph))


def grad(
    outputs: Any, inputs: Any, grad_outputs: Any = None, retain_graph: bool | None = None,
    create_graph: bool = False, allow_unused: bool | None = None, materialize_grads: bool = False,
) -> tuple:
    """The gradients of outputs w.r.t. inputs, returned instead of accumulated into .grad.

    create_graph=True returns gradients with a graph of their own, so that they can be
    differentiated again (gradient penalties, Hessian-vector products); retain_graph then
    defaults to True, as in torch.
    """
    single_out = not isinstance(outputs, (list, tuple))
    outs = [outputs] if single_out else list(outputs)
    gouts = list(grad_outputs) if not single_out and grad_outputs is not None else (
        [grad_outputs] * len(outs))
    ins = [inputs] if not isinstance(inputs, (list, tuple)) else list(inputs)
    for t in ins:
        if not t.requires_grad:
            raise AutogradError("One of the differentiated Tensors does not require grad.")
    capture = {id(t): None for t in ins}
    if create_graph:
        retain = True if retain_graph is None else retain_graph
        (_graph_engine or graph_engine())(outs, gouts, retain, capture)
    else:
        run_backward(outs, [getattr(g, "array", g) for g in gouts], bool(retain_graph), capture)
    cls = _tensor_cls()
    result = []
    for i, t in enumerate(ins):
        g = capture[id(t)]
        if g is None and materialize_grads:
            g = t.array.copy()
            g[...] = 0
        elif g is None and not allow_unused:
            raise AutogradError(
                f"grad(): input {i} (shape {tuple(t.shape)}) was not used to compute the "
                f"outputs (the differentiated Tensor at index {i} appears to not have been used "
                "in the graph); set allow_unused=True to get None for it."
            )
        result.append(g if g is None or isinstance(g, cls) else cls(g))
    return tuple(result)


def run_backward(
    roots: list, grads: list, retain_graph: bool, capture: dict | None = None
) -> None:
    """The engine's entry: seed every root, count dependencies, then run ready nodes.

    With `capture` (a dict keyed by id of the wanted tensors), finished gradients of those
    tensors are stored there and no leaf's .grad is touched (autograd.grad's behaviour).
    """
    pending: dict[int, list] = {}
    for root, g in zip(roots, grads):
        g, owned = _seed(root, g)
        entry = pending.get(id(root))
        if entry is None:
            pending[id(root)] = [g, owned]
        else:
            entry[0], entry[1] = entry[0] + g, True
    deps = count_dependencies(roots)
    prev_mode = grad_mode.enabled
    grad_mode.enabled = False  # hooks and accumulation must not record a graph
    try:
        heap = []
        seen_roots: set[int] = set()
        for root in roots:
            k = id(root)
            if k in seen_roots or deps.get(k, 0):
                continue  # another root's graph delivers into it; it runs when complete
            seen_roots.add(k)
            if root.grad_fn is None:
                g, owned = pending.pop(k)
                _finish_leaf(root, g, owned, capture)
            else:
                heap.append((-root.grad_fn.seq, root))
        heapq.heapify(heap)
        _run(heap, pending, deps, retain_graph, capture)
    finally:
        grad_mode.enabled = prev_mode


def _finish_leaf(leaf: Any, g: Any, owned: bool, capture: dict | None) -> None:
    if capture is None:
        _accumulate_leaf(leaf, g, owned)
    elif id(leaf) in capture:
        if leaf._hooks:  # noqa: SLF001 - the engine is Tensor's friend
            g, owned = _run_hooks(leaf, g, owned)
        capture[id(leaf)] = g if owned else g.copy()


def count_dependencies(roots: list) -> dict:
    """How many gradient contributions each tensor in the roots' graph will receive.

    Iterative (an explicit stack), so graphs deeper than Python's recursion limit work; it
    also finds a freed graph before anything is modified.
    """
    deps: dict[int, int] = {}
    stack = []
    expanded: set[int] = set()  # roots can also sit inside another root's graph
    for root in roots:
        node = root.grad_fn
        if node is not None and id(root) not in expanded:
            if node.backward_fn is None:
                raise freed_error(node.name())
            expanded.add(id(root))
            stack.append(root)
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
                if fn is not None and k not in expanded:
                    if fn.backward_fn is None:
                        raise freed_error(fn.name())
                    expanded.add(k)
                    stack.append(inp)
            else:
                deps[k] = n + 1
    return deps


def _run(heap: list, pending: dict, deps: dict, retain_graph: bool, capture: dict | None) -> None:
    """Run ready nodes, newest first; finish each leaf as soon as its last contribution lands."""
    heappop, heappush = heapq.heappop, heapq.heappush
    while heap:
        _, t = heappop(heap)
        g, owned = pending.pop(id(t))
        if t._hooks:  # noqa: SLF001 - the engine is Tensor's friend
            g, owned = _run_hooks(t, g, owned)
        if t._retains_grad and capture is None:  # noqa: SLF001 - the engine is Tensor's friend
            _retain(t, g)
        if capture is not None and id(t) in capture:
            capture[id(t)] = g.copy()
        node = t.grad_fn
        fn = node.backward_fn
        if node.versions:
            check_versions(node)
        grads = fn(g) if _profile_hook is None else _profile_hook(node, fn, g)
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
                    _finish_leaf(inp, gl, ol, capture)
                else:
                    heappush(heap, (-fn_in.seq, inp))
        if not retain_graph:
            # Drop the edges too: they hold the input tensors, whose arrays (activations) would
            # otherwise live until the output is dropped, e.g. through the next forward pass.
            node.inputs = ()


class GraphTask:
    """A backward pass whose gradients arrive over time: the engine distributed autograd runs.

    `sources` lists the tensors that will receive a contribution from outside the graph, once
    per occurrence (a root's seed, or a gradient arriving for a tensor that was sent to another
    worker). Dependencies are counted over the graph reachable from all of them, so every node
    runs once, when its last contribution has landed, whichever order the contributions arrive
    in. A contribution may be None ("nothing flows here"): a node whose contributions were all
    None does not run, and passes None on to its inputs, so a graph part that backward never
    reaches still completes. Finished leaves go to `leaf_sink(leaf, grad or None, owned)`
    instead of `.grad`. Not thread-safe: the caller serialises `feed` calls.
    """

    def __init__(self, sources: list, retain_graph: bool, leaf_sink: Callable,
                 before_node: Optional[Callable[[], None]] = None) -> None:
        deps = count_dependencies(sources)
        for t in sources:
            deps[id(t)] = deps.get(id(t), 0) + 1
        self._deps = deps
        self._pending: dict[int, list] = {}
        self._heap: list = []
        self._retain = retain_graph
        self._sink = leaf_sink
        # Called before each node runs: lets the owner act on the leaves finished so far
        # before a node that may block (distributed autograd sends their gradients on).
        self._before_node = before_node
        self._outstanding = len(sources)

    @property
    def done(self) -> bool:
        """True once every source's contribution has been fed (the whole graph then ran)."""
        return self._outstanding == 0

    def expects(self, t: Any) -> bool:
        """Whether `t` is in this task's graph (a leaf outside it gets nothing, ever)."""
        return self._deps.get(id(t), 0) > 0

    def feed(self, t: Any, g: Any) -> None:
        """One source contribution for `t` (an array, or None), then run what became ready."""
        self._outstanding -= 1
        prev_mode = grad_mode.enabled
        grad_mode.enabled = False
        try:
            self._deliver(t, g, False)
            self._drain()
        finally:
            grad_mode.enabled = prev_mode

    def _deliver(self, t: Any, g: Any, owned: bool) -> None:
        k = id(t)
        if g is not None:
            entry = self._pending.get(k)
            if entry is None:
                self._pending[k] = [g, owned]
            else:
                prev = entry[0]
                if entry[1] and _contiguous_owned(prev) and prev.shape == g.shape:
                    prev += g
                else:
                    entry[0], entry[1] = prev + g, True
        n = self._deps[k] - 1
        self._deps[k] = n
        if n == 0:
            if t.grad_fn is None:
                entry = self._pending.pop(k, None)
                if entry is None:
                    self._sink(t, None, False)
                else:
                    g, owned = entry
                    if t._hooks:  # noqa: SLF001 - the engine is Tensor's friend
                        g, owned = _run_hooks(t, g, owned)
                    self._sink(t, g, owned)
            else:
                heapq.heappush(self._heap, (-t.grad_fn.seq, t))

    def _drain(self) -> None:
        # The delivery of _deliver, inlined: this loop is the distributed engine's hot path.
        heap, pending, deps, sink = self._heap, self._pending, self._deps, self._sink
        heappop, heappush = heapq.heappop, heapq.heappush
        retain = self._retain
        before_node = self._before_node
        while heap:
            if before_node is not None:
                before_node()
            _, t = heappop(heap)
            node = t.grad_fn
            entry = pending.pop(id(t), None)
            if entry is None:
                grads: Any = (None,) * len(node.inputs)
                owned = False
                root_in = None
            else:
                g, owned = entry
                if t._hooks:  # noqa: SLF001 - the engine is Tensor's friend
                    g, owned = _run_hooks(t, g, owned)
                if t._retains_grad:  # noqa: SLF001 - the engine is Tensor's friend
                    _retain(t, g)
                fn = node.backward_fn
                if fn is None:
                    raise freed_error(node.name())
                if node.versions:
                    check_versions(node)
                grads = fn(g) if _profile_hook is None else _profile_hook(node, fn, g)
                if not retain:
                    node.backward_fn = None
                root_in = _root(g)
            seen: list = []
            for inp, gi in zip(node.inputs, grads):
                if inp is None or not inp.requires_grad:
                    continue
                k = id(inp)
                if gi is not None:
                    r = _root(gi)
                    if r is root_in:
                        own, owned = owned, False
                    else:
                        own = True
                        for s_ in seen:
                            if s_ is r:
                                own = False
                                break
                        seen.append(r)
                    prev_entry = pending.get(k)
                    if prev_entry is None:
                        pending[k] = [gi, own]
                    else:
                        prev = prev_entry[0]
                        if prev_entry[1] and _contiguous_owned(prev) and prev.shape == gi.shape:
                            prev += gi
                        else:
                            prev_entry[0], prev_entry[1] = prev + gi, True
                n = deps[k] - 1
                deps[k] = n
                if n == 0:
                    fn_in = inp.grad_fn
                    if fn_in is not None:
                        heappush(heap, (-fn_in.seq, inp))
                    else:
                        leaf_entry = pending.pop(k, None)
                        if leaf_entry is None:
                            sink(inp, None, False)
                        else:
                            gl, ol = leaf_entry
                            if inp._hooks:  # noqa: SLF001 - the engine is Tensor's friend
                                gl, ol = _run_hooks(inp, gl, ol)
                            sink(inp, gl, ol)
            if not retain:
                node.inputs = ()
