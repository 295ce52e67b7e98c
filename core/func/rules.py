"""Batching rules for elementwise, reduction and shape ops: one op on the batched value each.

Each rule rewrites an op on the logical (per-sample) shape into the same op on the value, whose
dim 0 is the batch: elementwise ops line their operands up right-aligned (1s inserted after the
batch dim), reductions and shape ops shift their dims by one. Ops of the other rule modules
(core/func/rules_nn.py) follow the same pattern.
"""

from __future__ import annotations

from typing import Any, Callable

from shoal.core.func._rulekit import (
    at_level,
    batch_size,
    moved_to_front,
    padded,
    physical_dim,
    physical_dims,
    value,
    wrap_out,
)
from shoal.core.func.batched import BatchedTensor
from shoal.core.func.dispatch import register, wrapper_for
from shoal.core.ops import arith, creation, derived, logical, reduce, shape, unary
from shoal.core.ops import binary_table, complex as complex_ops, unary_table
from shoal.core.tensor import Tensor


def _logical_rank(args: tuple, kwargs: dict) -> int:
    rank = 0
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            rank = max(rank, a.ndim)
    return rank


def elementwise(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    """Ops whose result is computed element by element with numpy broadcasting."""
    fn = call.__wrapped__
    rank = _logical_rank(args, kwargs)

    def lift(a: Any) -> Any:
        return padded(a, level, rank) if at_level(a, level) else a

    out = wrapper_for(fn)(*[lift(a) for a in args], **{k: lift(v) for k, v in kwargs.items()})
    return wrap_out(out, level)


def transparent(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    """Ops that act on trailing dims and take any leading ones: the value goes in as it is."""
    if not at_level(args[0], level) or any(
            at_level(a, level) for a in (*args[1:], *kwargs.values())):
        raise NotImplementedError(
            f"vmap: {call.__name__} supports a batched first argument only (its other "
            "arguments must be the same for every sample).")
    return wrap_out(call(value(args[0]), *args[1:], **kwargs), level)


def _arg(args: tuple, kwargs: dict, pos: int, name: str, default: Any) -> Any:
    if len(args) > pos:
        return args[pos]
    return kwargs.get(name, default)


def _rest(args: tuple, kwargs: dict, pos: int, name: str) -> tuple[tuple, dict]:
    """args/kwargs without the one at (pos, name)."""
    kw = {k: v for k, v in kwargs.items() if k != name}
    return args[pos + 1:], kw


def reduction(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    """sum/mean/var/amax/...(x, dim=None, keepdim, ...): None means every logical dim."""
    x = args[0]
    if not at_level(x, level):
        raise NotImplementedError(f"vmap: {call.__name__} with an unbatched input and a batched "
                                  "other argument is not supported.")
    dim = _arg(args, kwargs, 1, "dim", None)
    rest, kw = _rest(args, kwargs, 1, "dim")
    if dim is None:
        dims = tuple(range(1, x.ndim + 1))
        if not dims:  # a 0-d sample: reducing it leaves it, through the op for its dtype rule
            return wrap_out(call(value(x), (), *rest, **kw), level)
    else:
        dims = physical_dims(dim, x.ndim, call.__name__)
    return wrap_out(call(value(x), dims, *rest, **kw), level)


def single_dim(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    """softmax/log_softmax/argmax/max(x, dim, ...): one dim, None (arg ops) meaning flattened."""
    x = args[0]
    dim = _arg(args, kwargs, 1, "dim", None)
    if isinstance(dim, Tensor):  # max(x, other): the elementwise maximum
        return elementwise(wrapper_for(shape.maximum if call.__name__ == "max" else
                                       shape.minimum), level, args[:2], {})
    rest, kw = _rest(args, kwargs, 1, "dim")
    v = value(x)
    if dim is None:
        name = call.__name__
        if name in ("max", "min"):
            fn = reduce.amax if name == "max" else reduce.amin
            return reduction(wrapper_for(fn), level, (x,), {})
        flat = wrapper_for(shape.reshape)(v, (v.shape[0], -1))
        out = call(flat, 1, *rest, **kw)
        if kw.get("keepdim") or (rest and rest[0]):
            out = wrapper_for(shape.reshape)(out, (v.shape[0],) + (1,) * x.ndim)
        return wrap_out(out, level)
    return wrap_out(call(v, physical_dim(dim, x.ndim, call.__name__), *rest, **kw), level)


def _reshape(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    x, sizes = args[0], shape._shape_args(args[1:])  # noqa: SLF001 - the op's own parser
    v = value(x)
    return wrap_out(call(v, (v.shape[0], *sizes)), level)


def _flatten(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    start = _arg(args, kwargs, 1, "start_dim", 0)
    end = _arg(args, kwargs, 2, "end_dim", -1)
    if x.ndim == 0:
        return wrap_out(wrapper_for(shape.reshape)(value(x), (value(x).shape[0], 1)), level)
    s, e = physical_dim(start, x.ndim, "flatten"), physical_dim(end, x.ndim, "flatten")
    return wrap_out(call(value(x), s, e), level)


def _unsqueeze(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    x, dim = args[0], _arg(args, kwargs, 1, "dim", None)
    return wrap_out(call(value(x), physical_dim(dim, x.ndim + 1, "unsqueeze")), level)


def _squeeze(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    x, dim = args[0], _arg(args, kwargs, 1, "dim", None)
    v = value(x)
    if dim is None:
        keep = [n for n in x.shape if n != 1]
        return wrap_out(wrapper_for(shape.reshape)(v, (v.shape[0], *keep)), level)
    return wrap_out(call(v, physical_dims(dim, x.ndim, "squeeze")), level)


def _transpose(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    x, d0, d1 = args[0], args[1], args[2]
    if x.ndim < 2:
        return x
    return wrap_out(call(value(x), physical_dim(d0, x.ndim, "transpose"),
                         physical_dim(d1, x.ndim, "transpose")), level)


def _t(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    if x.ndim < 2:
        return x
    if call.__name__ == "t" and x.ndim > 2:
        raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, but self is {x.ndim}D")
    order = (0, *range(x.ndim, 0, -1))
    return wrap_out(wrapper_for(shape.permute)(value(x), order), level)


def _permute(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    dims = shape._shape_args(args[1:])  # noqa: SLF001 - the op's own parser
    if len(dims) != x.ndim:
        raise RuntimeError(f"permute(sparse_coo): number of dimensions in the tensor input does "
                           f"not match the length of the desired ordering of dimensions i.e. "
                           f"input.dim() = {x.ndim} is not equal to len(dims) = {len(dims)}")
    order = (0, *(physical_dim(d, x.ndim, "permute") for d in dims))
    return wrap_out(call(value(x), order), level)


def _expand(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    x, sizes = args[0], shape._shape_args(args[1:])  # noqa: SLF001 - the op's own parser
    v = padded(x, level, len(sizes))
    return wrap_out(call(v, (v.shape[0], *sizes)), level)


def _getitem(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    x, idx = args
    items = idx if isinstance(idx, tuple) else (idx,)
    if not at_level(x, level) or any(isinstance(i, BatchedTensor) for i in items):
        raise NotImplementedError("vmap: indexing with a batched index tensor is not supported "
                                  "yet; use core.gather-free formulations (one_hot, where).")
    return wrap_out(call(value(x), (slice(None), *items)), level)


def _joined(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    """cat/stack: every tensor gets the batch (broadcast where it has none)."""
    tensors = list(args[0])
    dim = _arg(args, kwargs, 1, "dim", 0)
    size = batch_size(level, (tensors,), {})
    values = [moved_to_front(t, level, size) for t in tensors]
    ndim = tensors[0].ndim + (1 if call.__name__ == "stack" else 0)
    return wrap_out(call(values, physical_dim(dim, ndim, call.__name__)), level)


def _split(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    x, size = args[0], args[1]
    dim = _arg(args, kwargs, 2, "dim", 0)
    return wrap_out(call(value(x), size, physical_dim(dim, x.ndim, call.__name__)), level)


def _narrow(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    x, dim, start, length = args
    return wrap_out(call(value(x), physical_dim(dim, x.ndim, "narrow"), start, length), level)


def _register_all() -> None:
    elementwise_ops = [
        arith.add, arith.sub, arith.mul, arith.div, arith.pow, arith.neg, arith.rsub,
        arith.rdiv, arith.rpow, arith.eq, arith.ne, arith.lt, arith.le, arith.gt, arith.ge,
        unary.exp, unary.log, unary.sqrt, unary.tanh, unary.sigmoid, unary.relu, unary.gelu,
        unary.abs, unary.clamp, derived.sin, derived.cos, derived.tan, shape.where,
        shape.maximum, shape.minimum, shape.clone, shape.contiguous, shape.to,
        logical.isclose, creation.zeros_like, creation.ones_like, creation.full_like,
        creation.empty_like,
    ]
    for mod in (unary_table, binary_table, complex_ops):
        for attr, fn in vars(mod).items():
            if (callable(fn) and not attr.startswith("_") and attr not in ("apply", "is_complex")
                    and getattr(fn, "__module__", None) == mod.__name__
                    and not isinstance(fn, type)):
                elementwise_ops.append(fn)
    register(elementwise_ops, elementwise)
    register([complex_ops.view_as_real, complex_ops.view_as_complex], transparent)
    register([reduce.sum, reduce.mean, reduce.amax, reduce.amin, reduce.var, reduce.logsumexp,
              logical.all, logical.any], reduction)
    register([reduce.softmax, reduce.log_softmax, reduce.argmax, reduce.argmin, reduce.max,
              reduce.min, reduce.prod], single_dim)
    register([shape.reshape, shape.view], _reshape)
    register(shape.flatten, _flatten)
    register(shape.unsqueeze, _unsqueeze)
    register(shape.squeeze, _squeeze)
    register(shape.transpose, _transpose)
    register([shape.t, shape.T], _t)
    register(shape.permute, _permute)
    register(shape.expand, _expand)
    register(shape.getitem, _getitem)
    register([shape.cat, shape.stack], _joined)
    register([shape.split, shape.chunk], _split)
    register(derived.narrow, _narrow)


_register_all()
