"""Reading a profile directory: one trace per rank and step window, checked to belong together.

Reads the job profiler's files (`rank<R>.<span>.pt.trace.json`) and torch's own
(`tensorboard_trace_handler`'s, plain or gzipped): the rank comes from `distributedInfo`, the
window from shoal's section or else from the file's `ProfilerStep#N` ranges, and timestamps
count from each file's `baseTimeNanoseconds` (0 when it has none).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from shoal.core.errors import ShoalError


class TraceError(ShoalError, ValueError):
    """A profile directory that cannot be merged: no traces, mixed runs, a missing rank."""


@dataclass
class RankTrace:
    """One rank's trace of one window."""

    path: str
    rank: int
    world_size: int
    run_id: str | None
    window: tuple[int, int]
    clock: dict
    events: list[dict]
    base_ns: int = 0  # the file's baseTimeNanoseconds: its `ts` count from it

    def shift_us(self, base_ns: int) -> float:
        """What to add to this trace's `ts` to count from `base_ns` on rank 0's clock."""
        return (self.base_ns - base_ns) / 1e3 + float(self.clock.get("offset_us") or 0.0)


def common_base(traces: list[RankTrace]) -> int:
    """The earliest time base of `traces`: every aligned `ts` counts from it."""
    return min((t.base_ns for t in traces), default=0)


def _read(path: str) -> dict:
    opener: Any = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            doc = json.load(f)
    except (OSError, ValueError, EOFError) as exc:
        raise TraceError(f"Cannot read trace {path!r}: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceError(f"Trace {path!r} is not a trace-event document (no traceEvents list).")
    return doc


def _steps_window(events: list[dict]) -> tuple[int, int]:
    steps = []
    for e in events:
        name = e.get("name")
        if e.get("ph") == "X" and isinstance(name, str) and name.startswith("ProfilerStep#"):
            tail = name.split("#", 1)[1]
            if tail.isdigit():
                steps.append(int(tail))
    return (min(steps), max(steps)) if steps else (0, 0)


def rank_trace(path: str) -> Optional[RankTrace]:
    """One file as a RankTrace; None for a trace `shoal trace merge` wrote (it holds every
    rank, and a merge written into the profile directory must not be read as another rank)."""
    doc = _read(path)
    info = doc.get("shoal") or {}
    if "clocks" in info and "windows" in info:
        return None
    dist = doc.get("distributedInfo") or {}
    rank = info.get("rank")
    if rank is None:
        rank = dist.get("rank", 0)
    events = doc["traceEvents"]
    window = tuple(info["window"]) if info.get("window") else _steps_window(events)
    return RankTrace(
        path, int(rank), int(dist.get("world_size", 1) or 1), info.get("run_id"),
        window,  # type: ignore[arg-type]
        info.get("clock") or {"offset_us": 0.0, "error_us": None},
        events, int(doc.get("baseTimeNanoseconds") or 0))


def load(directory: str) -> dict[tuple[int, int], dict[int, RankTrace]]:
    """Every window's traces by rank; raises TraceError naming what does not fit."""
    paths = sorted(glob.glob(os.path.join(directory, "*.trace.json"))
                   + glob.glob(os.path.join(directory, "*.trace.json.gz")))
    if not paths:
        raise TraceError(f"No *.trace.json files in {directory!r}; run with --profile DIR first.")
    traces = [t for t in map(rank_trace, paths) if t is not None]
    if not traces:
        raise TraceError(f"No rank's trace in {directory!r}, only merged ones; run with "
                         "--profile DIR first.")
    runs = sorted({str(t.run_id) for t in traces})
    if len(runs) > 1:
        detail = "; ".join(
            f"run {r!r}: {', '.join(os.path.basename(t.path) for t in traces if str(t.run_id) == r)}"
            for r in runs)
        raise TraceError(f"The traces in {directory!r} come from different runs ({detail}); "
                         "merge one run's traces at a time.")
    windows: dict[tuple[int, int], dict[int, RankTrace]] = {}
    for t in traces:
        other = windows.setdefault(t.window, {}).get(t.rank)
        if other is not None:
            raise TraceError(
                f"Rank {t.rank} has two traces of steps {t.window[0]}-{t.window[1]} in "
                f"{directory!r}: {os.path.basename(other.path)} and {os.path.basename(t.path)}; "
                "keep one profiling session's traces per directory.")
        windows[t.window][t.rank] = t
    world = max(t.world_size for t in traces)
    for window, ranks in sorted(windows.items()):
        missing = sorted(set(range(world)) - set(ranks))
        if missing:
            raise TraceError(
                f"Rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                f"{'are' if len(missing) > 1 else 'is'} missing from steps "
                f"{window[0]}-{window[1]} in {directory!r} (world size {world}; found ranks "
                f"{', '.join(map(str, sorted(ranks)))})."
            )
    return windows
