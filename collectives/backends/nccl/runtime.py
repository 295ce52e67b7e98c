"""What the nccl backend asks of CUDA and NCCL, behind one small class over CuPy.

The nccl group talks to a `runtime` object (streams, events, staging copies, communicators) instead
of to cupy directly, for two reasons: cupy is an optional dependency imported only here and only
when a group is built, and the group's logic (ordering, staging, the watchdog, aborts) can be
exercised on a machine without a GPU by handing it a stand-in runtime (see
tests/support/nccl_standin.py).

The NCCL type and operation tables are pure functions of numpy dtypes, so the rules about what
NCCL can reduce are checked before anything is launched, the same way with or without a GPU.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from shoal.collectives.types import BackendUnavailable, ReduceOp

__all__ = [
    "NCCL_UNAVAILABLE", "unavailable_reason", "unavailable_sentence", "load", "reduce_spec", "WireSpec", "CupyRuntime",
    "unique_id_to_bytes", "unique_id_from_bytes",
]

# The exact words init_process_group(backend="nccl") fails with where it cannot run (a context
# clause in parentheses follows them).
NCCL_UNAVAILABLE = "backend 'nccl' needs a CUDA device; none was found"

# ncclDataType_t and ncclRedOp_t as nccl.h numbers them (a stable ABI since NCCL 2.0).
_NCCL_TYPES = {
    "int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
    "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
}
NCCL_UINT8 = 1
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
_NCCL_OPS = {ReduceOp.SUM: NCCL_SUM, ReduceOp.PRODUCT: NCCL_PROD, ReduceOp.MAX: NCCL_MAX,
             ReduceOp.MIN: NCCL_MIN, ReduceOp.AVG: NCCL_AVG}
# ncclAvg and ncclBfloat16 both arrived in NCCL 2.10 (version code 21000).
AVG_MIN_VERSION = 21000
BF16_MIN_VERSION = 21000
UNIQUE_ID_BYTES = 128


@dataclass(frozen=True)
class WireSpec:
    """How one reduction goes to NCCL: its datatype, elements per array element, and op."""

    datatype: int
    factor: int
    op: int
    # AVG on an NCCL without ncclAvg runs as SUM; the group then divides by the world size.
    divide_after: bool


def reduce_spec(dtype: Any, op: ReduceOp, version: int) -> WireSpec:
    """The NCCL datatype and op that reduce arrays of `dtype` with `op`.

    bool reduces as uint8 (SUM as MAX, PRODUCT as MIN: logical or and and, as torch does);
    complex reduces as pairs of reals, which is right for SUM and AVG only.

    Raises:
        TypeError: NCCL has no reduction for this dtype (and op).
    """
    if op not in _NCCL_OPS:
        raise TypeError(
            f"NCCL has no ReduceOp.{op.name} reduction (torch's nccl backend refuses it too); "
            "use the tcp (gloo) backend for bitwise reductions."
        )
    dt = np.dtype(dtype)
    name = dt.name
    if dt.kind == "b":
        wire_op = {ReduceOp.SUM: NCCL_MAX, ReduceOp.PRODUCT: NCCL_MIN}.get(op, _NCCL_OPS[op])
        return WireSpec(NCCL_UINT8, 1, wire_op, False)
    factor = 1
    if dt.kind == "c":
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise TypeError(
                f"The nccl backend reduces complex arrays ({name}) with SUM and AVG only, not "
                f"{op.name}: NCCL sees them as pairs of reals."
            )
        name = {"complex64": "float32", "complex128": "float64"}.get(name, name)
        factor = 2
    datatype = _NCCL_TYPES.get(name)
    if datatype is None or (name == "bfloat16" and version < BF16_MIN_VERSION):
        known = ", ".join(k for k in _NCCL_TYPES if k != "bfloat16" or version >= BF16_MIN_VERSION)
        raise TypeError(
            f"NCCL cannot reduce {dt.name} arrays (it reduces {known}, bool and complex); cast "
            "to a supported dtype first."
        )
    if op is ReduceOp.AVG and version < AVG_MIN_VERSION:
        return WireSpec(datatype, factor, NCCL_SUM, True)
    return WireSpec(datatype, factor, _NCCL_OPS[op], False)


def unique_id_to_bytes(uid: tuple) -> bytes:
    """cupy's unique id (128 C chars, signed) as bytes for the store."""
    if len(uid) != UNIQUE_ID_BYTES:
        raise ValueError(f"An NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(uid)}.")
    return bytes(int(v) & 0xFF for v in uid)


