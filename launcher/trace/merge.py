"""One Chrome/Perfetto trace for the job: each rank's processes (its own and its GPUs'), clocks
aligned to rank 0's, named `rank R` (and `rank R GPU d`).

Pids stay the OS's; a pid two ranks share (two hosts, or GPU d on two hosts) is renumbered for
the later rank. Flow and async ids are per file, so they are renumbered per rank and window.
"""

from __future__ import annotations

import json
import os
from typing import Any

from shoal.launcher.trace.files import RankTrace, common_base, load

COMM_PREFIXES = ("gloo:", "nccl:")
_PROCESS_METADATA = ("process_name", "process_labels", "process_sort_index")


def is_collective(ev: dict) -> bool:
    """A collective's event: torch's `gloo:<op>`/`nccl:<op>`, or shoal's older `collective`."""
    name = ev.get("name")
    return ev.get("cat") == "collective" or (isinstance(name, str)
                                             and name.startswith(COMM_PREFIXES))


def split_waits(events: list[dict]) -> None:
    """Add `wait_for_peers_us` and `moving_us` to the args of every collective that several
    ranks' aligned events show: a rank's collective cannot move data before the last rank
    arrives, so the time from its own start to the last rank's start is waiting for peers.

    Collectives match by group, sequence number and call (shoal's arguments), or, in a trace
    without them (torch's), by name, group and order of start on each rank; timestamps must
    already be aligned (the split is as good as the clock error).
    """
    by_key: dict[tuple, list[dict]] = {}
    ordinal: dict[tuple, int] = {}
    for ev in sorted(events, key=lambda e: e.get("ts", 0.0)):
        args = ev.get("args") or {}
        if ev.get("ph") != "X" or not is_collective(ev) or args.get("p2p"):
            continue
        if "seq" in args:
            key = (args.get("group"), args["seq"], args.get("call"))
        else:
            mine = (ev["pid"], ev.get("name"), args.get("Process Group Name"))
            ordinal[mine] = ordinal.get(mine, 0) + 1
            key = (ev.get("name"), args.get("Process Group Name"), ordinal[mine])
        by_key.setdefault(key, []).append(ev)
    for evs in by_key.values():
        if len({e["pid"] for e in evs}) < 2:
            continue
        last = max(e["ts"] for e in evs)
        for e in evs:
            wait = min(max(0.0, last - e["ts"]), e["dur"])
            e["args"] = dict(e["args"], wait_for_peers_us=round(wait, 3),
                             moving_us=round(e["dur"] - wait, 3))


def shifted(ts: float, shift_us: float) -> float:
    """`ts` moved by `shift_us`, on whole nanoseconds with shoal's quarter-nanosecond nudge
    (core/profiler/kineto.py), so Perfetto's truncation keeps nested slices nested after the
    shift; files' own `ts` are whole nanoseconds (Kineto's) or nudged ones (shoal's)."""
    ns = round(ts * 1000 - 0.25) + round(shift_us * 1000)
    return (ns + 0.25) / 1e3


class _Pids:
    """(rank, pid in its file) -> a pid unique in the merged trace, and each one's name."""

    def __init__(self) -> None:
        self.map: dict[tuple[int, Any], Any] = {}
        self.used: set = set()
        self.names: dict[Any, tuple[int, str]] = {}  # merged pid -> (rank, its label)

    def get(self, rank: int, pid: Any) -> Any:
        key = (rank, pid)
        if key not in self.map:
            new = pid if isinstance(pid, int) else f"{pid} (rank {rank})"
            while new in self.used:
                new = max(p for p in self.used if isinstance(p, int)) + 1
            self.map[key] = new
            self.used.add(new)
            self.names[new] = (rank, "")
        return self.map[key]


def _rank_events(rank: int, window: tuple, t: RankTrace, shift: float, pids: _Pids,
                 ids: dict) -> list[dict]:
    out = []
    for ev in t.events:
        if ev.get("ph") == "M" and ev.get("name") in _PROCESS_METADATA:
            if ev.get("name") == "process_labels":
                label = (ev.get("args") or {}).get("labels", "")
                pid = pids.get(rank, ev.get("pid"))
                pids.names[pid] = (rank, "" if label == "CPU" else str(label))
            continue
        ev = dict(ev)
        ev["pid"] = pids.get(rank, ev.get("pid"))
        if isinstance(ev.get("ts"), (int, float)):
            ev["ts"] = shifted(ev["ts"], shift)
        if ev.get("ph") in ("s", "f", "t", "b", "e", "n") and "id" in ev:
            key = (rank, window, ev["ph"] in ("b", "e", "n"), ev.get("cat"), ev["id"])
            ev["id"] = ids.setdefault(key, len(ids) + 1)
        out.append(ev)
    return out


def merged(windows: dict[tuple[int, int], dict[int, RankTrace]]) -> dict:
    """The merged trace document; each rank's timestamps are shifted by its clock offset."""
    events: list[dict] = []
    clocks: dict[str, dict] = {}
    errors: list[float] = []
    ids: dict[tuple, int] = {}
    pids = _Pids()
    base = common_base([t for ranks in windows.values() for t in ranks.values()])
    for window, ranks in sorted(windows.items()):
        for rank, t in sorted(ranks.items()):
            err = t.clock.get("error_us")
            clocks[str(rank)] = t.clock
            if err is not None:
                errors.append(float(err))
            events.extend(_rank_events(rank, window, t, t.shift_us(base), pids, ids))
    split_waits(events)
    for pid, (rank, label) in sorted(pids.names.items(), key=lambda kv: (kv[1], str(kv[0]))):
        name = f"rank {rank}" + (f" {label}" if label else "")
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": rank * 100 + (1 if label else 0)}})
    first = next(iter(next(iter(windows.values())).values()))
    return {
        "schemaVersion": 1,
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": base,
        "shoal": {
            "run_id": first.run_id,
            "windows": [list(w) for w in sorted(windows)],
            "clocks": clocks,
            # Each rank's offset is right within its own error; two ranks' events are placed
            # relative to each other within the sum of their errors, at most twice this.
            "clock_error_us": max(errors) if errors else None,
        },
        "traceEvents": events,
    }


def merge(directory: str, output: str) -> dict:
    """Merge DIR's traces into `output`; returns the document."""
    doc = merged(load(directory))
    tmp = f"{output}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, output)
    return doc
