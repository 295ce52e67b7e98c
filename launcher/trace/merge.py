"""One Chrome/Perfetto trace for the job: a process per rank, clocks aligned to rank 0's."""

from __future__ import annotations

import json
import os

from shoal.launcher.trace.files import RankTrace, load


def split_waits(events: list[dict]) -> None:
    """Add `wait_for_peers_us` and `moving_us` to the args of every collective that several
    ranks' aligned events show: a rank's collective cannot move data before the last rank
    arrives, so the time from its own start to the last rank's start is waiting for peers.

    Collectives match by group, sequence number and call; timestamps must already be aligned
    (the split is as good as the clock error).
    """
    by_key: dict[tuple, list[dict]] = {}
    for ev in events:
        args = ev.get("args") or {}
        if ev.get("cat") == "collective" and not args.get("p2p") and "seq" in args:
            by_key.setdefault((args.get("group"), args["seq"], args.get("call")), []).append(ev)
    for evs in by_key.values():
        if len({e["pid"] for e in evs}) < 2:
            continue
        last = max(e["ts"] for e in evs)
        for e in evs:
            wait = min(max(0.0, last - e["ts"]), e["dur"])
            e["args"]["wait_for_peers_us"] = round(wait, 3)
            e["args"]["moving_us"] = round(e["dur"] - wait, 3)


def merged(windows: dict[tuple[int, int], dict[int, RankTrace]]) -> dict:
    """The merged trace document; each rank's timestamps are shifted by its clock offset."""
    events: list[dict] = []
    clocks: dict[str, dict] = {}
    errors: list[float] = []
    flow_ids: dict[tuple, int] = {}
    for window, ranks in sorted(windows.items()):
        for rank, t in sorted(ranks.items()):
            shift = float(t.clock.get("offset_us") or 0.0)
            err = t.clock.get("error_us")
            clocks[str(rank)] = t.clock
            if err is not None:
                errors.append(float(err))
            for ev in t.events:
                if ev.get("ph") == "M" and ev.get("name") == "process_name":
                    continue
                ev = dict(ev)
                ev["pid"] = rank
                if "ts" in ev:
                    ev["ts"] = ev["ts"] + shift
                if ev.get("ph") in ("s", "f"):  # flow ids are per rank: renumber them
                    ev["id"] = flow_ids.setdefault((rank, window, ev["id"]), len(flow_ids) + 1)
                events.append(ev)
    split_waits(events)
    for rank in sorted({r for ranks in windows.values() for r in ranks}):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
    first = next(iter(next(iter(windows.values())).values()))
    return {
        "schemaVersion": 1,
        "displayTimeUnit": "ms",
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
