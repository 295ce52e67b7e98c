"""Prometheus metrics of DistributedDataParallel (to be folded into collectives/metrics.py)."""

from __future__ import annotations

from core import telemetry

BUCKET_ALLREDUCE_SECONDS = telemetry.histogram(
    "shoal_ddp_bucket_allreduce_seconds",
    "Time from launching a gradient bucket's reduction during backward to its completion.",
)

COMM_WAIT_SECONDS = telemetry.histogram(
    "shoal_ddp_comm_wait_seconds",
    "Time the end of backward waits for gradient communication that backward did not hide.",
)
