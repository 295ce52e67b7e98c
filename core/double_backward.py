"""create_graph=True: gradients computed with core's ops, so they carry a graph of their own.

core's ops record a backward closure over raw arrays (core/autograd.py runs them), which is all
first-order training needs and keeps that path fast. Differentiating a gradient again (gradient
penalties, MAML, Hessian-vector products) needs the gradient's own graph, so this engine walks
the same nodes but runs, for each, a formula written in core ops on tensors (FORMULAS, keyed by
the node's name), in grad mode: every op it calls records itself, as in torch. A node without a
formula raises NotImplementedError naming it, never a first-order-only result. A custom
autograd.Function's node carries its own (`graph_backward`: its backward in core ops).

Formulas read what their op saved from the node: its tensor inputs (`node.inputs`), and the
Python numbers and shapes the op's backward closure holds, by the names core/ops gives them
(`_saved`); a renamed variable there fails this module's tests, not a result.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable

from shoal.core import autograd
from shoal.core.autograd import AutogradError, check_root, check_versions, count_dependencies
from shoal.core.grad_mode import grad_mode
from shoal.core.ops import arith, derived, linalg, reduce, unary
from shoal.core.ops import shape as shape_ops
from shoal.core.ops._util import result
from shoal.core.ops.creation import ones_like
from shoal.core.tensor import Tensor

__all__ = ["FORMULAS", "run_graph_backward", "sum_to"]


def sum_to(g: Tensor, shape: tuple) -> Tensor:
    """g summed down to `shape` (the inverse of broadcasting), recorded in the graph."""
    shape = tuple(shape)
    if tuple(g.shape) == shape:
        return g
    lead = g.ndim - len(shape)
    dims = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1)
    if dims:
        g = reduce.sum(g, dims, keepdim=True)
    return shape_ops.reshape(g, shape)


def _saved(node: Any) -> dict:
    """The values an op's backward closure holds, by name."""
    fn = node.backward_fn
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


def _wants(t: Any) -> bool:
    return t is not None and t.requires_grad


def _as(g: Tensor, like: Tensor) -> Tensor:
    """g in its input's dtype (the op may have computed in a promoted one)."""
    return g if g.array.dtype == like.array.dtype else g.to(like.dtype)


def _operand(node: Any, i: int, name: str) -> Any:
    """Input i as a tensor, or the number (or array) the op took in its place."""
    t = node.inputs[i]
    return _saved(node)[name] if t is None else t


def _binary(node: Any, gx: Callable, gy: Callable) -> tuple:
    x, y = node.inputs
    return (_as(sum_to(gx(), x.shape), x) if _wants(x) else None,
            _as(sum_to(gy(), y.shape), y) if _wants(y) else None)


def _add(node: Any, g: Tensor) -> tuple:
    return _binary(node, lambda: g, lambda: g)


def _sub(node: Any, g: Tensor) -> tuple:
    return _binary(node, lambda: g, lambda: arith.neg(g))


def _mul(node: Any, g: Tensor) -> tuple:
    x, y = _operand(node, 0, "x"), _operand(node, 1, "y")
    return _binary(node, lambda: arith.mul(g, y), lambda: arith.mul(g, x))


def _div(node: Any, g: Tensor) -> tuple:
    x, y = _operand(node, 0, "x"), _operand(node, 1, "y")
    # torch's: grad / other and -grad * self / (other * other)
    return _binary(node, lambda: arith.div(g, y),
                   lambda: arith.neg(arith.div(arith.mul(g, x), arith.mul(y, y))))


def _pow(node: Any, g: Tensor) -> tuple:
    x, y = _operand(node, 0, "x"), _operand(node, 1, "y")

    def gx() -> Tensor:
        if not isinstance(y, Tensor):
            if y == 0:
                return arith.mul(g, 0.0)  # torch's zeros: x ** -1 would make 0 * inf at x == 0
            return arith.mul(g, arith.mul(arith.pow(x, y - 1), y))
        return arith.mul(g, arith.mul(arith.pow(x, arith.sub(y, 1)), y))

    def gy() -> Tensor:
        ln = unary.log(x) if isinstance(x, Tensor) else math.log(x)
        return arith.mul(g, arith.mul(arith.pow(x, y), ln))

    return _binary(node, gx, gy)


