"""Chooses the array library for a device: numpy for "cpu", cupy (imported lazily) for "cuda[:N]"."""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.core.errors import DeviceError

_cupy: Any = None  # the cupy module once a CUDA device was first asked for


class Device:
    """A device name as torch spells it: `Device("cpu")`, `Device("cuda:1")`; compares to strings."""

    __slots__ = ("type", "index")

    def __init__(self, spec: "str | Device", index: int | None = None) -> None:
        if isinstance(spec, Device):
            self.type, self.index = spec.type, spec.index
            return
        if not isinstance(spec, str):
            raise DeviceError(f"Device must be a string such as 'cpu' or 'cuda:0', got {spec!r}.")
        kind, _, idx = spec.strip().lower().partition(":")
        if kind not in ("cpu", "cuda"):
            raise DeviceError(
                f"Unknown device {spec!r}: shoal knows 'cpu', 'cuda' and 'cuda:N'."
            )
        if idx:
            if not idx.isdigit():
                raise DeviceError(f"Device {spec!r} has a bad index {idx!r}; use e.g. 'cuda:0'.")
            index = int(idx)
        if kind == "cpu" and index not in (None, 0):
            raise DeviceError(f"Device {spec!r}: the cpu device has no index other than 0.")
        self.type = kind
        self.index = None if kind == "cpu" else index

    def __repr__(self) -> str:
        return f"device(type='{self.type}'" + (
            f", index={self.index})" if self.index is not None else ")"
        )

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            try:
                other = Device(other)
            except DeviceError:
                return False
        if not isinstance(other, Device):
            return NotImplemented
        return self.type == other.type and self.index == other.index

    def __hash__(self) -> int:
        return hash((self.type, self.index))


CPU = Device("cpu")


def import_cupy() -> Any:
    """Import cupy on first use, with an error that says what to install."""
    global _cupy
    if _cupy is None:
        try:
            import cupy  # noqa: PLC0415 - optional dependency, imported only for cuda devices
        except ImportError as exc:
            raise DeviceError(
                "A cuda device was requested but cupy is not installed; install "
                "shoal[cuda12] or shoal[cuda13]."
            ) from exc
        _cupy = cupy
    return _cupy


def device(spec: "str | Device | None") -> Device:
    """Parse a device spec; a bare 'cuda' becomes the current cupy device; None means cpu."""
    if spec is None:
        return CPU
    dev = spec if isinstance(spec, Device) else Device(spec)
    if dev.type == "cuda":
        cp = import_cupy()
        count = cp.cuda.runtime.getDeviceCount()
        if dev.index is None:
            dev = Device("cuda", cp.cuda.Device().id)
        if dev.index >= count:
            raise DeviceError(f"Device {dev} does not exist: this machine has {count} cuda devices.")
    return dev


def xp_for(dev: Device) -> Any:
    """The array module for a parsed device."""
    return np if dev.type == "cpu" else import_cupy()


def array_module(arr: Any) -> Any:
    """The array module an array belongs to (numpy for numpy arrays, else cupy)."""
    if isinstance(arr, np.ndarray) or _cupy is None:
        return np
    return _cupy if isinstance(arr, _cupy.ndarray) else np


def device_of(arr: Any) -> Device:
    """The device an array lives on."""
    if isinstance(arr, np.ndarray):
        return CPU
    if _cupy is not None and isinstance(arr, _cupy.ndarray):
        return Device("cuda", arr.device.id)
    return CPU


def is_array(obj: Any) -> bool:
    """True for numpy and cupy arrays."""
    return isinstance(obj, np.ndarray) or (_cupy is not None and isinstance(obj, _cupy.ndarray))


def to_device(arr: Any, dev: Device) -> Any:
    """Move an array to a device; returns the same array when it is already there."""
    src = device_of(arr)
    if src == dev:
        return arr
    if dev.type == "cpu":
        return arr.get()
    cp = import_cupy()
    with cp.cuda.Device(dev.index):
        return cp.asarray(arr)


def device_context(dev: Device) -> Any:
    """A context manager that makes `dev` current for cupy allocations (a no-op on cpu)."""
    if dev.type == "cpu":
        return _NULL
    return import_cupy().cuda.Device(dev.index)


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL = _Null()