def unique_id_from_bytes(data: bytes) -> tuple:
    """Inverse of `unique_id_to_bytes`: the signed-char tuple NcclCommunicator takes."""
    if len(data) != UNIQUE_ID_BYTES:
        raise ValueError(
            f"An NCCL unique id has {UNIQUE_ID_BYTES} bytes, but the store held {len(data)}."
        )
    return tuple(b - 256 if b >= 128 else b for b in data)


# ----------------------------------------------------------------------------- availability

def unavailable_reason() -> Optional[str]:
    """None where the nccl backend can run; otherwise why not (cupy, device or NCCL missing)."""
    try:
        import cupy  # noqa: PLC0415  (optional dependency)
    except ImportError as exc:
        return f"cupy is not installed ({exc}); install cupy-cuda12x or cupy-cuda13x"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001  (no driver, no device, broken runtime: all "none")
        return f"cupy is installed but the CUDA runtime reports no usable device: {exc}"
    if count < 1:
        return "cupy is installed but sees 0 CUDA devices"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # cupy warns when libnccl is missing; we explain
            from cupy.cuda import nccl  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001
        return f"cupy's NCCL bindings could not be imported: {exc}"
    if not getattr(nccl, "available", False) or not hasattr(nccl, "NcclCommunicator"):
        return (f"no device is usable for NCCL: cupy sees {count} CUDA device(s) but cannot load "
                "the NCCL library; install nvidia-nccl-cu12 (or -cu13)")
    return None


def unavailable_sentence() -> Optional[str]:
    """None where the nccl backend can run; otherwise NCCL_UNAVAILABLE and why, one sentence."""
    reason = unavailable_reason()
    return None if reason is None else f"{NCCL_UNAVAILABLE} ({reason})."


def load() -> "CupyRuntime":
    """The cupy runtime; raises BackendUnavailable (with NCCL_UNAVAILABLE) where it cannot run."""
    sentence = unavailable_sentence()
    if sentence is not None:
        raise BackendUnavailable(sentence)
    return CupyRuntime()


# ----------------------------------------------------------------------------- cupy runtime

class CupyComm:
    """One NcclCommunicator; every method enqueues on `stream` and returns at once."""

    def __init__(self, comm: Any, nccl: Any, version: int):
        self._c = comm
        self._nccl = nccl
        self._version = version

    def all_reduce(self, send: Any, recv: Any, spec: WireSpec, stream: Any) -> None:
        """recv = reduce(send) over ranks (in place when send is recv)."""
        self._c.allReduce(send.data.ptr, recv.data.ptr, send.size * spec.factor, spec.datatype,
                          spec.op, stream.ptr)

    def reduce(self, send: Any, recv: Any, spec: WireSpec, root: int, stream: Any) -> None:
        """recv on `root` = reduce(send) over ranks; other ranks' recv is untouched."""
        self._c.reduce(send.data.ptr, recv.data.ptr, send.size * spec.factor, spec.datatype,
                       spec.op, root, stream.ptr)

    def broadcast(self, buf: Any, root: int, stream: Any) -> None:
        """buf = root's buf, in place."""
        self._c.broadcast(buf.data.ptr, buf.data.ptr, buf.nbytes, NCCL_UINT8, root, stream.ptr)

    def all_gather(self, send: Any, recv_flat: Any, stream: Any) -> None:
        """recv_flat (size x send.nbytes) = every rank's send, in rank order."""
        self._c.allGather(send.data.ptr, recv_flat.data.ptr, send.nbytes, NCCL_UINT8, stream.ptr)

    def reduce_scatter(self, send_flat: Any, recv: Any, spec: WireSpec, stream: Any) -> None:
        """recv = reduce over ranks of block `rank` of send_flat."""
        self._c.reduceScatter(send_flat.data.ptr, recv.data.ptr, recv.size * spec.factor,
                              spec.datatype, spec.op, stream.ptr)

    def send(self, buf: Any, peer: int, stream: Any) -> None:
        """Send buf's bytes to `peer` (matched by order with the peer's recv from us)."""
        self._c.send(buf.data.ptr, buf.nbytes, NCCL_UINT8, peer, stream.ptr)

    def recv(self, buf: Any, peer: int, stream: Any) -> None:
        """Receive buf's bytes from `peer`."""
        self._c.recv(buf.data.ptr, buf.nbytes, NCCL_UINT8, peer, stream.ptr)

    def async_error(self) -> Optional[str]:
        """NCCL's asynchronous error on this communicator, as text, or None."""
        try:
            self._c.check_async_error()
        except Exception as exc:  # noqa: BLE001  (NcclError: the text is what we report)
            return str(exc) or type(exc).__name__
        return None

    def abort(self) -> None:
        """ncclCommAbort: stop every kernel of this communicator and free it (may hang)."""
        self._c.abort()

    def destroy(self) -> None:
        """ncclCommDestroy: free the communicator after its work finished."""
        self._c.destroy()