def _unary(fn: Callable) -> Callable:
    def formula(node: Any, g: Tensor) -> tuple:
        (x,) = node.inputs
        return (_as(fn(g, x), x),)

    return formula


def _tanh(g: Tensor, x: Tensor) -> Tensor:
    t = unary.tanh(x)
    return arith.mul(g, arith.rsub(arith.mul(t, t), 1.0))


def _sigmoid(g: Tensor, x: Tensor) -> Tensor:
    s = unary.sigmoid(x)
    return arith.mul(g, arith.mul(s, arith.rsub(s, 1.0)))


def _tan(g: Tensor, x: Tensor) -> Tensor:
    t = derived.tan(x)
    return arith.mul(g, arith.add(arith.mul(t, t), 1.0))


def _abs(g: Tensor, x: Tensor) -> Tensor:
    return arith.mul(g, arith.sub(arith.gt(x, 0).to(x.dtype), arith.lt(x, 0).to(x.dtype)))


def _matmul(node: Any, g: Tensor) -> tuple:
    saved = _saved(node)
    xd, yd = saved["xd"], saved["yd"]
    x, y = _operand(node, 0, "x"), _operand(node, 1, "y")
    x, y = (v if isinstance(v, Tensor) else Tensor(v) for v in (x, y))
    # 1-D operands become matrices, as in the first-order closure (core/ops/linalg.py).
    a = shape_ops.reshape(x, (1, xd.shape[0])) if xd.ndim == 1 else x
    b = shape_ops.reshape(y, (yd.shape[0], 1)) if yd.ndim == 1 else y
    if xd.ndim == 1 and yd.ndim == 1:
        g2 = shape_ops.reshape(g, (1, 1))
    elif xd.ndim == 1:
        g2 = shape_ops.unsqueeze(g, -2)
    elif yd.ndim == 1:
        g2 = shape_ops.unsqueeze(g, -1)
    else:
        g2 = g

    def gx() -> Tensor:
        return shape_ops.reshape(sum_to(linalg.matmul(g2, shape_ops.transpose(b, -1, -2)),
                                        a.shape), xd.shape)

    def gy() -> Tensor:
        return shape_ops.reshape(sum_to(linalg.matmul(shape_ops.transpose(a, -1, -2), g2),
                                        b.shape), yd.shape)

    return _binary(node, gx, gy)


def _linear(node: Any, g: Tensor) -> tuple:
    x, w, b = node.inputs
    g2 = shape_ops.reshape(g, (-1, g.shape[-1]))
    gx = gw = gb = None
    if _wants(x):
        gx = _as(shape_ops.reshape(linalg.matmul(g2, w), x.shape), x)
    if _wants(w):
        x2 = shape_ops.reshape(x, (-1, x.shape[-1]))
        gw = _as(linalg.matmul(shape_ops.transpose(g2, 0, 1), x2), w)
    if _wants(b):
        gb = _as(reduce.sum(g2, 0), b)
    return gx, gw, gb


def _expand_back(g: Tensor, dims: Any, keepdim: bool, shape: tuple) -> Tensor:
    if not keepdim:
        kept = [1 if dims is None or i in dims else n for i, n in enumerate(shape)]
        g = shape_ops.reshape(g, tuple(kept))
    return shape_ops.expand(g, shape)


def _sum(node: Any, g: Tensor) -> tuple:
    s = _saved(node)
    (x,) = node.inputs
    return (_as(_expand_back(g, s["dims"], s["keepdim"], s["xd"].shape), x),)


def _mean(node: Any, g: Tensor) -> tuple:
    s = _saved(node)
    (x,) = node.inputs
    return (_as(_expand_back(arith.div(g, s["count"]), s["dims"], s["keepdim"], s["xd"].shape),
                x),)


def _reshape(node: Any, g: Tensor) -> tuple:
    return (shape_ops.reshape(g, node.inputs[0].shape),)


def _transpose(node: Any, g: Tensor) -> tuple:
    s = _saved(node)
    return (shape_ops.transpose(g, s["a"], s["b"]),)


def _permute(node: Any, g: Tensor) -> tuple:
    return (shape_ops.permute(g, _saved(node)["inverse"]),)


def _expand(node: Any, g: Tensor) -> tuple:
    return (sum_to(g, node.inputs[0].shape),)


