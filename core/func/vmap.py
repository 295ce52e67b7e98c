"""core.func.vmap: run a function on every sample of a batch at once, as torch.func.vmap."""

from __future__ import annotations

import functools
from typing import Any, Callable

from shoal.core.func import dispatch, rules, rules_everyday, rules_linalg, rules_nn  # noqa: F401
from shoal.core.func._pytree import broadcast_prefix, tree_flatten, tree_unflatten
from shoal.core.func.batched import STATE, BatchedTensor, batched
from shoal.core.ops import arith, attention, conv, creation, derived, indexing, inplace, linalg
from shoal.core.ops import logical, nn, norm, pooling, products, rearrange, reduce, scans
from shoal.core.ops import sorting, unary
from shoal.core.ops import shape as shape_ops
from shoal.core.tensor import Tensor

# Every public op gets a dispatching wrapper: those without a rule refuse batched tensors with
# a clear error. Tensor's methods and operators are these same functions (core/ops/bind.py), so
# they dispatch too, and a profiler's timing wrappers record the logical op once per batch.
dispatch.wrap_op_modules([arith, attention, conv, creation, derived, indexing, inplace, linalg,
                          logical, nn, norm, pooling, products, rearrange, reduce, scans,
                          shape_ops, sorting, unary])

_RANDOMNESS = ("error", "different", "same")


