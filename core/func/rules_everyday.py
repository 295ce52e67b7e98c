"""Batching rules for torch's everyday ops beyond the basics: scans, sorting, einsum, triangles
and diagonals, gather, flips and moves. Each shifts its dims past the batch dim or, for einsum,
gives the batch its own subscript."""

from __future__ import annotations

from typing import Any, Callable

from shoal.core.func._rulekit import (
    at_level, batch_size, moved_to_front, physical_dim, value, wrap_out,
)
from shoal.core.func.dispatch import register, wrapper_for
from shoal.core.func.rules import reduction, transparent
from shoal.core.ops import arith, indexing, products, rearrange, reduce, scans, sorting


def _dims_at(pos: int, name: str, default: Any) -> Callable:
    """A rule for ops with one dim argument (an int or a tuple) at (pos, name)."""

    def rule(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
        x = args[0]
        if not at_level(x, level) or any(at_level(a, level) for a in (*args[1:],
                                                                     *kwargs.values())):
            raise NotImplementedError(f"vmap: {call.__name__} supports a batched input only.")
        args, kwargs = list(args), dict(kwargs)
        dim = args[pos] if len(args) > pos else kwargs.get(name, default)
        mapped = (tuple(physical_dim(d, x.ndim, call.__name__) for d in dim)
                  if isinstance(dim, (tuple, list)) else physical_dim(dim, x.ndim, call.__name__))
        if len(args) > pos:
            args[pos] = mapped
        else:
            kwargs[name] = mapped
        args[0] = value(x)
        return wrap_out(call(*args, **kwargs), level)

    return rule


def _einsum(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    """A fresh subscript for the batch, in front of each batched operand and of the output."""
    equation, operands = args[0].replace(" ", ""), list(args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    inputs, arrow, output = equation.partition("->")
    terms = inputs.split(",")
    if not arrow:  # torch's implicit output: the subscripts used once, in order
        letters = [c for c in inputs if c.isalpha()]
        output = ("..." if "..." in inputs else "") + "".join(
            sorted(c for c in set(letters) if letters.count(c) == 1))
    batch = next(c for c in "zyxwvutsrqponmlkjihgfedcbaZYXWVUTSRQPONMLKJIHGFEDCBA"
                 if c not in equation)
    values = []
    for i, op in enumerate(operands):
        if at_level(op, level):
            terms[i] = batch + terms[i]
            values.append(value(op))
        else:
            values.append(op)
    return wrap_out(call(",".join(terms) + "->" + batch + output, *values), level)


def _diagonal(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    names = ("input", "offset", "dim1", "dim2")
    bound = {**dict(zip(names, args)), **kwargs}
    x = bound["input"]
    d1 = physical_dim(bound.get("dim1", 0), x.ndim, "diagonal")
    d2 = physical_dim(bound.get("dim2", 1), x.ndim, "diagonal")
    return wrap_out(call(value(x), bound.get("offset", 0), d1, d2), level)


def _trace(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    diag = wrapper_for(products.diagonal)(args[0], 0, 0, 1)
    return wrapper_for(reduce.sum)(diag, -1)


def _dot(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    a, b = args[0], args[1]
    if a.ndim != 1 or b.ndim != 1:
        raise NotImplementedError(f"vmap: {call.__name__} of tensors of more than one dim "
                                  "per sample is not supported yet; use einsum.")
    if call.__name__ == "vdot" and a.dtype.is_complex:
        a = a.conj()
    return wrapper_for(reduce.sum)(wrapper_for(arith.mul)(a, b), -1)


def _outer(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    a, b = args[0], args[1]
    return wrapper_for(arith.mul)(a.unsqueeze(-1), b.unsqueeze(0))


def _gather(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    x, dim, index = args[0], args[1], args[2]
    size = batch_size(level, args, kwargs)
    d = physical_dim(dim, x.ndim, "gather")
    return wrap_out(call(moved_to_front(x, level, size), d, moved_to_front(index, level, size),
                         **kwargs), level)


def _movedim(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    x, src, dst = args[0], args[1], args[2]

    def shift(d: Any) -> Any:
        if isinstance(d, (tuple, list)):
            return tuple(physical_dim(i, x.ndim, "movedim") for i in d)
        return physical_dim(d, x.ndim, "movedim")

    return wrap_out(call(value(x), shift(src), shift(dst)), level)


def _roll(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    shifts = args[1] if len(args) > 1 else kwargs["shifts"]
    dims = args[2] if len(args) > 2 else kwargs.get("dims")
    if dims is None:  # torch rolls the flattened tensor
        flat = wrapper_for(rearrange.roll)(x.reshape(-1), shifts, 0)
        return flat.reshape(*x.shape)
    mapped = (tuple(physical_dim(d, x.ndim, "roll") for d in dims)
              if isinstance(dims, (tuple, list)) else physical_dim(dims, x.ndim, "roll"))
    return wrap_out(call(value(x), shifts, mapped), level)


def _swapaxes(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    return wrap_out(call(value(x), physical_dim(args[1], x.ndim, "swapaxes"),
                         physical_dim(args[2], x.ndim, "swapaxes")), level)


register([scans.cumsum, scans.cumprod, scans.logcumsumexp, scans.cummax, scans.cummin,
          sorting.sort, sorting.argsort], _dims_at(1, "dim", -1))
register(sorting.topk, _dims_at(2, "dim", -1))
register([scans.var, scans.std, scans.nansum, scans.nanmean], reduction)
register(products.einsum, _einsum)
register([products.tril, products.triu], transparent)
register(products.diagonal, _diagonal)
register(products.trace, _trace)
register([products.dot, products.vdot, products.inner], _dot)
register(products.outer, _outer)
register(indexing.gather, _gather)
register(rearrange.flip, _dims_at(1, "dims", None))
register(rearrange.movedim, _movedim)
register(rearrange.roll, _roll)
register(rearrange.swapaxes, _swapaxes)
