"""torch.cuda's questions, answered from cupy when it is installed and sees a GPU, else 'none'."""

from __future__ import annotations

from typing import Any

from shoal.core import backend
from shoal.core.ops import random as _random


def _cupy() -> Any:
    """cupy when it imports and sees at least one device, else None."""
    try:
        cp = backend.import_cupy()
        return cp if cp.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # noqa: BLE001 - no cupy, no driver or no device all mean "no CUDA"
        return None


def is_available() -> bool:
    """Whether a CUDA device can be used."""
    return _cupy() is not None


def device_count() -> int:
    """How many CUDA devices there are (0 without CUDA)."""
    cp = _cupy()
    return 0 if cp is None else int(cp.cuda.runtime.getDeviceCount())


def is_initialized() -> bool:
    """Whether CUDA is in use in this process (shoal initialises it lazily, on first use)."""
    return is_available()


def _require() -> Any:
    cp = _cupy()
    if cp is None:
        raise RuntimeError("Found no NVIDIA driver on your system (no CUDA device is available).")
    return cp


def current_device() -> int:
    """The index of the current CUDA device; raises without CUDA, as torch."""
    return int(_require().cuda.runtime.getDevice())


def set_device(device: Any) -> None:
    """Make `device` (an index, 'cuda:N' or a core.device) the current CUDA device."""
    index = device if isinstance(device, int) else backend.device(device).index or 0
    _require().cuda.runtime.setDevice(index)


def synchronize(device: Any = None) -> None:
    """Wait for the current device's work to finish (nothing to wait for without CUDA)."""
    cp = _cupy()
    if cp is not None:
        cp.cuda.runtime.deviceSynchronize()


def get_device_name(device: Any = None) -> str:
    """The device's name; raises without CUDA, as torch."""
    index = current_device() if device is None else backend.device(device).index or 0
    return _require().cuda.runtime.getDeviceProperties(index)["name"].decode()


def manual_seed(seed: int) -> None:
    """Seed CUDA's generators; core.manual_seed already seeds every device, so this does too."""
    _random.manual_seed(seed)


manual_seed_all = manual_seed


def empty_cache() -> None:
    """Free cupy's cached blocks (nothing without CUDA)."""
    cp = _cupy()
    if cp is not None:
        cp.get_default_memory_pool().free_all_blocks()


def memory_allocated(device: Any = None) -> int:
    """Bytes held by live arrays on the device (0 without CUDA)."""
    cp = _cupy()
    return 0 if cp is None else int(cp.get_default_memory_pool().used_bytes())
