"""Pickling for the wire: protocol 5 with out-of-band buffers, Tensors, cupy arrays and RRefs.

numpy arrays hand their memory to pickle as `PickleBuffer`s (no copy); the agent sends those
beside the pickle, inline when small and over the data channel when large, and the receiver
gives pickle the arrays it received them into, so a large array is never copied in Python.
A `core.Tensor` travels as its array plus `requires_grad` (no autograd graph); inside a distributed
autograd context a Tensor that requires grad also records a send function on the sender and a
recv function on the receiver (rpc_agent/dist_autograd/container.py); a cupy array as a
host copy that is rebuilt on the same device number on the receiving side. RRefs pickle
through the agent's fork protocol (rpc_agent/rref.py), which needs to know the destination:
`serialize` keeps it in a thread-local while pickling.
"""

from __future__ import annotations

import io
import pickle
import sys
import threading
import traceback
from typing import Any, Optional

from shoal.core.errors import DeviceError
from shoal.rpc_agent.types import RemoteException
from shoal.rpc_agent.dist_autograd import container as autograd_container

PROTOCOL = 5

_context = threading.local()


def destination() -> Optional[int]:
    """The worker id the current `serialize` call pickles for (None outside one)."""
    return getattr(_context, "dst", None)


def _reduce_tensor(tensor) -> tuple:
    if tensor.requires_grad:
        cid = getattr(_context, "cid", None)
        if cid is not None:
            send_id = autograd_container.record_send(cid, tensor, _context.dst)
            return (_rebuild_received, (type(tensor), tensor.array, send_id))
    return (_rebuild_tensor, (type(tensor), tensor.array, bool(tensor.requires_grad)))


def _rebuild_received(cls, data, send_id: int):
    """A tensor that left its worker requiring grad inside a context: a leaf here, whose
    gradient goes back to the sender's send function `send_id`."""
    tensor = _rebuild_tensor(cls, data, True)
    cid = getattr(_context, "cid", None)
    if cid is not None:
        autograd_container.record_recv(cid, tensor, _context.src, send_id)
    return tensor


def _rebuild_tensor(cls, data, requires_grad: bool):
    from shoal.core.tensor import Tensor  # noqa: PLC0415  (lazy: rpc_agent works without core's ops)

    tensor = cls.__new__(cls)
    Tensor.__init__(tensor, data, requires_grad=requires_grad)
    return tensor


def _reduce_cupy(array) -> tuple:
    # The host copy pickles as a numpy array, hence out of band like any other.
    return (_rebuild_cupy, (array.get(), int(array.device.id)))


def _rebuild_cupy(host_array, device_id: int):
    try:
        import cupy  # noqa: PLC0415
    except ImportError as exc:
        raise DeviceError(
            f"A cupy array from cuda:{device_id} arrived on a worker without cupy; send numpy "
            "arrays to CPU-only workers."
        ) from exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        raise DeviceError(
            f"A cupy array from cuda:{device_id} arrived on a worker whose CUDA runtime reports "
            f"no device ({exc}); send numpy arrays to CPU-only workers."
        ) from exc
    if count < 1:
        raise DeviceError(
            f"A cupy array from cuda:{device_id} arrived on a worker with no CUDA device; send "
            "numpy arrays to CPU-only workers."
        )
    # The same device number as on the sender (a worker with fewer devices: its current one).
    target = device_id if device_id < count else cupy.cuda.Device().id
    with cupy.cuda.Device(target):
        return cupy.asarray(host_array)


def _reduce_ndarray(array):
    """A C-contiguous array of a plain number dtype as (buffer, dtype string, shape).

    numpy's own reduction pickles the dtype object (its constructor call and state), which
    costs more than the rest for the small arrays most calls carry: this halves an array's
    pickling and unpickling. The buffer still goes out of band. Anything else (structured,
    object or extension dtypes such as bfloat16, non-contiguous layouts) keeps numpy's way.
    """
    dtype = array.dtype
    code = _plain_dtypes[dtype]
    if code is None or not array.flags.c_contiguous:
        return NotImplemented
    return (_rebuild_ndarray, (pickle.PickleBuffer(array), code, array.shape))


def _rebuild_ndarray(buffer, code: str, shape: tuple):
    import numpy  # noqa: PLC0415  (present: the sender pickled a numpy array)

    return numpy.frombuffer(buffer, code).reshape(shape)


class _PlainDtypes(dict):
    """dtype -> its string when that string rebuilds it exactly (bool, ints, floats,
    complex), else None; filled on first sight of each dtype."""

    def __missing__(self, dtype):
        import numpy  # noqa: PLC0415

        code = dtype.str
        plain = dtype.kind in "biufc" and dtype.fields is None and numpy.dtype(code) == dtype \
            and type(numpy.dtype(code)) is type(dtype)
        self[dtype] = code if plain else None
        return self[dtype]


_plain_dtypes = _PlainDtypes()


