"""DLPack in and out: numpy, cupy and torch arrays share memory with tensors, no copies."""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.core import backend
from shoal.core.errors import DeviceError, ShoalError
from shoal.core.tensor import Tensor

_KDL_CPU = 1
_KDL_CUDA = 2
_KDL_CUDA_HOST = 3
_KDL_CUDA_MANAGED = 13


class DLPackError(ShoalError, BufferError):
    """An array that cannot be shared through DLPack (unsupported dtype or device)."""


def from_dlpack(obj: Any) -> Tensor:
    """A tensor sharing the memory of any DLPack producer (numpy, cupy, torch, a Tensor)."""
    if isinstance(obj, Tensor):
        return Tensor(obj.array)
    if isinstance(obj, np.ndarray):
        return Tensor(obj)
    if not hasattr(obj, "__dlpack_device__"):
        raise DLPackError(
            f"from_dlpack: {type(obj).__name__} does not implement __dlpack__/__dlpack_device__."
        )
    dev_type, dev_id = obj.__dlpack_device__()
    dev_type = int(dev_type)
    try:
        if dev_type in (_KDL_CPU, _KDL_CUDA_HOST):
            arr = np.from_dlpack(obj)
        elif dev_type in (_KDL_CUDA, _KDL_CUDA_MANAGED):
            cp = backend.xp_for(backend.device(f"cuda:{int(dev_id)}"))
            arr = cp.from_dlpack(obj)
        else:
            raise DeviceError(
                f"from_dlpack: DLPack device type {dev_type} (id {dev_id}) is neither cpu nor cuda."
            )
    except (BufferError, TypeError, RuntimeError) as exc:
        if isinstance(exc, ShoalError):
            raise
        raise DLPackError(
            f"from_dlpack: could not import a {type(obj).__name__} through DLPack: {exc} "
            "(numpy cannot import bfloat16 through DLPack; convert such arrays to float32 first)."
        ) from exc
    return Tensor(arr)


def to_dlpack(t: Tensor, *args: Any, **kwargs: Any) -> Any:
    """Export a tensor's data as a DLPack capsule."""
    try:
        return t.array.__dlpack__(*args, **kwargs)
    except BufferError as exc:
        raise DLPackError(
            f"to_dlpack: a tensor of dtype {t.dtype!r} cannot be exported through DLPack: {exc}"
        ) from exc
