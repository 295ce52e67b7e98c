"""Chrome/Perfetto trace-event JSON: X events, forward->backward flows, a memory counter."""

from __future__ import annotations

import gzip
import json
import os
import socket
import threading
from typing import Any

from shoal.core import settings
from shoal.core.profiler.events import EPOCH_OFFSET_NS, Recorder


def _us(ns: int) -> float:
    return (ns + EPOCH_OFFSET_NS) / 1e3


def trace_dict(rec: Recorder, extra: dict | None = None) -> dict:
    """The window as a trace-event document (the JSON object format)."""
    rec.flush()
    rank = os.environ.get("RANK")
    pid = int(rank) if rank is not None and rank.isdigit() else rec.pid
    tids: dict[int, int] = {}
    main = threading.main_thread().ident

    def tid_of(ident: int) -> int:
        t = tids.get(ident)
        if t is None:
            t = tids[ident] = len(tids)
        return t

    if main is not None:
        tid_of(main)
    events: list[dict] = []
    fwd = {ev.flow for ev in rec.events if ev.flow and ev.cat == "cpu_op"}
    bwd = {ev.flow for ev in rec.events if ev.flow and ev.cat == "backward"}
    linked = fwd & bwd
    for ev in sorted(rec.events, key=lambda e: (e.start, -e.dur)):
        tid = tid_of(ev.tid)
        args: dict[str, Any] = dict(ev.args) if ev.args else {}
        if ev.shapes is not None:
            args["Input Dims"] = ev.shapes
        if ev.stack:
            args["Call stack"] = ";".join(ev.stack)
        if ev.mem:
            args["Allocated Bytes"] = ev.mem
        if ev.flow:
            args["Sequence number"] = ev.flow
        item = {"ph": "X", "cat": ev.cat, "name": ev.name, "pid": pid, "tid": tid,
                "ts": _us(ev.start), "dur": ev.dur / 1e3, "args": args}
        events.append(item)
        if ev.flow in linked:
            flow = {"ph": "s" if ev.cat == "cpu_op" else "f", "id": ev.flow, "pid": pid,
                    "tid": tid, "ts": _us(ev.start), "cat": "fwdbwd", "name": "fwdbwd"}
            if ev.cat == "backward":
                flow["bp"] = "e"
            events.append(flow)
    if rec.profile_memory:
        events.extend(_memory_timeline(rec, pid, tid_of))
    events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                   "args": {"name": f"rank {rank}" if rank is not None else f"pid {rec.pid}"}})
    for ident, tid in tids.items():
        name = "main" if ident == main else rec.thread_names.get(ident, f"thread {tid}")
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                       "args": {"name": name}})
    doc = {
        "schemaVersion": 1,
        "displayTimeUnit": "ms",
        "distributedInfo": {"rank": int(rank) if rank is not None and rank.isdigit() else 0,
                            "world_size": int(os.environ.get("WORLD_SIZE", "1") or 1)},
        "shoal": {
            "run_id": settings.RUN_ID.get(),
            "rank": int(rank) if rank is not None and rank.isdigit() else None,
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


def _memory_timeline(rec: Recorder, pid: int, tid_of: Any) -> list[dict]:
    """torch's "[memory]" instant events plus a counter track of the bytes live."""
    deltas = sorted([(ev.end, ev.mem, ev.tid) for ev in rec.events if ev.mem > 0]
                    + [(m.start, m.mem, m.tid) for m in rec.mem_events])
    out = []
    live = 0
    for ts, nbytes, ident in deltas:
        live += nbytes
        out.append({"ph": "i", "s": "t", "cat": "memory", "name": "[memory]", "pid": pid,
                    "tid": tid_of(ident), "ts": _us(ts),
                    "args": {"Bytes": nbytes, "Total Allocated": live}})
        out.append({"ph": "C", "name": "Memory", "pid": pid, "tid": 0, "ts": _us(ts),
                    "args": {"Total Allocated": live}})
    return out


def export_chrome_trace(rec: Recorder, path: str, extra: dict | None = None) -> None:
    """Write the window to `path`, gzip-compressed when it ends in `.gz` as torch's export
    does (written beside it, then renamed: readers see whole files)."""
    doc = trace_dict(rec, extra)
    tmp = f"{path}.tmp{os.getpid()}"
    opener: Any = gzip.open if path.endswith(".gz") else open
    with opener(tmp, "wt") as f:
        json.dump(doc, f)
    os.replace(tmp, path)
