"""Prometheus metrics of the process-group layer (names `shoal_collectives_*`).

Under `shoal run` every worker writes these into its own multiprocess file and the node agent
serves their sum; what must stay per rank (where a straggler shows) carries a `rank` label,
bounded by the world size: the time spent inside collectives and the last one's completion time.
"""

from __future__ import annotations

import os
import threading
import time

from shoal.core import telemetry

OP_DURATION = telemetry.histogram(
    "shoal_collectives_op_duration_seconds",
    "Wall time of one collective on this rank, from start to completion.",
    ["op", "backend"],
)
BYTES = telemetry.counter(
    "shoal_collectives_bytes_total",
    "Bytes of user arrays handed to collectives on this rank.",
    ["op"],
)
TIMEOUTS = telemetry.counter(
    "shoal_collectives_timeouts_total",
    "Collectives this rank's watchdog failed for running past their timeout.",
    ["op"],
)
ERRORS = telemetry.counter(
    "shoal_collectives_errors_total",
    "Collectives that failed on this rank, by kind (timeout, peer_lost, mismatch, error).",
    ["op", "kind"],
)

WAIT_SECONDS = telemetry.counter(
    "shoal_collectives_wait_seconds_total",
    "Seconds this rank spent inside collectives, start to completion. In a synchronous job "
    "the slowest rank waits least: the others wait for it.",
    ["rank"],
)
# "max" over the rank's processes, ended ones included: a timestamp only grows, so this is the
# rank's last progress even while its worker is being restarted (a job stuck in a rendezvous
# still shows as stalled). Ranks a node no longer runs are left out by its agent
# (elastic.metrics serves the current round's ranks only).
LAST_OP_TIME = telemetry.gauge(
    "shoal_collectives_last_op_timestamp_seconds",
    "Unix time at which this rank's last collective completed (a progress heartbeat).",
    ["rank"],
    multiprocess_mode="max",
)

# Where a rank is stuck, per rank: written by the watchdog's progress thread (never on the hot
# path) once a collective has run for WAIT_REPORT_AFTER_S, and set back to 0 when it ends.
# "livemax": a live process's value only (a dead rank's last wait must not outlive it).
IN_COLLECTIVE_SINCE = telemetry.gauge(
    "shoal_collectives_in_collective_since_timestamp_seconds",
    "Unix time at which the collective this rank is still inside started, once it has run for "
    "a second (0: none has).",
    ["rank"],
    multiprocess_mode="livemax",
)
WAITING_FOR = telemetry.gauge(
    "shoal_collectives_waiting_for_rank_since_timestamp_seconds",
    "Unix time since which this rank (rank) has waited inside a collective for another rank "
    "(peer, a world rank) that never arrived or did not finish it, as the group's progress "
    "records in the store show (0: not waiting for that rank).",
    ["rank", "peer"],
    multiprocess_mode="livemax",
)
WAIT_REPORT_AFTER_S = 1.0  # a collective this long is reported, and whom it waits for read
# Reading whom it waits for costs one store read per rank of the group, from every rank that
# waits: in a group larger than WAIT_READ_RANKS the first read waits proportionally longer (a
# 640-rank group's after 10 s), never longer than WAIT_READ_MAX_S, the cap between reads too.
WAIT_READ_RANKS = 64
WAIT_READ_MAX_S = 60.0


def wait_read_after(size: int) -> float:
    """Seconds into a collective before a rank of a `size`-rank group reads whom it waits for."""
    return min(WAIT_READ_MAX_S, WAIT_REPORT_AFTER_S * max(1.0, size / WAIT_READ_RANKS))

# The ops and failure kinds the backends report. Their error and timeout series exist (at 0)
# from the start: increase() only sees a counter's first increment if the series was scraped
# at 0 before it, so a child created on first use would hide the first error of each kind.
OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "barrier",
       "reduce", "gather", "scatter", "send", "recv")
# The op label of a group failure found while no collective ran (a peer killed between two).
NO_OP = "none"
ERROR_KINDS = ("timeout", "peer_lost", "mismatch", "error")
for _op in OPS:
    TIMEOUTS.labels(op=_op)
    for _kind in ERROR_KINDS:
        ERRORS.labels(op=_op, kind=_kind)
for _kind in ("peer_lost", "error"):
    ERRORS.labels(op=NO_OP, kind=_kind)

