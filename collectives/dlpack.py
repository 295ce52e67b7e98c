"""Foreign arrays in place: anything exposing `__dlpack__` or the array interface, as numpy or
cupy arrays over the same memory, so collectives write their result into the caller's buffer.

torch CPU tensors, JAX CPU arrays, numba and pyarrow buffers and the like come in through here
without shoal importing their libraries. numpy's own DLPack import refuses bfloat16, so a
bfloat16 capsule is read here (the DLPack C structs, through ctypes) and viewed as
`ml_dtypes.bfloat16`, the dtype numpy code uses for it.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional

import ml_dtypes
import numpy as np

__all__ = ["foreign_array", "refusal", "ForeignArrayError"]

_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 1, 2, 3, 13
_KDL_BFLOAT = 4  # DLDataTypeCode kDLBfloat

_ACCEPTED = (
    "a numpy array, a cupy array, a core.Tensor or an object exposing __dlpack__ or "
    "__array_interface__ (a torch CPU tensor, a writable JAX CPU array)"
)


class ForeignArrayError(TypeError):
    """An object collectives cannot use in place; the message names its type and what to pass."""


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    # Legacy (pre-1.0) layout: the capsule named "dltensor" that __dlpack__() returns when the
    # caller asks for no max_version.
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class _Holder:
    """Exposes a DLPack tensor's memory through the array interface and keeps its producer and
    capsule alive for as long as the numpy array built on it (its `.base`) lives."""

    def __init__(self, interface: dict, owner: Any, capsule: Any):
        self.__array_interface__ = interface
        self._owner = owner
        # An unconsumed capsule runs the producer's deleter when it is freed, so holding it
        # here frees the DLPack tensor exactly when the array goes.
        self._capsule = capsule


# DLDataTypeCode -> numpy's kind letter: int, uint, float, bfloat (read as uint16 and viewed),
# complex, bool.
_KINDS = {0: "i", 1: "u", 2: "f", _KDL_BFLOAT: "u", 5: "c", 6: "b"}


def _array_from_capsule(obj: Any, what: str) -> np.ndarray:
    """A numpy array over the memory of a CPU DLPack producer (legacy capsule), writable.

    Used for bfloat16, which numpy's DLPack import refuses, and for a torch tensor that a numpy
    older than 2.2 imports read-only (it cannot tell a legacy capsule's writable memory from a
    read-only one; torch's CPU memory is writable, as `Tensor.numpy()` shows)."""
    capsule = obj.__dlpack__()
    managed = _DLManagedTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    tensor = managed.dl_tensor
    dtype = tensor.dtype
    kind = _KINDS.get(dtype.code)
    if kind is None or dtype.lanes != 1 or dtype.bits % 8:
        raise ForeignArrayError(
            f"{what} is a {type(obj).__name__} whose DLPack dtype (code {dtype.code}, "
            f"{dtype.bits} bits, {dtype.lanes} lanes) numpy cannot import; collectives take "
            "bool, integer, floating, complex and bfloat16 arrays."
        )
    itemsize = dtype.bits // 8
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    strides = (None if not tensor.strides
               else tuple(itemsize * tensor.strides[i] for i in range(tensor.ndim)))
    interface = {
        "version": 3,
        "shape": shape,
        "typestr": f"<{kind}{itemsize}" if kind != "b" else "|b1",
        "data": ((tensor.data or 0) + tensor.byte_offset, False),
        "strides": strides,
    }
    array = np.asarray(_Holder(interface, obj, capsule))
    return array.view(ml_dtypes.bfloat16) if dtype.code == _KDL_BFLOAT else array


def _is_torch_tensor(obj: Any) -> bool:
    """Whether obj is a torch tensor, judged by its type's module (torch is never imported)."""
    return type(obj).__module__.split(".")[0] == "torch"


def _from_dlpack(obj: Any, what: str):
    device_type, device_id = obj.__dlpack_device__()
    device_type = int(device_type)
    if device_type in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        cupy = _cupy(obj, what)
        with cupy.cuda.Device(int(device_id)):
            return cupy.from_dlpack(obj)
    if device_type not in (_KDL_CPU, _KDL_CUDA_HOST):
        raise ForeignArrayError(
            f"{what} is a {type(obj).__name__} on DLPack device type {device_type} (id "
            f"{device_id}), which is neither the host nor CUDA; move it to the CPU first."
        )
    try:
        array = np.from_dlpack(obj)
        if not array.flags.writeable and _is_torch_tensor(obj):
            return _array_from_capsule(obj, what)
        return array
    except BufferError as exc:
        # torch: "Can't export tensors that require gradient, use tensor.detach()"; a read-only
        # or non-strided producer says so here too.
        raise ForeignArrayError(
            f"{what} is a {type(obj).__name__} that refused to share its memory through "
            f"DLPack: {exc}"
        ) from exc
    except (TypeError, RuntimeError) as exc:
        if "dtype" not in str(exc).lower():
            raise ForeignArrayError(
                f"{what} is a {type(obj).__name__} that numpy could not import through DLPack: "
                f"{exc}"
            ) from exc
        return _array_from_capsule(obj, what)


def _cupy(obj: Any, what: str):
    try:
        import cupy  # noqa: PLC0415 - optional: only a CUDA array needs it
    except ImportError as exc:
        raise ForeignArrayError(
            f"{what} is a {type(obj).__name__} in CUDA memory, and collectives need cupy "
            "(pip install 'shoal[cuda12]' or 'shoal[cuda13]') to use it in place."
        ) from exc
    return cupy


def foreign_array(obj: Any, what: str) -> Optional[Any]:
    """The numpy (or cupy) array over `obj`'s memory, or None when `obj` exposes neither
    `__dlpack__` nor an array interface.

    Raises:
        ForeignArrayError: `obj` offers an interface but cannot be used in place (it requires
            grad, lives on another device, or its dtype has no numpy equivalent).
    """
    kind = type(obj)
    if hasattr(kind, "__dlpack__") and hasattr(kind, "__dlpack_device__"):
        return _from_dlpack(obj, what)
    if hasattr(obj, "__array_interface__"):
        # np.asarray keeps the exporter as the array's base: no copy, the interface's
        # read-only flag respected.
        return np.asarray(obj)
    if hasattr(obj, "__cuda_array_interface__"):
        return _cupy(obj, what).asarray(obj)
    return None


def refusal(obj: Any, what: str) -> TypeError:
    """The error for an object no intake path accepts (a plain TypeError, as torch raises)."""
    return TypeError(
        f"{what} must be {_ACCEPTED}, got {type(obj).__name__}; for a Python list or number "
        "pass np.asarray(...), which collectives then fill in place."
    )
