"""torch's arguments in shoal's terms: tensors as in-place numpy (or cupy) arrays, torch's
ReduceOp and options as shoal's op, root rank, timeout and async flag."""

from __future__ import annotations

import datetime
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from shoal.collectives import arrays
from shoal.collectives.types import ReduceOp

__all__ = ["host_array", "host_arrays", "reduce_op", "timeout_of", "is_async"]

_RED = dist.ReduceOp.RedOpType
# Keyed by the enum's int: hashing torch's pybind enum costs about a microsecond a call.
_OPS = {int(k): v for k, v in {
    _RED.SUM: ReduceOp.SUM, _RED.AVG: ReduceOp.AVG, _RED.PRODUCT: ReduceOp.PRODUCT,
    _RED.MIN: ReduceOp.MIN, _RED.MAX: ReduceOp.MAX, _RED.BAND: ReduceOp.BAND,
    _RED.BOR: ReduceOp.BOR, _RED.BXOR: ReduceOp.BXOR,
}.items()}


def host_array(tensor: Any, what: str):
    """The array over `tensor`'s memory that shoal's collectives read and write in place."""
    if not isinstance(tensor, torch.Tensor):
        return arrays.unwrap(tensor, what)
    if tensor.requires_grad:
        # gloo writes into a parameter's storage below autograd, and so does this bridge.
        tensor = tensor.detach()
    if tensor.dtype is torch.bfloat16 or not tensor.is_cpu:
        return arrays.unwrap(tensor, what)
    try:
        return tensor.numpy()  # the cheapest way in (about 0.5 us); a strided view stays strided
    except (RuntimeError, TypeError):  # a conjugate or negative view: DLPack says why
        return arrays.unwrap(tensor, what)


def host_arrays(tensors: Sequence, what: str) -> list:
    """`host_array` of each tensor of a list."""
    return [host_array(t, f"{what}[{i}]") for i, t in enumerate(tensors)]


def one(tensors: Sequence, what: str):
    """torch's one-tensor-per-device list, which on the host holds exactly one tensor."""
    if len(tensors) != 1:
        raise ValueError(
            f"{what} takes a list of one tensor per device and the shoal backend drives the "
            f"host only, got {len(tensors)} tensors."
        )
    return tensors[0]


def reduce_op(opts: Any) -> ReduceOp:
    """shoal's ReduceOp for torch's `opts.reduceOp` (a ReduceOp or its RedOpType)."""
    red = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    kind = getattr(red, "op", red)
    try:
        return _OPS[int(kind)]
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"The shoal backend reduces with SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR and BXOR; got "
            f"{kind}. (PREMUL_SUM: scale the tensor, then SUM.)"
        ) from None


def timeout_of(opts: Any) -> Optional[float]:
    """The op's timeout in seconds, None where torch leaves it unset (the group's then)."""
    timeout = getattr(opts, "timeout", None)
    if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
        return timeout.total_seconds()
    return None


def is_async(opts: Any) -> bool:
    """torch's `opts.asyncOp`: False for a synchronous call, which shoal runs inline."""
    return bool(getattr(opts, "asyncOp", True))


def root_of(opts: Any) -> int:
    """The root rank of broadcast, reduce, gather and scatter."""
    return int(getattr(opts, "rootRank", 0))