# Child lookups take a lock and a dict probe; a 4 KiB all_reduce is cheap enough to notice.
_children: dict = {}
_rank_children: list = []
# Wait seconds not yet written, and when they last were (see observe). A heartbeat is then at
# most FLUSH_S stale, and a rate over a scrape interval off by at most FLUSH_S of waiting.
FLUSH_S = 0.05
_pending = [0.0, float("-inf")]


def _rank_pair():
    """This process's (wait counter, heartbeat gauge) children, resolved once; the rank comes
    from RANK (shoal run and torchrun set it), "0" for a process started without it."""
    if not _rank_children:
        rank = os.environ.get("RANK", "0")
        _rank_children.append((WAIT_SECONDS.labels(rank=rank), LAST_OP_TIME.labels(rank=rank)))
        IN_COLLECTIVE_SINCE.labels(rank=rank)  # exists at 0 from the first collective on
    return _rank_children[0]


# DistributedDataParallel: how long each bucket's reduction took from its launch during
# backward, and how long the end of backward still waited (communication not hidden).
DDP_BUCKET_ALLREDUCE_SECONDS = telemetry.histogram(
    "shoal_ddp_bucket_allreduce_seconds",
    "Time from launching a gradient bucket's reduction during backward to its completion.",
)

DDP_COMM_WAIT_SECONDS = telemetry.histogram(
    "shoal_ddp_comm_wait_seconds",
    "Time the end of backward waits for gradient communication that backward did not hide.",
)

def observe(op: str, backend: str, seconds: float, nbytes: int) -> None:
    """Record one finished collective."""
    pair = _children.get((op, backend))
    if pair is None:
        pair = (OP_DURATION.labels(op=op, backend=backend), BYTES.labels(op=op))
        _children[(op, backend)] = pair
    pair[0].observe(seconds)
    if nbytes:
        pair[1].inc(nbytes)
    # The rank's wait counter and heartbeat are written at most every FLUSH_S: in multiprocess
    # mode each write is a locked mmap store (~2 us), too much for every small collective.
    _pending[0] += seconds
    now = time.monotonic()
    if now - _pending[1] >= FLUSH_S:
        flush_rank_metrics(now)


def flush_rank_metrics(now: float | None = None) -> None:
    """Write the wait time gathered since the last flush and stamp the heartbeat."""
    wait, heartbeat = _rank_pair()
    wait.inc(_pending[0])
    heartbeat.set(time.time())
    _pending[0] = 0.0
    _pending[1] = time.monotonic() if now is None else now


def count_error(op: str, kind: str) -> None:
    """Record one failed collective."""
    ERRORS.labels(op=op, kind=kind).inc()


def count_timeout(op: str) -> None:
    """Record one collective failed by the watchdog."""
    TIMEOUTS.labels(op=op).inc()


class WaitReport:
    """Where this process's groups wait, merged into the per-rank gauges.

    Each group's watchdog reports its own state (`update`); the gauges show the earliest start
    over the groups and, per awaited world rank, the earliest wait. Ranks no longer awaited are
    set back to 0 (a multiprocess gauge's child cannot be removed).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: dict = {}  # group key -> (since, {peer world rank: since})
        self._shown_peers: set = set()

    def update(self, group_key, since: float, peers: dict) -> None:
        """Group `group_key` is inside a collective since `since` (Unix time; 0: not inside a
        long one), waiting for `peers` ({world rank: since}); `since` 0 clears it."""
        with self._lock:
            if since:
                self._groups[group_key] = (since, dict(peers))
            elif self._groups.pop(group_key, None) is None:
                return
            self._write()

    def _write(self) -> None:
        rank = os.environ.get("RANK", "0")
        starts = [since for since, _ in self._groups.values()]
        IN_COLLECTIVE_SINCE.labels(rank=rank).set(min(starts) if starts else 0.0)
        merged: dict = {}
        for _, peers in self._groups.values():
            for peer, since in peers.items():
                merged[peer] = min(since, merged.get(peer, since))
        for peer in self._shown_peers - merged.keys():
            WAITING_FOR.labels(rank=rank, peer=str(peer)).set(0.0)
        for peer, since in merged.items():
            WAITING_FOR.labels(rank=rank, peer=str(peer)).set(since)
        self._shown_peers = set(merged)


WAITS = WaitReport()