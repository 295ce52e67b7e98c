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


def resolve_window(rec: Recorder) -> None:
    """Turn the window's event pairs into GPU durations and kernel events (synchronises)."""
    if not rec.cuda_pending or rec.cuda_ref is None:
        return
    cupy = backend.import_cupy()
    ref, ref_ns = rec.cuda_ref
    rec.thread_names[CUDA_LANE] = "cuda stream"
    for ev, start, end in rec.cuda_pending:
        end.synchronize()
        dur_ns = int(cupy.cuda.get_elapsed_time(start, end) * 1e6)
        offset_ns = int(cupy.cuda.get_elapsed_time(ref, start) * 1e6)
        ev.cuda = dur_ns
        rec.events.append(Event(ev.name, "kernel", ref_ns + offset_ns, dur_ns, CUDA_LANE))
    rec.cuda_pending = []
