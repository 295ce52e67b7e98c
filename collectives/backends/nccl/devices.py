"""Which CUDA device a nccl group runs on, and the check that a call's arrays live there."""

from __future__ import annotations

from typing import Any, Optional

from shoal.collectives import env
from shoal.core.errors import DeviceError

__all__ = ["check_arrays_on", "device_index", "pick_device"]


def device_index(device: Any) -> Optional[int]:
    """An int device index from an int, 'cuda:N', or a core Device; None when not given."""
    if device is None:
        return None
    if isinstance(device, bool):
        raise DeviceError(f"device must be a CUDA device index or 'cuda:N', got {device!r}.")
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)
    kind = getattr(device, "type", None)
    if kind is None and isinstance(device, str):
        kind, _, idx = device.strip().lower().partition(":")
        index = int(idx) if idx.isdigit() else None
    if kind != "cuda" or index is None:
        raise DeviceError(f"The nccl backend runs on a CUDA device such as 'cuda:0', got {device!r}.")
    return int(index)


def pick_device(rt: Any, device: Any, rank: int, name: str) -> int:
    """The device of rank `rank`'s group `name`: `device` if given, else LOCAL_RANK (made this
    thread's current device, as torchrun scripts do with torch.cuda.set_device), else the
    current device.

    Raises:
        DeviceError: `device` is not a CUDA device, or this machine has no such device.
    """
    count = rt.device_count()
    index = device_index(device)
    source = "device="
    if index is None:
        local = env.env_local_rank()
        if local is not None:
            index, source = local, "LOCAL_RANK"
            if 0 <= index < count:
                rt.use_device(index)
        else:
            index, source = rt.current_device(), "the current device"
    if not 0 <= index < count:
        raise DeviceError(
            f"Rank {rank} of nccl group '{name}' was given CUDA device {index} "
            f"(from {source}), but this machine has {count} CUDA device(s)."
        )
    return index


def check_arrays_on(rt: Any, device: int, op: str, arrays: list, rank: int, name: str) -> None:
    """Raise DeviceError when a device array of `op` is on another device than the group's."""
    for a in arrays:
        if rt.is_device_array(a) and rt.array_device(a) != device:
            raise DeviceError(
                f"{op} got an array on cuda:{rt.array_device(a)}, but rank {rank}'s "
                f"nccl group '{name}' runs on cuda:{device}; move it there first."
            )
