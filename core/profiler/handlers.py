"""Ready on_trace_ready handlers: one trace file per rank and step window."""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from shoal.core.profiler.chrome import export_chrome_trace


def trace_file_name(worker_name: str, window: tuple) -> str:
    """`rank0.steps2-4.trace.json`: the rank (or worker) and the window's first and last step."""
    return f"{worker_name}.steps{window[0]}-{window[1]}.trace.json"


def default_worker_name() -> str:
    """`rank<RANK>` inside a job, `pid<pid>` outside one."""
    rank = os.environ.get("RANK")
    return f"rank{rank}" if rank is not None and rank.isdigit() else f"pid{os.getpid()}"


def tensorboard_trace_handler(
    dir_name: str, worker_name: Optional[str] = None, extra: Optional[dict] = None
) -> Callable[[Any], str]:
    """A handler writing each finished window to `dir_name/<worker>.steps<a>-<b>.trace.json`."""
    os.makedirs(dir_name, exist_ok=True)

    def handler(prof: Any) -> str:
        name = worker_name or default_worker_name()
        rec = prof._window()
        path = os.path.join(dir_name, trace_file_name(name, rec.window))
        export_chrome_trace(rec, path, extra)
        return path

    return handler