def _to_copy(node: Any, g: Tensor) -> tuple:
    (x,) = node.inputs
    return (g.to(device=x.device, dtype=x.dtype),)


def _index(node: Any, g: Tensor) -> tuple:
    """g placed at the index in zeros of x's shape (the op's own closure does that), as a node
    whose backward picks the index again: torch's index_put, IndexPutBackward."""
    index = _saved(node)["index"]

    def backward(gg: Any) -> tuple:
        return (gg[index],)  # a view of the incoming gradient, as the engine allows

    return (result(node.backward_fn(g.array)[0], "IndexPutBackward", backward, (g,)),)


def _softmax(node: Any, g: Tensor) -> tuple:
    axis = _saved(node)["axis"]
    s = reduce.softmax(node.inputs[0], axis)
    gy = arith.mul(g, s)
    return (arith.sub(gy, arith.mul(s, reduce.sum(gy, axis, keepdim=True))),)


def _log_softmax(node: Any, g: Tensor) -> tuple:
    axis = _saved(node)["axis"]
    p = unary.exp(reduce.log_softmax(node.inputs[0], axis))
    return (arith.sub(g, arith.mul(p, reduce.sum(g, axis, keepdim=True))),)


def _mse_loss(node: Any, g: Tensor) -> tuple:
    s = _saved(node)
    target = _operand(node, 1, "target")
    diff = arith.sub(node.inputs[0], target)
    scale = s["scale"] if s["reduction"] != "none" else 2.0
    gd = arith.mul(arith.mul(diff, g), scale)
    return _binary(node, lambda: gd, lambda: arith.neg(gd))


# Node name -> formula(node, grad) -> one gradient (or None) per input, recorded in the graph.
FORMULAS: dict[str, Callable] = {
    "AddBackward": _add,
    "SubBackward": _sub,
    "MulBackward": _mul,
    "DivBackward": _div,
    "NegBackward": lambda node, g: (arith.neg(g),),
    "PowBackward": _pow,
    "ExpBackward": _unary(lambda g, x: arith.mul(g, unary.exp(x))),
    "LogBackward": _unary(lambda g, x: arith.div(g, x)),
    "SqrtBackward": _unary(lambda g, x: arith.div(g, arith.mul(unary.sqrt(x), 2.0))),
    "TanhBackward": _unary(_tanh),
    "SigmoidBackward": _unary(_sigmoid),
    "ReluBackward": _unary(lambda g, x: arith.mul(g, arith.gt(x, 0))),
    # Here and not only in core/func/formulas.py, which loads with core.func (and so scipy):
    # a second derivative through sin must not depend on whether core.func was imported.
    "SinBackward": _unary(lambda g, x: arith.mul(g, derived.cos(x))),
    "CosBackward": _unary(lambda g, x: arith.neg(arith.mul(g, derived.sin(x)))),
    "TanBackward": _unary(_tan),
    "AbsBackward": _unary(_abs),
    "MmBackward": _matmul,
    "AddmmBackward": _linear,
    "SumBackward": _sum,
    "MeanBackward": _mean,
    "ReshapeBackward": _reshape,
    "TransposeBackward": _transpose,
    "PermuteBackward": _permute,
    "ExpandBackward": _expand,
    "CloneBackward": lambda node, g: (g,),
    "IndexBackward": _index,
    "IndexPutBackward": lambda node, g: (shape_ops.getitem(g, _saved(node)["index"]),),
    "ToCopyBackward": _to_copy,
    "SoftmaxBackward": _softmax,
    "LogSoftmaxBackward": _log_softmax,
    "MseLossBackward": _mse_loss,
}


def _node_grads(node: Any, g: Any) -> tuple:
    own = getattr(node, "graph_backward", None)
    if own is not None:
        return own(g)
    if g.array.dtype.kind == "c":  # the formulas below are real ones (no conjugates)
        raise NotImplementedError(
            f"double backward (create_graph=True) through {node.name()} with a complex gradient "
            "is not supported yet: core/double_backward.py's formulas are written for real "
            "tensors; first-order backward handles complex ones."
        )
    formula = FORMULAS.get(node.name())
    if formula is None:
        raise NotImplementedError(
            f"double backward through {node.name()} is not supported yet: create_graph=True "
            f"needs a formula in core ops for it (core/double_backward.py has {len(FORMULAS)} "
            "ops: add, sub, mul, div, neg, pow, exp, log, sqrt, tanh, sigmoid, relu, matmul, "
            "linear, sum, mean, reshape/view, transpose, permute, expand, clone, indexing, to, "
            "softmax, log_softmax, mse_loss, and autograd.Function)."
        )
    return formula(node, g)


