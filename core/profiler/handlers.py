"""Ready on_trace_ready handlers: torch's `tensorboard_trace_handler`, and the job profiler's
file per rank and step window."""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable, Optional

from shoal.core.profiler.chrome import export_chrome_trace


def tensorboard_trace_handler(
    dir_name: str, worker_name: Optional[str] = None, use_gzip: bool = False,
    use_python_export: bool = False,
) -> Callable[[Any], str]:
    """torch's handler: each finished window to `dir_name/<worker>.<time_ns>.pt.trace.json`
    (`.gz` with use_gzip), the names torch's TensorBoard plugin looks for; the worker is
    `<hostname>_<pid>` unless named. `use_python_export` is accepted for torch's scripts (shoal
    has one exporter)."""
    del use_python_export

    def handler(prof: Any) -> str:
        os.makedirs(dir_name, exist_ok=True)
        name = worker_name or f"{socket.gethostname()}_{os.getpid()}"
        # nanoseconds, as torch's: two windows of one worker never share a name
        file_name = f"{name}.{time.time_ns()}.pt.trace.json" + (".gz" if use_gzip else "")
        path = os.path.join(dir_name, file_name)
        prof.export_chrome_trace(path)  # as torch's handler does: any profile-like object
        return path

    return handler


def job_trace_name(rank: Optional[int], window: tuple) -> str:
    """`rank0.00000002.pt.trace.json`: the job profiler's file of a rank (the pid outside a job)
    and a window, named as torch's handler names files (`<worker>.<span>.pt.trace.json`) so
    that TensorBoard's plugin finds them: the worker is the rank, the span the window's first
    step (zero-padded: the plugin orders a worker's spans as strings)."""
    worker = f"rank{rank}" if rank is not None else f"pid{os.getpid()}"
    return f"{worker}.{window[0]:08d}.pt.trace.json"


def job_trace_handler(directory: str, rank: Optional[int], extra: dict) -> Callable[[Any], str]:
    """The job profiler's handler: the window to `directory/job_trace_name(...)`, with `extra`
    (the clock offset) in the file's `shoal` section."""

    def handler(prof: Any) -> str:
        os.makedirs(directory, exist_ok=True)
        rec = prof.events().recorder
        path = os.path.join(directory, job_trace_name(rank, rec.window))
        export_chrome_trace(rec, path, extra)
        return path

    return handler
