"""CUDA times of ops on cupy arrays through CUDA events (ProfilerActivity.CUDA).

Around an op whose inputs live on a GPU, and a backward node whose incoming gradient does, two
events are recorded on the current stream; when the window ends they are synchronised once and
each gets its GPU duration and, measured from an event recorded when the window began, its GPU
start on the CPU clock. Kernel events go on a 'cuda stream' lane of the trace. Nothing here
runs without cupy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.core import backend
from shoal.core.profiler.events import Event, Recorder, now_ns
from shoal.core.tensor import Tensor

CUDA_LANE = -1  # the trace lane of GPU kernels (no thread has a negative ident)


def available() -> bool:
    """True when cupy imports and sees a CUDA device."""
    try:
        cupy = backend.import_cupy()
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no cupy, no driver, no device: all mean "no"
        return False


def on_gpu(args: tuple) -> bool:
    """True when an argument is a tensor on a GPU (its array is not numpy's)."""
    for a in args:
        if isinstance(a, Tensor) and a.array.__class__ is not np.ndarray:
            return True
    return False


def array_on_gpu(a: Any) -> bool:
    """True when `a` (a gradient array in backward) is not numpy's, so cupy's on a GPU."""
    return a.__class__ is not np.ndarray and hasattr(a, "__cuda_array_interface__")


def begin_window(rec: Recorder) -> None:
    """Record the reference event the window's GPU times are measured from."""
    cupy = backend.import_cupy()
    ref = cupy.cuda.Event()
    ref.record()
    rec.cuda_ref = (ref, now_ns())


def mark() -> Any:
    """An event recorded now on the current stream."""
    ev = backend.import_cupy().cuda.Event()
    ev.record()
    return ev


def pend(rec: Recorder, ev: Event, start: Any) -> None:
    """Queue op event `ev`, whose GPU work began at CUDA event `start`, for resolve_window: its
    end is marked now on the current stream, whose device and id the kernel event carries."""
    cupy = backend.import_cupy()
    stream = cupy.cuda.get_current_stream()
    rec.cuda_pending.append((ev, start, mark(), cupy.cuda.Device().id, int(stream.ptr)))


def resolve_window(rec: Recorder) -> None:
    """Turn the window's event pairs into GPU durations and kernel events (synchronises).

    Each op's GPU span becomes one `kernel` event on the lane of its device and stream, linked
    to the op by a correlation id as Kineto links a kernel to its launch (chrome.py writes the
    launch and the flow between them)."""
    if not rec.cuda_pending or rec.cuda_ref is None:
        return
    cupy = backend.import_cupy()
    ref, ref_ns = rec.cuda_ref
    rec.thread_names[CUDA_LANE] = "cuda stream"
    streams: dict[tuple[int, int], int] = {}
    for ev, start, end, device, stream_ptr in rec.cuda_pending:
        end.synchronize()
        dur_ns = int(cupy.cuda.get_elapsed_time(start, end) * 1e6)
        offset_ns = int(cupy.cuda.get_elapsed_time(ref, start) * 1e6)
        ev.cuda = dur_ns
        rec.events.append(kernel_event(rec, ev, ref_ns + offset_ns, dur_ns, device,
                                       stream_id(streams, device, stream_ptr)))
    rec.cuda_pending = []


def stream_id(streams: dict, device: int, ptr: int) -> int:
    """A small id per (device, stream): 0 for the legacy default stream (pointer 0), then
    1, 2, ... in order of first use (a stream's pointer is an address, not a trace lane)."""
    if ptr == 0:
        return 0
    key = (device, ptr)
    if key not in streams:
        streams[key] = len(streams) + 1
    return streams[key]


def kernel_event(rec: Recorder, op: Event, start_ns: int, dur_ns: int, device: int,
                 stream: int) -> Event:
    """The GPU span of op event `op` as a kernel event on (device, stream), both events
    carrying one new correlation id."""
    rec.correlations += 1
    corr = rec.correlations
    op.args = dict(op.args or {}, correlation=corr)
    return Event(op.name, "kernel", start_ns, dur_ns, CUDA_LANE,
                 {"device": device, "stream": stream, "correlation": corr})


def device_properties() -> list[dict]:
    """Kineto's `deviceProperties` of every visible GPU ([] without cupy or a device)."""
    if not available():
        return []
    cupy = backend.import_cupy()
    out = []
    for i in range(cupy.cuda.runtime.getDeviceCount()):
        p = cupy.cuda.runtime.getDeviceProperties(i)
        name = p.get("name", b"")
        out.append({
            "id": i, "name": name.decode() if isinstance(name, bytes) else str(name),
            "totalGlobalMem": int(p.get("totalGlobalMem", 0)),
            "computeMajor": int(p.get("major", 0)), "computeMinor": int(p.get("minor", 0)),
            "maxThreadsPerBlock": int(p.get("maxThreadsPerBlock", 0)),
            "maxThreadsPerMultiprocessor": int(p.get("maxThreadsPerMultiProcessor", 0)),
            "regsPerBlock": int(p.get("regsPerBlock", 0)),
            "warpSize": int(p.get("warpSize", 0)),
            "sharedMemPerBlock": int(p.get("sharedMemPerBlock", 0)),
            "numSms": int(p.get("multiProcessorCount", 0)),
        })
    return out
