"""Staging a batch in page-locked host memory (pin_memory=True), where cupy is installed."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from shoal.core.tensor import Tensor

try:  # cupy is optional; without it pinning is a no-op, as torch's is without CUDA
    import cupyx as _cupyx
except ImportError:  # pragma: no cover - depends on the machine
    _cupyx = None

_warned = False


def available() -> bool:
    """True when pinned host memory can be allocated here."""
    if _cupyx is None:
        return False
    try:
        import cupy  # noqa: PLC0415 - cupyx imported, so cupy is there

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver or no device: nothing to pin for
        return False


def _pinned_copy(array: np.ndarray) -> np.ndarray:
    out = _cupyx.empty_pinned(array.shape, dtype=array.dtype)
    out[...] = array
    return out


def pin(data: Any) -> Any:
    """`data` with every host array copied into pinned memory (unchanged without a GPU)."""
    global _warned
    if not available():
        if not _warned:
            warnings.warn("pin_memory=True but no CUDA device is available: batches stay in "
                          "pageable memory", stacklevel=3)
            _warned = True
        return data
    return _pin(data)


def _pin(data: Any) -> Any:
    if isinstance(data, Tensor) and isinstance(data.array, np.ndarray):
        return Tensor(_pinned_copy(data.array))
    if isinstance(data, np.ndarray):
        return _pinned_copy(data)
    if isinstance(data, Mapping):
        return type(data)({k: _pin(v) for k, v in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_pin(v) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_pin(v) for v in data)
    return data