def vmap(
    func: Callable, in_dims: Any = 0, out_dims: Any = 0, randomness: str = "error", *,
    chunk_size: int | None = None,
) -> Callable:
    """func mapped over a dim of its inputs, computed as one batched op per op (torch.func.vmap).

    in_dims/out_dims: an int or None per input/output, or one for all (nested structures of
    tensors take a matching structure). randomness: 'error' (random ops refused), 'different'
    (independent per sample) or 'same' (one draw shared by the batch).
    """
    if randomness not in _RANDOMNESS:
        raise RuntimeError(f"Only allowed values for randomness are 'error', 'different', or "
                           f"'same'. Got {randomness}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"vmap: chunk_size should be None or greater than 0. (got {chunk_size})")

    @functools.wraps(func)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        return _vmap_call(func, in_dims, out_dims, randomness, chunk_size, args, kwargs)

    return mapped


def _batch_dims(in_dims: Any, args: tuple) -> tuple[list, list, int]:
    """(flat args, flat in_dims, batch size), checked as torch checks them."""
    if not isinstance(in_dims, (int, tuple, list)) and in_dims is not None:
        raise ValueError(f"vmap(func, in_dims={in_dims}, ...)(<inputs>): expected `in_dims` to "
                         f"be int or a (potentially nested) tuple matching the structure of "
                         f"inputs, got: {type(in_dims)}.")
    flat, _ = tree_flatten(list(args))
    dims = broadcast_prefix(in_dims if isinstance(in_dims, (int, type(None))) else
                            list(in_dims), list(args), "vmap in_dims")
    size = None
    for x, d in zip(flat, dims):
        if d is None:
            continue
        if not isinstance(x, Tensor):
            raise ValueError(f"vmap: Got in_dim={d} for an input but the input is of type "
                             f"{type(x)}. We cannot vmap over non-Tensor arguments, please use "
                             "None as the respective in_dim")
        if not -max(x.ndim, 1) <= d < max(x.ndim, 1) or x.ndim == 0:
            raise ValueError(f"vmap: Got in_dim={d} for some input, but that input is a Tensor "
                             f"of dimensionality {x.ndim} so expected in_dim to satisfy "
                             f"-{x.ndim} <= in_dim < {x.ndim}.")
        n = x.shape[d]
        if size is not None and n != size:
            raise ValueError(f"vmap: Expected all tensors to have the same size in the mapped "
                             f"dimension, got sizes {size} and {n} for the mapped dimension")
        size = n
    if size is None:
        raise ValueError("vmap: at least one input must be batched: in_dims were all None, "
                         "or no input is a Tensor.")
    return flat, dims, size


def _vmap_call(func: Callable, in_dims: Any, out_dims: Any, randomness: str,
               chunk_size: int | None, args: tuple, kwargs: dict) -> Any:
    flat, dims, size = _batch_dims(in_dims, args)
    if chunk_size is not None and chunk_size < size:
        return _chunked(func, in_dims, out_dims, randomness, chunk_size, args, kwargs, dims)
    _, spec = tree_flatten(list(args))
    level = STATE.next_level
    STATE.next_level += 1
    STATE.levels.append((level, size, randomness))
    dispatch.install()
    try:
        wrapped = [x if d is None else batched(_moved(x, d, 0), level) for x, d in zip(flat, dims)]
        out = func(*tree_unflatten(wrapped, spec), **kwargs)
        return _unbatch(out, out_dims, level, size)
    finally:
        dispatch.uninstall()
        STATE.levels.pop()


def _moved(x: Any, src: int, dst: int) -> Any:
    """x with dim src moved to dst (through the dispatching ops: x may be batched outside)."""
    nd = x.ndim
    src, dst = src % nd, dst % nd
    if src == dst:
        return x
    order = [i for i in range(nd) if i != src]
    order.insert(dst, src)
    return dispatch.wrapper_for(shape_ops.permute)(x, order)


def _unbatch(out: Any, out_dims: Any, level: int, size: int) -> Any:
    leaves, spec = tree_flatten(out)
    dims = broadcast_prefix(out_dims, out, "vmap out_dims")
    result = []
    for x, d in zip(leaves, dims):
        if not isinstance(x, Tensor):
            raise ValueError(f"vmap: `{getattr(x, '__name__', x)!r}` returned a value of type "
                             f"{type(x)} as an output; vmap returns Tensors only.")
        if d is None:
            if isinstance(x, BatchedTensor) and x._level == level:  # noqa: SLF001
                raise ValueError("vmap: out_dims=None for an output that is batched: it would "
                                 "differ per sample.")
            result.append(x)
            continue
        if isinstance(x, BatchedTensor) and x._level == level:  # noqa: SLF001
            v = x._value  # noqa: SLF001
        else:  # the same for every sample: broadcast, as torch does
            expand = dispatch.wrapper_for(shape_ops.expand)
            v = expand(dispatch.wrapper_for(shape_ops.unsqueeze)(x, 0), (size, *x.shape))
        result.append(_moved(v, 0, d))
    return tree_unflatten(result, spec)


def _chunked(func: Callable, in_dims: Any, out_dims: Any, randomness: str, chunk_size: int,
             args: tuple, kwargs: dict, dims: list) -> Any:
    """chunk_size: vmap over slices of the batch, joined along out_dims (bounds memory)."""
    flat, spec = tree_flatten(list(args))
    size = next(x.shape[d] for x, d in zip(flat, dims) if d is not None)
    pieces = []
    for start in range(0, size, chunk_size):
        part = [_slice(x, d, start, chunk_size) for x, d in zip(flat, dims)]
        pieces.append(vmap(func, in_dims, out_dims, randomness)(
            *tree_unflatten(part, spec), **kwargs))
    first = pieces[0]
    _, out_spec = tree_flatten(first)
    odims = broadcast_prefix(out_dims, first, "vmap out_dims")
    joined = []
    for i, d in enumerate(odims):
        parts = [tree_flatten(p)[0][i] for p in pieces]
        joined.append(parts[0] if d is None else dispatch.wrapper_for(shape_ops.cat)(parts, d))
    return tree_unflatten(joined, out_spec)


def _slice(x: Any, d: int | None, start: int, length: int) -> Any:
    if d is None:
        return x
    index = (slice(None),) * (d % x.ndim) + (slice(start, start + length),)
    return dispatch.wrapper_for(shape_ops.getitem)(x, index)
