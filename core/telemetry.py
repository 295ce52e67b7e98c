"""Helpers every package's `metrics.py` and logging use.

Metrics go through prometheus_client. When PROMETHEUS_MULTIPROC_DIR is set (shoal run sets it
for workers) prometheus_client writes per-process files that the node agent serves together.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Sequence

import prometheus_client

from shoal.core import settings

_lock = threading.Lock()
# name -> (metric, (type, label names, options)) of every metric made here.
_metrics: dict[str, tuple[object, tuple]] = {}

# Latency buckets from 50 us to 10 min: covers a 4 KiB allreduce and a hung barrier alike.
LATENCY_BUCKETS = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0,
)


def _describe(shape: tuple) -> str:
    kind, labelnames, options = shape
    text = f"a {kind.__name__} with labels {list(labelnames)}"
    if options:
        text += " and " + ", ".join(f"{key}={value!r}" for key, value in options)
    return text


def _get_or_create(kind, name: str, documentation: str, labelnames: Sequence[str], **kwargs):
    """The metric `name`, made on the first request; later requests get the same object.

    Registering twice raises in prometheus_client, and tests and re-imports ask again. A
    request for another type, other label names or other options (buckets, multiprocess mode)
    is a mistake that would otherwise hand back a metric that does not fit its caller.

    Raises:
        ValueError: `name` exists with another type, label names or options.
    """
    options = tuple(sorted((key, tuple(value) if isinstance(value, list) else value)
                           for key, value in kwargs.items()))
    shape = (kind, tuple(labelnames), options)
    with _lock:
        known = _metrics.get(name)
        if known is None:
            metric = kind(name, documentation, labelnames=tuple(labelnames), **kwargs)
            _metrics[name] = (metric, shape)
            return metric
        metric, first = known
        if first != shape:
            raise ValueError(
                f"Metric {name!r} exists as {_describe(first)}; it was asked for again as "
                f"{_describe(shape)}. One name has one type, one set of labels and one set of "
                "options: give the other metric a name of its own.")
        return metric


def counter(name: str, documentation: str, labelnames: Sequence[str] = ()):
    """A process-wide prometheus Counter, created once."""
    return _get_or_create(prometheus_client.Counter, name, documentation, labelnames)


def gauge(name: str, documentation: str, labelnames: Sequence[str] = (),
          multiprocess_mode="livesum"):
    """A process-wide prometheus Gauge, created once (summed across worker processes)."""
    return _get_or_create(
        prometheus_client.Gauge, name, documentation, labelnames,
        multiprocess_mode=multiprocess_mode,
    )


def histogram(name: str, documentation: str, labelnames: Sequence[str] = (),
              buckets=LATENCY_BUCKETS):
    """A process-wide prometheus Histogram, created once."""
    return _get_or_create(
        prometheus_client.Histogram, name, documentation, labelnames, buckets=buckets
    )


class _RankPrefix(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rank = os.environ.get("RANK")
        record.rank_prefix = f"[rank {rank}] " if rank is not None else ""
        return True


def configure_logging(level: int | str | None = None) -> None:
    """Log to stderr with a rank prefix; the level comes from SHOAL_LOG_LEVEL (default WARNING)."""
    level = level or (settings.LOG_LEVEL.get() or "warning").upper()
    handler = logging.StreamHandler()
    handler.addFilter(_RankPrefix())
    handler.setFormatter(
        logging.Formatter("%(rank_prefix)s%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
