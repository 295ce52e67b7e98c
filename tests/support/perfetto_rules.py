"""The rules Perfetto's JSON importer (trace_processor, what ui.perfetto.dev runs) enforces, each
named after the `stats` entry a breach raises, checked in Python.

Perfetto's own trace_processor, the `perfetto` package's, fetches its binary from the network
on first use, which these machines cannot reach; where a test can run it
(`PERFETTO_TRACE_PROCESSOR` names a binary), `trace_processor_errors` asks it instead.

Times are read as Perfetto reads them: `int(ts * 1000)` nanoseconds, a slice's end the sum of
its truncated start and duration.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Optional


def _ns(us: float) -> int:
    return int(us * 1000.0)


def _thread_slices(events: list[dict]) -> dict[tuple, list[tuple[int, int, int, dict]]]:
    lanes: dict[tuple, list[tuple[int, int, int, dict]]] = defaultdict(list)
    for order, e in enumerate(events):
        if e.get("ph") == "X":
            start = _ns(e["ts"])
            lanes[(e["pid"], e["tid"])].append((start, start + _ns(e["dur"]), order, e))
    for items in lanes.values():
        items.sort(key=lambda x: (x[0], x[2]))  # the sorter: by time, file order on ties
    return lanes


def overlapping_slices(events: list[dict]) -> list[str]:
    """Complete events on one thread that overlap without nesting (Perfetto drops them)."""
    bad = []
    for lane, items in _thread_slices(events).items():
        stack: list[tuple[int, int, int, dict]] = []
        for item in items:
            while stack and stack[-1][1] <= item[0]:
                stack.pop()
            if stack and item[1] > stack[-1][1]:
                bad.append(f"{lane}: {item[3]['name']!r} [{item[0]}, {item[1]}] crosses the end "
                           f"of {stack[-1][3]['name']!r} [{stack[-1][0]}, {stack[-1][1]}]")
                continue
            stack.append(item)
    return bad


def _enclosing(lanes: dict, lane: tuple, ts: int) -> bool:
    return any(s <= ts < e or s == ts == e for s, e, _, _ in lanes.get(lane, ()))


def flow_errors(events: list[dict]) -> list[str]:
    """flow_duplicate_id, flow_end_without_start, flow_without_direction, flow_invalid_id and
    flow_no_enclosing_slice: a v1 flow's `s` and `f` pair up by (cat, id), each inside a slice of
    its thread when it happens."""
    lanes = _thread_slices(events)
    starts: dict[tuple, int] = defaultdict(int)
    ends: dict[tuple, int] = defaultdict(int)
    bad = []
    for e in events:
        if e.get("ph") not in ("s", "t", "f"):
            continue
        if not isinstance(e.get("id"), (int, str)):
            bad.append(f"flow_invalid_id: {e}")
            continue
        key = (e.get("cat"), e["id"])
        (starts if e["ph"] == "s" else ends)[key] += 1
        if not _enclosing(lanes, (e["pid"], e["tid"]), _ns(e["ts"])):
            bad.append(f"flow_no_enclosing_slice: {e}")
    for key, n in starts.items():
        if n > 1:
            bad.append(f"flow_duplicate_id: {key} starts {n} times")
    for key in ends:
        if key not in starts:
            bad.append(f"flow_end_without_start: {key}")
    return bad


def async_errors(events: list[dict]) -> list[str]:
    """Nestable async events: every `b` ends with an `e` of the same (cat, id, name), later."""
    open_: dict[tuple, list[int]] = defaultdict(list)
    bad = []
    for e in sorted((e for e in events if e.get("ph") in ("b", "e")),
                    key=lambda e: (_ns(e["ts"]), e["ph"] == "b")):
        key = (e["pid"], e.get("cat"), e.get("id"), e.get("name"))
        if e["ph"] == "b":
            open_[key].append(_ns(e["ts"]))
        elif not open_[key]:
            bad.append(f"async end without a begin: {key}")
        else:
            open_[key].pop()
    bad.extend(f"async begin never ended: {k}" for k, v in open_.items() if v)
    return bad


def shape_errors(events: list[dict]) -> list[str]:
    """json_parser_failure's causes: a phase Perfetto does not know, a complete event without
    a numeric time, a negative duration, a pid or tid outside 32 bits."""
    bad = []
    for e in events:
        ph = e.get("ph")
        if ph not in ("X", "B", "E", "i", "I", "C", "M", "s", "t", "f", "b", "e", "n"):
            bad.append(f"unknown phase: {e}")
            continue
        if ph != "M" and not isinstance(e.get("ts"), (int, float)):
            bad.append(f"no numeric ts: {e}")
        if ph == "X" and not (isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0):
            bad.append(f"bad dur: {e}")
        for key in ("pid", "tid"):
            v = e.get(key)
            if isinstance(v, int) and not 0 <= v < 2 ** 32:
                bad.append(f"{key} outside 32 bits: {e}")
    return bad


def import_errors(doc: dict) -> list[str]:
    """Every breach of the rules above in a trace document; [] when Perfetto imports it clean."""
    events = doc["traceEvents"]
    return (shape_errors(events) + overlapping_slices(events) + flow_errors(events)
            + async_errors(events))


def trace_processor_errors(path: str) -> Optional[dict]:
    """The error-severity `stats` of `path` by Perfetto's own trace_processor, when
    PERFETTO_TRACE_PROCESSOR names its binary; else None."""
    binary = os.environ.get("PERFETTO_TRACE_PROCESSOR")
    if not binary:
        return None
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

    tp = TraceProcessor(trace=path, config=TraceProcessorConfig(bin_path=binary))
    try:
        rows = tp.query("select name, idx, value from stats "
                        "where severity in ('error', 'data_loss') and value > 0")
        return {f"{r.name}[{r.idx}]": r.value for r in rows}
    finally:
        tp.close()