def _run_hooks(t: Tensor, g: Tensor) -> Tensor:
    for hook in list(t._hooks.values()):  # noqa: SLF001 - the engines are Tensor's friends
        out = hook(g)
        if out is not None:
            g = out
    return g


def _finish_leaf(leaf: Tensor, g: Tensor, capture: dict | None) -> None:
    if leaf._hooks:  # noqa: SLF001 - the engines are Tensor's friends
        g = _run_hooks(leaf, g)
    if capture is not None:
        if id(leaf) in capture:
            capture[id(leaf)] = g
        return
    if tuple(g.shape) != leaf.array.shape:
        raise AutogradError(
            f"Gradient of shape {tuple(g.shape)} does not match its tensor's shape "
            f"{tuple(leaf.array.shape)}; a backward function returned a wrongly reduced gradient."
        )
    g = _as(g, leaf)
    # torch's AccumulateGrad under create_graph: a clone first, then out-of-place sums, so a
    # later in-place accumulation never writes into a gradient another tensor holds.
    leaf.grad = shape_ops.clone(g) if leaf.grad is None else arith.add(leaf.grad, g)
    for hook in autograd.post_accumulate_hooks(leaf):
        hook(leaf)


def _seed(roots: list, grads: list) -> dict:
    pending: dict[int, Tensor] = {}
    for root, g in zip(roots, grads):
        if g is not None and not isinstance(g, Tensor):
            g = Tensor(g)
        check_root(root, g)
        if g is None:
            g = ones_like(root)
        prev = pending.get(id(root))
        pending[id(root)] = g if prev is None else arith.add(prev, g)
    return pending


def run_graph_backward(roots: list, grads: list, retain_graph: bool,
                       capture: dict | None) -> None:
    """core/autograd.py's backward and grad with create_graph=True (same arguments as its
    run_backward, gradients as tensors): every gradient is built by recorded core ops."""
    pending = _seed(roots, grads)
    deps = count_dependencies(roots)
    prev_mode = grad_mode.enabled
    grad_mode.enabled = True  # the formulas' ops record the gradients' graph
    try:
        heap: list = []
        for root in roots:
            k = id(root)
            if k not in pending or deps.get(k, 0):
                continue  # a repeated root, or one another root's graph delivers into
            if root.grad_fn is None:
                _finish_leaf(root, pending.pop(k), capture)
            elif all(item is not root for _, _, item in heap):
                heap.append((-root.grad_fn.seq, k, root))
        heapq.heapify(heap)
        _drain(heap, pending, deps, retain_graph, capture)
    finally:
        grad_mode.enabled = prev_mode


def _drain(heap: list, pending: dict, deps: dict, retain_graph: bool,
           capture: dict | None) -> None:
    while heap:
        _, _, t = heapq.heappop(heap)
        g = pending.pop(id(t))
        if t._hooks:  # noqa: SLF001 - the engines are Tensor's friends
            g = _run_hooks(t, g)
        if t._retains_grad and capture is None:  # noqa: SLF001 - the engines are Tensor's friends
            t.grad = g if t.grad is None else arith.add(t.grad, g)
        if capture is not None and id(t) in capture:
            capture[id(t)] = g
        node = t.grad_fn
        if node.backward_fn is None:
            raise autograd.freed_error(node.name())
        if node.versions:
            check_versions(node)
        inputs = node.inputs
        grads = _node_grads(node, g)
        if not retain_graph:
            node.backward_fn = None
            node.inputs = ()
        for inp, gi in zip(inputs, grads):
            if inp is None or not inp.requires_grad:
                continue
            k = id(inp)
            if gi is not None:
                prev = pending.get(k)
                pending[k] = gi if prev is None else prev + gi
            n = deps[k] - 1
            deps[k] = n
            if n:
                continue
            if inp.grad_fn is not None:
                if k in pending:
                    heapq.heappush(heap, (-inp.grad_fn.seq, k, inp))
            elif k in pending:
                _finish_leaf(inp, pending.pop(k), capture)


autograd.set_graph_engine(run_graph_backward)
