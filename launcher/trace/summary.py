"""Per rank and step: compute, communication (hidden behind compute or not), idle; the straggler.

Compute is the union of op, backward and optimizer events; communication the union of
collective and RPC events; hidden communication overlaps compute; idle is the rest of the step;
waiting is the part of the collectives spent before the last rank arrived (clocks aligned).
The straggler is the rank the others wait for: the most step time outside exposed
communication (a rank that sleeps or computes longer makes everyone else wait in collectives).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from shoal.launcher.trace.files import RankTrace, load
from shoal.launcher.trace.merge import split_waits

COMPUTE = frozenset({"cpu_op", "backward", "optimizer", "kernel"})
COMM = frozenset({"collective", "rpc", "rpc_remote"})


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


def rank_steps(t: RankTrace) -> list[StepTimes]:
    """Each ProfilerStep of a rank's trace, broken down."""
    steps = [e for e in t.events if e.get("ph") == "X" and e.get("name", "").startswith(
        "ProfilerStep#")]
    spans = [e for e in t.events if e.get("ph") == "X"]
    out = []
    for st in sorted(steps, key=lambda e: e["ts"]):
        s0, s1 = st["ts"], st["ts"] + st["dur"]

        def clipped(cats: frozenset) -> list:
            return _union([(max(e["ts"], s0), min(e["ts"] + e["dur"], s1)) for e in spans
                           if e.get("cat") in cats and e["ts"] < s1 and e["ts"] + e["dur"] > s0])

        comp, comm = clipped(COMPUTE), clipped(COMM)
        hidden = _length(_intersect(comp, comm))
        busy = _length(_union(comp + comm))
        waiting = sum((e.get("args") or {}).get("wait_for_peers_us", 0.0) for e in spans
                      if e.get("cat") == "collective" and s0 <= e["ts"] < s1)
        out.append(StepTimes(t.rank, int(st["name"].split("#")[1]), st["dur"] / 1e3,
                             _length(comp) / 1e3, _length(comm) / 1e3, hidden / 1e3,
                             (st["dur"] - busy) / 1e3, waiting / 1e3))
    return out


def summarize(directory: str) -> tuple[list[StepTimes], int | None]:
    """Every rank's steps and the straggler rank (None with one rank)."""
    rows: list[StepTimes] = []
    for _, ranks in sorted(load(directory).items()):
        aligned = []
        for rank, t in ranks.items():
            shift = float(t.clock.get("offset_us") or 0.0)
            t.events = [dict(e, ts=e["ts"] + shift, pid=rank) if "ts" in e else e
                        for e in t.events]
            aligned.extend(t.events)
        split_waits(aligned)
        for _, t in sorted(ranks.items()):
            rows.extend(rank_steps(t))
    ranks = sorted({r.rank for r in rows})
    if len(ranks) < 2:
        return rows, None
    busy = {r: statistics.mean(x.busy for x in rows if x.rank == r) for r in ranks}
    return rows, max(ranks, key=lambda r: busy[r])


def render(rows: list[StepTimes], straggler: int | None) -> str:
    """The summary as the CLI prints it."""
    head = (f"{'rank':>4}  {'step':>4}  {'step ms':>9}  {'compute':>9}  {'comm':>9}  "
            f"{'hidden':>9}  {'exposed':>9}  {'idle':>9}  {'waiting':>9}")
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda x: (x.rank, x.step)):
        lines.append(f"{r.rank:>4}  {r.step:>4}  {r.total:>9.2f}  {r.compute:>9.2f}  "
                     f"{r.comm:>9.2f}  {r.hidden:>9.2f}  {r.exposed:>9.2f}  {r.idle:>9.2f}  "
                     f"{r.waiting:>9.2f}")
    if straggler is not None:
        ranks = sorted({r.rank for r in rows})
        busy = {k: statistics.mean(x.busy for x in rows if x.rank == k) for k in ranks}
        others = statistics.median([busy[k] for k in ranks if k != straggler])
        lines.append("")
        lines.append(
            f"straggler: rank {straggler} (busy {busy[straggler]:.2f} ms per step outside "
            f"exposed communication, the other ranks' median {others:.2f} ms: they wait for it)"
        )
    return "\n".join(lines) + "\n"