class CupyRuntime:
    """Streams, events, staging and communicators on CuPy (imported when this is built)."""

    def __init__(self) -> None:
        import cupy  # noqa: PLC0415
        import cupyx  # noqa: PLC0415

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl  # noqa: PLC0415
        self.cp = cupy
        self.cupyx = cupyx
        self.nccl = nccl
        self.nccl_version = int(nccl.get_version())

    # -- devices and arrays

    def device_count(self) -> int:
        """Number of CUDA devices cupy sees."""
        return int(self.cp.cuda.runtime.getDeviceCount())

    def current_device(self) -> int:
        """The calling thread's current CUDA device."""
        return int(self.cp.cuda.Device().id)

    def use_device(self, index: int) -> None:
        """Make `index` the calling thread's current device."""
        self.cp.cuda.Device(index).use()

    def device_context(self, index: int):
        """A context manager making `index` current."""
        return self.cp.cuda.Device(index)

    def is_device_array(self, arr: Any) -> bool:
        """True for a cupy ndarray."""
        return isinstance(arr, self.cp.ndarray)

    def array_device(self, arr: Any) -> int:
        """The device a cupy array lives on."""
        return int(arr.device.id)

    def address(self, arr: Any) -> int:
        """The device address of a cupy array's first element."""
        return int(arr.data.ptr)

    def flat_view(self, first: Any, count: int) -> Any:
        """A 1-D view of `count` elements starting at `first` (the caller checked the memory)."""
        return self.cp.ndarray((count,), dtype=first.dtype, memptr=first.data)

    # -- streams and events

    def new_stream(self) -> Any:
        """A non-blocking stream on the current device (the group's own)."""
        return self.cp.cuda.Stream(non_blocking=True)

    def current_stream(self) -> Any:
        """The calling thread's current stream on the current device."""
        return self.cp.cuda.get_current_stream()

    def stream_context(self, stream: Any):
        """A context manager under which cupy kernels and allocations use `stream`."""
        return stream

    def record(self, stream: Any) -> Any:
        """A new event recorded on `stream`."""
        event = self.cp.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make `stream` wait for `event` (the host does not block)."""
        stream.wait_event(event)

    def query(self, event: Any) -> bool:
        """True once everything before `event` on its stream has run."""
        return bool(event.done)

    # -- buffers (all on the current device and stream)

    def empty(self, shape: Any, dtype: Any) -> Any:
        """An uninitialised device array."""
        return self.cp.empty(shape, dtype=dtype)

    def upload(self, host: np.ndarray, stream: Any) -> tuple[Any, Any]:
        """(device copy of `host`, pinned buffer to keep alive until the copy ran)."""
        pinned = self.cupyx.empty_pinned(host.shape, host.dtype)
        np.copyto(pinned, host)
        dev = self.cp.empty(host.shape, dtype=host.dtype)
        dev.set(pinned, stream=stream)
        return dev, pinned

    def download(self, dev: Any, stream: Any) -> np.ndarray:
        """A pinned host array that holds `dev` once `stream` passes this point."""
        pinned = self.cupyx.empty_pinned(dev.shape, dev.dtype)
        dev.get(stream=stream, out=pinned, blocking=False)
        return pinned

    def copy(self, dst: Any, src: Any) -> None:
        """Device-to-device copy on the current stream."""
        self.cp.copyto(dst, src.reshape(dst.shape))

    def divide(self, arr: Any, divisor: int) -> None:
        """arr /= divisor in place on the current stream (AVG without ncclAvg)."""
        self.cp.divide(arr, arr.dtype.type(divisor), out=arr)

    def flatten(self, arrays: list, out: Any) -> Any:
        """Copy device `arrays` end to end into `out`: one kernel (core.kernels.flatten)."""
        from shoal.core.kernels import flatten_cuda  # noqa: PLC0415

        return flatten_cuda([a.reshape(-1) for a in arrays], out)

    # -- NCCL

    def unique_id(self) -> bytes:
        """A fresh ncclUniqueId (rank 0 makes it; the store carries it to the others)."""
        return unique_id_to_bytes(self.nccl.get_unique_id())

    def communicator(self, size: int, uid: bytes, rank: int) -> CupyComm:
        """ncclCommInitRank on the current device; blocks until every rank joined."""
        comm = self.nccl.NcclCommunicator(size, unique_id_from_bytes(uid), rank)
        return CupyComm(comm, self.nccl, self.nccl_version)

    @contextlib.contextmanager
    def group(self):
        """ncclGroupStart/End around a batch of calls (point-to-point pairs must be grouped)."""
        self.nccl.groupStart()
        try:
            yield
        finally:
            self.nccl.groupEnd()
