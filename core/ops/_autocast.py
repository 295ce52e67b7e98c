"""Applying core.autocast's policy at an op's entry: cast its float inputs, as recorded ops.

Ops call `cast(name, *inputs)` only when `STATE.active` (one attribute read when autocast is
off); the casts go through shape.to, so backward returns each gradient in its input's dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from shoal.core import backend
from shoal.core.amp.autocast_mode import FP32, LOWER, STATE
from shoal.core.grad_mode import grad_mode
from shoal.core.ops import shape as _shape
from shoal.core.tensor import Tensor

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def _device_type(inputs: tuple) -> str | None:
    for t in inputs:
        if isinstance(t, Tensor):
            return "cpu" if isinstance(t.array, np.ndarray) else backend.device_of(t.array).type
    return None


def _to(t: Any, target: np.dtype) -> Any:
    if not isinstance(t, Tensor):
        return t
    dt = t.array.dtype
    # torch casts every floating input except float64; integer and bool inputs pass as they are.
    # (ml_dtypes' bfloat16 has numpy kind "V".)
    if dt == target or dt == _F64 or dt.kind not in "fV":
        return t
    cacheable = (
        STATE.cache_enabled and dt == _F32 and t.requires_grad and t.grad_fn is None
        and target != _F32 and grad_mode.enabled
    )
    if not cacheable:
        return _shape.to(t, None, target)
    hit = STATE.cache.get(id(t))
    if hit is not None and hit[0] is t and hit[1].array.dtype == target:
        return hit[1]
    low = _shape.to(t, None, target)
    STATE.cache[id(t)] = (t, low)  # holding t keeps its id from being reused while cached
    return low


def cast(op: str, *inputs: Any) -> tuple:
    """The inputs of `op` as autocast wants them on their device type (unchanged when off)."""
    device_type = _device_type(inputs)
    lower = STATE.lower.get(device_type) if device_type is not None else None
    if lower is None:
        return inputs
    if op in LOWER:
        return tuple(_to(t, lower) for t in inputs)
    if op in FP32[device_type]:
        return tuple(_to(t, _F32) for t in inputs)
    return inputs


def autocast_op(name: str) -> Any:
    """Decorator for an op on one of autocast's lists (most losses, prelu): inside a region its
    floating tensor arguments, positional or keyword, are cast as the list says on entry; outside,
    one attribute read."""
    def wrap(fn: Any) -> Any:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if STATE.active:
                args = cast(name, *args)
                kwargs = {k: cast(name, v)[0] if isinstance(v, Tensor) else v
                          for k, v in kwargs.items()}
            return fn(*args, **kwargs)
        return run
    return wrap
