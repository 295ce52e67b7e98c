"""The elastic layer's metrics, and the node agent's /metrics server.

The agent serves its own metrics (the `shoal_elastic_*` families below, kept in this process's
default registry) together with its workers' metrics, which the workers write as files in
`PROMETHEUS_MULTIPROC_DIR` (prometheus_client's multiprocess mode, one directory per job).
"""

from __future__ import annotations

import logging
import os
from typing import Iterable, Optional

import prometheus_client
from prometheus_client import multiprocess
from prometheus_client.registry import CollectorRegistry

from shoal.core.telemetry import counter, gauge, histogram
from shoal.elastic.metrics_http import HardenedHTTPServer

logger = logging.getLogger(__name__)

# Reasons a node restarts its workers (the label set is fixed).
RESTART_REASONS = ("worker_failure", "peer_request", "scale_up", "node_lost")
WORKER_STATES = ("running", "succeeded", "failed", "stopped")

RESTARTS = counter(
    "shoal_elastic_restarts_total",
    "Times this node's agent restarted its workers, by reason.",
    ["reason"],
)
RENDEZVOUS_ROUND = gauge(
    "shoal_elastic_rendezvous_round",
    "The rendezvous round this node's workers run in (rounds count from 0).",
    multiprocess_mode="max",
)
RENDEZVOUS_DURATION = histogram(
    "shoal_elastic_rendezvous_duration_seconds",
    "Seconds from joining a rendezvous to the round being complete.",
)
WORKERS = gauge(
    "shoal_elastic_workers",
    "This node's workers, by state.",
    ["state"],
)

# Series exist from the start (at 0), so dashboards and alerts see them before any restart.
for _reason in RESTART_REASONS:
    RESTARTS.labels(reason=_reason)


def set_worker_states(counts: dict[str, int]) -> None:
    """Publish how many of this node's workers are in each state (missing states are 0)."""
    for state in WORKER_STATES:
        WORKERS.labels(state=state).set(counts.get(state, 0))


class _AgentAndWorkers:
    """A collector: the workers' multiprocess files, then this process's own families.

    A family that both sides have (say a store metric the agent touched itself) is taken from
    the workers only: Prometheus rejects a scrape that declares one family twice.
    """

    def __init__(self, multiproc_dir: Optional[str]):
        self._dir = multiproc_dir

    def collect(self) -> Iterable:
        names = set()
        if self._dir and os.path.isdir(self._dir):
            workers = CollectorRegistry()
            multiprocess.MultiProcessCollector(workers, path=self._dir)
            for family in workers.collect():
                names.add(family.name)
                yield family
        for family in prometheus_client.REGISTRY.collect():
            if family.name not in names:
                yield family


class MetricsServer:
    """Serve /metrics for this agent and its workers on `host:port` (port 0: any free one).

    The exposition is prometheus_client's; the HTTP server around it is `HardenedHTTPServer`
    (read/write timeouts, a cap on open connections, an accept loop that survives running out
    of file descriptors). `server_options` passes its limits (tests shorten them).

    Raises:
        OSError: the port cannot be bound.
    """

    def __init__(self, host: str, port: int, multiproc_dir: Optional[str], **server_options):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_AgentAndWorkers(multiproc_dir))
        self._httpd = HardenedHTTPServer(host, port, prometheus_client.make_wsgi_app(registry),
                                         **server_options)
        self.host = host
        self.port = self._httpd.port

    @property
    def url(self) -> str:
        """The scrape URL."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        """Stop serving and release the port."""
        self._httpd.stop()

    @property
    def trouble(self):
        """Counts of closed, timed-out and refused connections since the start, by kind."""
        return dict(self._httpd.tally.totals)


def mark_worker_dead(pid: int, multiproc_dir: Optional[str]) -> None:
    """Drop a dead worker's live gauges (its counters and histograms stay, as they should)."""
    if not multiproc_dir:
        return
    try:
        multiprocess.mark_process_dead(pid, multiproc_dir)
    except OSError as exc:
        logger.warning("Could not mark worker pid %s dead in %s: %s", pid, multiproc_dir, exc)