def _special_reducer(cls: type):
    """The reducer of this module for objects of type `cls`, or None (pickle's own way)."""
    # Only types from modules already imported can occur, so nothing is imported here.
    numpy = sys.modules.get("numpy")
    if numpy is not None and cls is numpy.ndarray:
        return _reduce_ndarray
    tensor_mod = sys.modules.get("shoal.core.tensor")
    if tensor_mod is not None and issubclass(cls, tensor_mod.Tensor):
        return _reduce_tensor
    cupy = sys.modules.get("cupy")
    if cupy is not None and cls is cupy.ndarray:
        return _reduce_cupy
    return None


# type -> reducer or None, decided once per type: pickle asks for every object it meets (a
# call's function, its argument tuple, each argument), and a class first seen before core's
# Tensor or cupy was imported cannot be either of them, so an answer never goes stale.
_reducers: dict = {}


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        cls = type(obj)
        try:
            reducer = _reducers[cls]
        except KeyError:
            reducer = _reducers[cls] = _special_reducer(cls)
        return NotImplemented if reducer is None else reducer(obj)


def serialize(obj: Any, dst: int, context_id: Optional[int] = None,
              reply_accepts: Optional[list] = None) -> tuple[bytes, list[memoryview]]:
    """Pickle `obj` for worker `dst`: (pickle bytes, out-of-band buffers as byte views).

    With `context_id`, Tensors that require grad record send functions in that context. With
    `reply_accepts` (a list; calls only), user RRefs sent to their owner append their fork id
    there: the call's reply stands for the owner's child-accept message (rpc_agent/rref.py).
    """
    buffers: list = []
    out = io.BytesIO()
    previous = (getattr(_context, "dst", None), getattr(_context, "cid", None),
                getattr(_context, "accepts", None))
    _context.dst, _context.cid, _context.accepts = dst, context_id, reply_accepts
    try:
        _Pickler(out, PROTOCOL, buffer_callback=buffers.append).dump(obj)
    finally:
        _context.dst, _context.cid, _context.accepts = previous
    return out.getvalue(), [b.raw() for b in buffers]


def reply_accepts() -> Optional[list]:
    """The list of forks the current call's reply will accept (None outside a call)."""
    return getattr(_context, "accepts", None)


def deserialize(payload, buffers: list, src: Optional[int] = None,
                context_id: Optional[int] = None) -> Any:
    """Unpickle what `serialize` produced, given the received buffers in order.

    With `context_id` (and the sending worker `src`), Tensors that were sent requiring grad
    record recv functions in that context.
    """
    if context_id is None:
        return pickle.loads(payload, buffers=buffers)
    previous = getattr(_context, "src", None), getattr(_context, "cid", None)
    _context.src, _context.cid = src, context_id
    try:
        return pickle.loads(payload, buffers=buffers)
    finally:
        _context.src, _context.cid = previous


# ----------------------------------------------------------------------------- exceptions

class RemoteTraceback(Exception):
    """Shown as the `__cause__` of a re-raised remote exception: the callee's traceback."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


# An ERROR frame travels inline on the stream: its parts are bounded.
_MAX_ERROR_TEXT = 64 * 1024
_MAX_ERROR_PICKLE = 1024 * 1024


def _clip(text: str) -> str:
    if len(text) <= _MAX_ERROR_TEXT:
        return text
    half = _MAX_ERROR_TEXT // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half} characters cut] ...\n{text[-half:]}"


def serialize_exception(exc: BaseException, worker: str) -> bytes:
    """The ERROR payload: type, message, remote traceback, and the exception itself if it
    pickles (and is not huge)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        exc_bytes = pickle.dumps(exc, PROTOCOL)
        if len(exc_bytes) > _MAX_ERROR_PICKLE:
            exc_bytes = None
        else:
            pickle.loads(exc_bytes)  # some exceptions pickle but cannot be rebuilt
    except Exception:  # noqa: BLE001
        exc_bytes = None
    type_name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    return pickle.dumps((type_name, _clip(str(exc)), _clip(tb), exc_bytes, worker), PROTOCOL)


def rebuild_exception(payload, function: str) -> BaseException:
    """The caller's exception for an ERROR payload: the remote type itself when it can be
    rebuilt here (with `remote_traceback`, a RemoteTraceback cause and a note naming the
    worker), else a RemoteException that keeps the type name, message and traceback."""
    type_name, message, tb, exc_bytes, worker = pickle.loads(payload)
    exc = None
    if exc_bytes is not None:
        try:
            exc = pickle.loads(exc_bytes)
        except Exception:  # noqa: BLE001  (the type does not exist here)
            exc = None
    if not isinstance(exc, BaseException):
        return RemoteException(type_name, message, tb, worker)
    try:
        exc.remote_traceback = tb
    except AttributeError:  # a type with __slots__ and no __dict__
        pass
    exc.__cause__ = RemoteTraceback(tb)
    exc.add_note(f"Raised on worker {worker!r} while running {function} (remote traceback above).")
    return exc
