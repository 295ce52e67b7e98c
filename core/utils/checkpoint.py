"""torch.utils.checkpoint: drop a segment's activations in forward, recompute them in backward.

`checkpoint(fn, *args)` returns fn's outputs with one node in place of the segment's graph: the
arrays the segment's ops saved (its activations) are freed as soon as forward leaves it, and
that node runs fn again in backward, with the random state and autocast it first ran under, to
get the same activations back and backpropagate through them.

Two variants, as torch has:

- `use_reentrant=False` (the default here; torch's recommendation): fn first runs recording a
  graph, which is walked once to find every tensor the segment depends on that requires grad
  (its tensor arguments, and the parameters or earlier activations it reads from elsewhere);
  the graph is then dropped. The node's inputs are those tensors, so the outer engine
  accumulates their gradients, kwargs are accepted, `core.autograd.grad` works, and the output
  requires grad whenever a parameter inside does, even when no argument does.
- `use_reentrant=True`: fn runs under no_grad; only the tensor arguments are the node's inputs;
  in backward an inner backward accumulates the parameters' gradients straight into `.grad`
  (torch's reentrant checkpoint, with its restrictions: no kwargs; outputs need an argument
  that requires grad).

While a non-reentrant segment runs forward it holds its own graph, as backward's recomputation
will: the saving is that only the segments' outputs stay once forward has moved on. Under DDP a
block reused by several non-reentrant checkpoints gets its gradient once per backward, so DDP
needs no static_graph (the reentrant variant's inner backwards fire its hooks once each).

Recomputation replays the same ops on the same arrays, so every gradient equals the one without
checkpointing bit for bit when each tensor the segment reads gets all its gradient from inside
it. A tensor that also feeds ops outside the segment gets the segment's gradient as one sum,
added to the rest in another order than torch's non-reentrant graph splicing would, which can
change the last bit.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable

from shoal.core import autograd, dtypes
from shoal.core.amp import autocast_mode
from shoal.core.autograd_function import Function
from shoal.core.grad_mode import grad_mode
from shoal.core.ops import random as _random
from shoal.core.tensor import Tensor

__all__ = ["CheckpointError", "checkpoint", "checkpoint_sequential"]


class CheckpointError(autograd.AutogradError):
    """Recomputation in backward did not reproduce the forward pass (torch's CheckpointError)."""


class _RecomputeState:
    """What backward needs to run the segment again exactly as forward ran it."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, preserve_rng: bool) -> None:
        if preserve_rng and any(_on_cupy(a) for a in args):
            warnings.warn(
                "core.utils.checkpoint preserves the CPU random state only: random ops on CUDA "
                "inside the checkpoint (dropout) draw other numbers when recomputed.",
                UserWarning, stacklevel=4)
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.rng_state = _random.get_rng_state() if preserve_rng else None
        self.autocast = {d: autocast_mode.STATE.lower[d] for d in ("cpu", "cuda")}
        self.output_meta: list = []  # (shape, dtype) per output tensor, checked on recompute

    def rerun(self, args: tuple) -> Any:
        """fn(*args) under forward's random state and autocast; the caller's state survives."""
        current = _random.get_rng_state() if self.rng_state is not None else None
        if self.rng_state is not None:
            _random.set_rng_state(self.rng_state)
        contexts = [autocast_mode.autocast(d, None if low is None else _dtype_of(low),
                                           enabled=low is not None)
                    for d, low in self.autocast.items() if _autocast_differs(d, low)]
        try:
            for ctx in contexts:
                ctx.__enter__()
            try:
                outputs = self.fn(*args, **self.kwargs)
            finally:
                for ctx in reversed(contexts):
                    ctx.__exit__(None, None, None)
        finally:
            if current is not None:
                _random.set_rng_state(current)
        self._check(outputs)
        return outputs

    def _check(self, outputs: Any) -> None:
        meta = [(tuple(o.shape), o.array.dtype) for o in _as_tuple(outputs)
                if isinstance(o, Tensor)]
        if meta != self.output_meta:
            raise CheckpointError(
                f"core.utils.checkpoint: recomputed outputs {meta} differ from the forward "
                f"pass's {self.output_meta} (shape, dtype): the checkpointed function must run "
                "the same ops in backward as in forward (no data-dependent control flow on "
                "state that changed in between).")


def _on_cupy(a: Any) -> bool:
    return isinstance(a, Tensor) and type(a.array).__module__.startswith("cupy")


def _dtype_of(np_dtype: Any) -> Any:
    return dtypes.from_np(np_dtype)


def _autocast_differs(device: str, low: Any) -> bool:
    return autocast_mode.STATE.lower[device] != low


def _as_tuple(outputs: Any) -> tuple:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _boundary(outputs: tuple, start_seq: int) -> list[Tensor]:
    """The tensors requiring grad that outputs' graph reaches from outside the segment: leaves,
    and tensors whose node was recorded before the segment started (seq below start_seq)."""
    found: dict[int, Tensor] = {}
    visited: set[int] = set()
    stack = [o for o in outputs if isinstance(o, Tensor) and o.requires_grad]
    while stack:
        t = stack.pop()
        if id(t) in visited:
            continue
        visited.add(id(t))
        node = t.grad_fn
        if node is None or node.seq < start_seq:
            found.setdefault(id(t), t)
            continue
        stack.extend(i for i in node.inputs if i is not None and i.requires_grad)
    return list(found.values())


class _NonReentrant(Function):
    """The node in place of a segment's graph; its inputs are every tensor the segment read."""

    @staticmethod
    def forward(ctx: Any, state: _RecomputeState, outputs: tuple, *boundary: Tensor) -> Any:
        ctx.state = state
        ctx.set_materialize_grads(False)
        plain = []
        for o in outputs:
            if isinstance(o, Tensor):
                kept = o.detach()
                if not o.requires_grad:
                    ctx.mark_non_differentiable(kept)
                o = kept
            plain.append(o)
        return plain[0] if len(plain) == 1 else tuple(plain)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> tuple:
        _refuse_create_graph()
        state, boundary = ctx.state, ctx.inputs[2:]
        args = tuple(_detached(a) for a in state.args)
        by_id = {id(a): d for a, d in zip(state.args, args) if isinstance(a, Tensor)}
        wanted = [by_id.get(id(b), b) for b in boundary]
        # Tensors from before the segment that fn reads other than as arguments: leaves for the
        # length of the inner backward, which must stop at them, not run the outer graph.
        cut = [(t, t.grad_fn) for t in wanted if t.grad_fn is not None]
        try:
            for t, _ in cut:
                t.grad_fn = None
            with _grad_enabled(True):
                outputs = _as_tuple(state.rerun(args))
            roots, seeds = _roots(outputs, grad_outputs)
            capture = {id(t): None for t in wanted}
            if roots:
                autograd.run_backward(roots, seeds, False, capture)
        finally:
            for t, node in cut:
                t.grad_fn = node
        grads = [capture[id(t)] for t in wanted]
        return (None, None) + tuple(None if g is None else Tensor(g) for g in grads)


class _Reentrant(Function):
    """torch's reentrant checkpoint: inputs are the tensor arguments; parameters' gradients are
    accumulated by an inner backward."""

    @staticmethod
    def forward(ctx: Any, state: _RecomputeState, *args: Any) -> Any:
        ctx.state = state
        ctx.set_materialize_grads(False)
        outputs = state.fn(*args)
        state.output_meta = [(tuple(o.shape), o.array.dtype) for o in _as_tuple(outputs)
                             if isinstance(o, Tensor)]
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> tuple:
        _refuse_create_graph()
        state = ctx.state
        args = tuple(_detached(a) for a in state.args)
        with _grad_enabled(True):
            outputs = _as_tuple(state.rerun(args))
        roots, seeds = _roots(outputs, grad_outputs)
        if not roots:
            raise autograd.AutogradError(
                "none of output has requires_grad=True, this checkpoint() is not necessary")
        autograd.run_backward(roots, seeds, False)
        grads = [a.grad if isinstance(a, Tensor) else None for a in args]
        return (None,) + tuple(grads)


def _refuse_create_graph() -> None:
    # The first-order engine runs backward with grad mode off; the create_graph engine runs it
    # on, to record the gradients' own graph, which the inner backward here would not build.
    if grad_mode.enabled:
        raise autograd.AutogradError(
            "core.utils.checkpoint supports first-order backward only: backward or "
            "autograd.grad with create_graph=True through a checkpoint is not supported; run "
            "that part without checkpointing.")


class _grad_enabled:  # noqa: N801 - a context manager, named as grad_mode's are
    def __init__(self, mode: bool) -> None:
        self.mode = mode

    def __enter__(self) -> None:
        self.prev = grad_mode.enabled
        grad_mode.enabled = self.mode

    def __exit__(self, *exc: object) -> None:
        grad_mode.enabled = self.prev


def _detached(a: Any) -> Any:
    if not isinstance(a, Tensor):
        return a
    d = a.detach()
    d.requires_grad = a.requires_grad
    return d


def _roots(outputs: tuple, grad_outputs: tuple) -> tuple[list, list]:
    """The recomputed outputs that received a gradient, and those gradients as arrays."""
    roots, seeds = [], []
    for o, g in zip(outputs, grad_outputs):
        if isinstance(o, Tensor) and g is not None and o.requires_grad:
            roots.append(o)
            seeds.append(g.array)
    return roots, seeds


def checkpoint(function: Callable, *args: Any, use_reentrant: bool = False,
               preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """Run function(*args, **kwargs) without keeping its activations; recompute them in
    backward (torch.utils.checkpoint.checkpoint)."""
    if use_reentrant:
        if kwargs:
            raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
        return _checkpoint_reentrant(function, args, preserve_rng_state)
    state = _RecomputeState(function, args, kwargs, preserve_rng_state)
    if not grad_mode.enabled:
        return function(*args, **kwargs)  # nothing is recorded, so nothing to drop
    start = autograd.Node("CheckpointStart", None, ()).seq
    outputs = function(*args, **kwargs)
    outs = _as_tuple(outputs)
    state.output_meta = [(tuple(o.shape), o.array.dtype) for o in outs if isinstance(o, Tensor)]
    boundary = _boundary(outs, start)
    if not boundary:
        return outputs
    result = _NonReentrant.apply(state, outs, *boundary)
    if isinstance(outputs, tuple):
        return result if isinstance(result, tuple) else (result,)
    return result


def _checkpoint_reentrant(function: Callable, args: tuple, preserve_rng_state: bool) -> Any:
    if not any(isinstance(a, Tensor) and a.requires_grad for a in args) and grad_mode.enabled:
        warnings.warn("None of the inputs have requires_grad=True. Gradients will be None",
                      UserWarning, stacklevel=3)
    state = _RecomputeState(function, args, {}, preserve_rng_state)
    return _Reentrant.apply(state, *args)


def checkpoint_sequential(functions: Any, segments: int, input: Any,  # noqa: A002 - torch's
                          use_reentrant: bool = False, **kwargs: Any) -> Any:
    """Split a Sequential (or list of modules) into `segments` runs and checkpoint all but the
    last (torch.utils.checkpoint.checkpoint_sequential)."""
    preserve = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
    layers = list(functions.children()) if hasattr(functions, "children") else list(functions)
    if segments < 1:
        raise ValueError(f"checkpoint_sequential: segments must be at least 1, got {segments}.")
    size = len(layers) // segments
    end = -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        input = checkpoint(_run_layers(layers[start:end + 1]), input,  # noqa: A001
                           use_reentrant=use_reentrant, preserve_rng_state=preserve)
    return _run_layers(layers[end + 1:])(input)


def _run_layers(layers: Iterable[Callable]) -> Callable:
    chosen = list(layers)

    def forward(x: Any) -> Any:
        for layer in chosen:
            x = layer(x)
        return x

    return forward
