"""Per rank and step: compute, communication (hidden behind compute or not), idle; the straggler.

Events are classified by what Kineto's categories and names say, so shoal's traces and torch's
read alike: compute is the union of ops (`cpu_op`), GPU kernels and copies, and optimizer
steps; communication the union of collectives (`gloo:<op>`, `nccl:<op>`, torch's `c10d::` ops)
and RPCs. Hidden communication overlaps compute; idle is the rest of the step; waiting is the
part of the collectives spent before the last rank arrived (clocks aligned).

The straggler is the rank the others wait for: the most step time outside exposed
communication (a rank that sleeps or computes longer makes everyone else wait in collectives).
It is named only when it is clear: its busy time must exceed the other ranks' median by
STRAGGLER_MARGIN of the median step time. Below that a difference is within what steps of one
rank vary by on a shared machine (scheduling, caches, page faults: a few percent), so naming a
rank would blame noise; a real straggler (a slow device, a busy host, a rank with more data)
costs every step tens of percent.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional

from shoal.launcher.trace.files import RankTrace, common_base, load
from shoal.launcher.trace.merge import COMM_PREFIXES, split_waits

STRAGGLER_MARGIN = 0.05  # of the median step time (see the module's docstring)
COMPUTE_CATS = frozenset({"cpu_op", "backward", "optimizer", "kernel", "gpu_memcpy",
                          "gpu_memset"})
COMM_CATS = frozenset({"collective", "rpc", "rpc_remote"})
_COMM_NAMES = COMM_PREFIXES + ("c10d::", "record_param_comms", "rpc_sync#", "rpc_async#",
                               "remote#", "rpc_remote#")


def kind(ev: dict) -> Optional[str]:
    """'step', 'comm', 'compute' or None for one trace event."""
    if ev.get("ph") != "X":
        return None
    name = ev.get("name")
    name = name if isinstance(name, str) else ""
    cat = ev.get("cat")
    if name.startswith("ProfilerStep#"):
        return "step"
    if cat in COMM_CATS or name.startswith(_COMM_NAMES):
        return "comm"
    if cat in COMPUTE_CATS or (cat == "user_annotation" and name.startswith("Optimizer.step")):
        return "compute"
    return None


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _intersect(a: list, b: list) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


@dataclass
class StepTimes:
    """One rank's step, in milliseconds."""

    rank: int
    step: int
    total: float
    compute: float
    comm: float
    hidden: float
    idle: float
    waiting: float = 0.0  # in collectives, for the other ranks to arrive (aligned clocks)

    @property
    def exposed(self) -> float:
        """Communication not overlapped by compute."""
        return self.comm - self.hidden

    @property
    def busy(self) -> float:
        """The step outside exposed communication: what the others wait for."""
        return self.total - self.exposed


@dataclass
class Verdict:
    """Which rank, if any, the others wait for, and the figures behind the call (ms/step)."""

    busiest: int
    busy: dict[int, float]
    others_median: float
    step_median: float

    @property
    def margin(self) -> float:
        """How far the busiest rank must exceed the others' median to be named."""
        return STRAGGLER_MARGIN * self.step_median

    @property
    def straggler(self) -> Optional[int]:
        """The straggler, or None when no rank stands out by the margin."""
        excess = self.busy[self.busiest] - self.others_median
        return self.busiest if excess > self.margin else None


def rank_steps(t: RankTrace) -> list[StepTimes]:
    """Each ProfilerStep of a rank's trace, broken down."""
    kinds = [(kind(e), e) for e in t.events]
    steps = [e for k, e in kinds if k == "step"]
    out = []
    for st in sorted(steps, key=lambda e: e["ts"]):
        s0, s1 = st["ts"], st["ts"] + st["dur"]

        def clipped(want: str) -> list:
            return _union([(max(e["ts"], s0), min(e["ts"] + e["dur"], s1)) for k, e in kinds
                           if k == want and e["ts"] < s1 and e["ts"] + e["dur"] > s0])

        comp, comm = clipped("compute"), clipped("comm")
        hidden = _length(_intersect(comp, comm))
        busy = _length(_union(comp + comm))
        waiting = sum((e.get("args") or {}).get("wait_for_peers_us", 0.0) for k, e in kinds
                      if k == "comm" and s0 <= e["ts"] < s1)
        out.append(StepTimes(t.rank, int(st["name"].split("#")[1]), st["dur"] / 1e3,
                             _length(comp) / 1e3, _length(comm) / 1e3, hidden / 1e3,
                             (st["dur"] - busy) / 1e3, waiting / 1e3))
    return out


def verdict(rows: list[StepTimes]) -> Optional[Verdict]:
    """The straggler call over every rank's steps (None with fewer than two ranks)."""
    ranks = sorted({r.rank for r in rows})
    if len(ranks) < 2:
        return None
    busy = {r: statistics.mean(x.busy for x in rows if x.rank == r) for r in ranks}
    busiest = max(ranks, key=lambda r: busy[r])
    others = statistics.median([busy[r] for r in ranks if r != busiest])
    return Verdict(busiest, busy, others, statistics.median(x.total for x in rows))


def summarize(directory: str) -> tuple[list[StepTimes], Optional[Verdict]]:
    """Every rank's steps and the straggler verdict (None with one rank)."""
    rows: list[StepTimes] = []
    windows = load(directory)
    base = common_base([t for ranks in windows.values() for t in ranks.values()])
    for _, ranks in sorted(windows.items()):
        aligned = []
        for rank, t in ranks.items():
            shift = t.shift_us(base)
            t.events = [dict(e, ts=e["ts"] + shift, pid=rank)
                        if isinstance(e.get("ts"), (int, float)) else e for e in t.events]
            aligned.extend(t.events)
        split_waits(aligned)
        for _, t in sorted(ranks.items()):
            rows.extend(rank_steps(t))
    return rows, verdict(rows)


def render(rows: list[StepTimes], call: Optional[Verdict]) -> str:
    """The summary as the CLI prints it."""
    head = (f"{'rank':>4}  {'step':>4}  {'step ms':>9}  {'compute':>9}  {'comm':>9}  "
            f"{'hidden':>9}  {'exposed':>9}  {'idle':>9}  {'waiting':>9}")
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda x: (x.rank, x.step)):
        lines.append(f"{r.rank:>4}  {r.step:>4}  {r.total:>9.2f}  {r.compute:>9.2f}  "
                     f"{r.comm:>9.2f}  {r.hidden:>9.2f}  {r.exposed:>9.2f}  {r.idle:>9.2f}  "
                     f"{r.waiting:>9.2f}")
    if call is not None:
        lines.append("")
        b = call.busiest
        if call.straggler is not None:
            lines.append(
                f"straggler: rank {b} (busy {call.busy[b]:.2f} ms per step outside exposed "
                f"communication, the other ranks' median {call.others_median:.2f} ms: they "
                "wait for it)")
        else:
            lines.append(
                f"no clear straggler: the busiest rank, {b}, is busy {call.busy[b]:.2f} ms per "
                f"step outside exposed communication, {call.busy[b] - call.others_median:.2f} "
                f"ms more than the others' median; naming one takes more than "
                f"{100 * STRAGGLER_MARGIN:.0f}% of the median step ({call.margin:.2f} ms), "
                "beyond what steps vary by on one machine")
    return "\n".join(lines) + "\n"
