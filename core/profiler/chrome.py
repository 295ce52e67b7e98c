"""The trace file: one window as a Chrome/Perfetto trace-event document in Kineto's shape
(kineto.py converts the events; this module adds the process, its threads, the job's
distributedInfo and the time base, and writes the file)."""

from __future__ import annotations

import gzip
import json
import os
import socket
from typing import Any

from shoal.core import settings
from shoal.core.profiler import cuda, distributed
from shoal.core.profiler.events import EPOCH_OFFSET_NS, Recorder
from shoal.core.profiler.kineto import Converter, lanes_metadata

_SECOND_NS = 1_000_000_000


def base_time_ns(rec: Recorder) -> int:
    """The whole Unix second at or before the window's first event: Kineto's
    baseTimeNanoseconds, which every `ts` in the file counts from."""
    starts = [ev.start for ev in rec.events] + [m.start for m in rec.mem_events]
    first = min(starts) if starts else rec.started_ns
    return (first + EPOCH_OFFSET_NS) // _SECOND_NS * _SECOND_NS


def trace_dict(rec: Recorder, extra: dict | None = None) -> dict:
    """The window as a trace-event document (the JSON object format)."""
    rec.flush()
    rank = distributed.env_rank()
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    base = base_time_ns(rec)
    shift = EPOCH_OFFSET_NS - base

    def us(ns: int) -> float:
        # a quarter nanosecond on top: Perfetto's int(ts * 1000) then lands on `ns` (kineto.py)
        return (ns + shift + 0.25) / 1e3

    default = distributed.default_group()
    conv = Converter(rec, rec.pid, rank, world, us, default["name"] if default else None)
    fwd = {ev.flow for ev in rec.events if ev.flow and ev.cat == "cpu_op"}
    bwd = {ev.flow for ev in rec.events if ev.flow and ev.cat == "backward"}
    events = conv.events(fwd & bwd)
    if rec.profile_memory:
        events.extend(conv.memory(rec.gpu_addrs))
    name = f"rank {rank}" if rank is not None else f"pid {rec.pid}"
    events.extend(lanes_metadata(conv, name, rank if rank is not None else rec.pid))
    doc: dict[str, Any] = {
        "schemaVersion": 1,
        "deviceProperties": cuda.device_properties() if conv.devices else [],
        "distributedInfo": distributed.distributed_info(conv.groups),
        "record_shapes": int(rec.record_shapes),
        "profile_memory": int(rec.profile_memory),
        "with_stack": int(rec.with_stack),
        "host_name": socket.gethostname(),
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": base,
        "shoal": {
            "run_id": settings.RUN_ID.get(),
            "rank": rank,
            "host": socket.gethostname(),
            "pid": rec.pid,
            "window": list(rec.window),
        },
        "traceEvents": events,
    }
    if extra:
        doc["shoal"].update(extra)
    for key, value in rec.metadata.items():
        doc.setdefault(key, value)  # torch's add_metadata: top-level, never over the format's
    return doc


def export_chrome_trace(rec: Recorder, path: str, extra: dict | None = None) -> None:
    """Write the window to `path`, gzip-compressed when it ends in `.gz` as torch's export
    does (written beside it, then renamed: readers see whole files)."""
    doc = trace_dict(rec, extra)
    doc.setdefault("traceName", path)
    tmp = f"{path}.tmp{os.getpid()}"
    opener: Any = gzip.open if path.endswith(".gz") else open
    with opener(tmp, "wt") as f:
        json.dump(doc, f)
    os.replace(tmp, path)
