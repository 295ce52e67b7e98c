"""Prometheus metrics of the process-group layer (names `shoal_collectives_*`)."""

from __future__ import annotations

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

# Child lookups take a lock and a dict probe; a 4 KiB all_reduce is cheap enough to notice.
_children: dict = {}


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


def count_error(op: str, kind: str) -> None:
    """Record one failed collective."""
    ERRORS.labels(op=op, kind=kind).inc()


def count_timeout(op: str) -> None:
    """Record one collective failed by the watchdog."""
    TIMEOUTS.labels(op=op).inc()
