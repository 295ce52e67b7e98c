"""Walking a forward's outputs and its autograd graph, for DistributedDataParallel."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from shoal.core.tensor import Tensor


def iter_tensors(obj: Any):
    """Yield the Tensors inside nested tuples, lists and dicts (a forward's outputs)."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)


def map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """`obj` with every Tensor inside tuples, lists and dicts replaced by fn(tensor)."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(item, fn) for item in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(item, fn) for item in obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(v, fn)) for k, v in obj.items())
    return obj


def reachable_leaves(outputs: Any) -> set[int]:
    """ids of the leaf tensors that require grad and that `outputs` depend on."""
    stack = [t for t in iter_tensors(outputs) if t.requires_grad]
    seen: set[int] = set()
    leaves: set[int] = set()
    while stack:
        t = stack.pop()
        key = id(t)
        if key in seen:
            continue
        seen.add(key)
        node = t.grad_fn
        if node is None:
            leaves.add(key)
            continue
        for inp in node.inputs:
            if inp is not None and inp.requires_grad and id(inp) not in seen:
                stack.append(inp)
    return leaves


def same_memory(a: Any, b: Any) -> bool:
    """True when two arrays of one shape and dtype start at the same address."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and (
            a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        )
    return a.data.ptr == b.data.ptr  # cupy
