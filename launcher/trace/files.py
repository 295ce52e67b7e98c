"""Reading a profile directory: one trace per rank and step window, checked to belong together."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

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


def load(directory: str) -> dict[tuple[int, int], dict[int, RankTrace]]:
    """Every window's traces by rank; raises TraceError naming what does not fit."""
    paths = sorted(glob.glob(os.path.join(directory, "*.trace.json")))
    if not paths:
        raise TraceError(f"No *.trace.json files in {directory!r}; run with --profile DIR first.")
    traces = []
    for path in paths:
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as exc:
            raise TraceError(f"Cannot read trace {path!r}: {exc}") from exc
        info = doc.get("shoal") or {}
        rank = info.get("rank")
        if rank is None:
            rank = (doc.get("distributedInfo") or {}).get("rank", 0)
        traces.append(RankTrace(
            path, int(rank), int((doc.get("distributedInfo") or {}).get("world_size", 1)),
            info.get("run_id"), tuple(info.get("window", (0, 0))),  # type: ignore[arg-type]
            info.get("clock") or {"offset_us": 0.0, "error_us": None},
            doc.get("traceEvents", []),
        ))
    runs = sorted({str(t.run_id) for t in traces})
    if len(runs) > 1:
        detail = "; ".join(
            f"run {r!r}: {', '.join(os.path.basename(t.path) for t in traces if str(t.run_id) == r)}"
            for r in runs)
        raise TraceError(f"The traces in {directory!r} come from different runs ({detail}); "
                         "merge one run's traces at a time.")
    windows: dict[tuple[int, int], dict[int, RankTrace]] = {}
    for t in traces:
        windows.setdefault(t.window, {})[t.rank] = t
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
