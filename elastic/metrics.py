"""The elastic layer's metrics, and the node agent's /metrics server.

The agent serves its own metrics (the `shoal_elastic_*` families below, kept in this process's
default registry) together with its workers' metrics, which the workers write as files in
`PROMETHEUS_MULTIPROC_DIR` (prometheus_client's multiprocess mode, one directory per job).

Every sample served carries a `run_id` label (the rendezvous id), added here rather than by a
scrape relabel rule, so two jobs under one Prometheus job stay apart however they are scraped.
Per-worker memory and CPU come from /proc, read by the agent at scrape time (prometheus_client's
process collector does not work in multiprocess mode).

Restarts and worker exits are counters with whole values plus a timestamp gauge, so an event
between two scrapes still shows: the counter stays one higher, the timestamp moves.

Only the ranks this node runs in the current round are served from the workers' files: after a
re-rendezvous that gives this node other ranks (a scale-down, another node order), the files of
the ranks it ran before stay in the directory (counters must survive a worker's restart), and
their frozen heartbeats would otherwise look like ranks that stopped making progress.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import logging
import os
import re
import ssl
import threading
import time
from typing import Iterable, Mapping, Optional

import prometheus_client
from prometheus_client import multiprocess
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import CollectorRegistry

from shoal.collectives.types import ASYNC_ERROR_EXIT_CODE
from shoal.core.telemetry import counter, gauge, histogram
from shoal.elastic import settings
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

LAST_RESTART = gauge(
    "shoal_elastic_last_restart_timestamp_seconds",
    "Unix time this node's agent last restarted its workers (0: never).",
)
JOB_RESTARTS = gauge(
    "shoal_elastic_job_restarts",
    "Restarts after worker failures the whole job has used so far (max_restarts bounds it).",
)
MAX_RESTARTS = gauge(
    "shoal_elastic_max_restarts",
    "Restarts after worker failures the job may use (shoal run --max-restarts).",
)
WORKER_EXITS = counter(
    "shoal_elastic_worker_exits_total",
    "This node's worker processes that ended, by how: succeeded (exit 0), aborted (exit "
    "status 75: its collective watchdog gave up on a peer that failed), failed (any other end "
    "the agent did not cause) or stopped (by the agent).",
    ["state"],
)
RENDEZVOUS_LAST = gauge(
    "shoal_elastic_rendezvous_last_duration_seconds",
    "Seconds the last rendezvous took, from joining to the round being complete.",
)
JOB_INFO = gauge(
    "shoal_job_info",
    "Always 1; the labels describe the job this agent runs: run id, world size, nodes, "
    "max_restarts.",
    ["world_size", "nnodes", "max_restarts"],
)
EXIT_STATES = ("succeeded", "failed", "aborted", "stopped")

# Series exist from the start (at 0), so dashboards and alerts see them before any restart.
for _reason in RESTART_REASONS:
    RESTARTS.labels(reason=_reason)
for _state in EXIT_STATES:
    WORKER_EXITS.labels(state=_state)

# `_created` samples double the series count and nobody graphs them.
prometheus_client.disable_created_metrics()

_run_id: Optional[str] = None
_worker_pids: dict[int, int] = {}  # global rank -> pid of this node's running workers
_round_ranks: Optional[frozenset] = None  # rank labels of this node's current round (None: all)
_job_pids: set[int] = set()  # every worker this agent started (their dumps count)
_dump_dir: Optional[str] = None
# collectives.backends.dump's file names (elastic.agent.hang_blame reads the same files).
_DUMP_NAME = re.compile(r"shoal-collectives-.*-pid(\d+)-.*\.json")
_pids_lock = threading.Lock()


def set_job(run_id: str, world_size: int, nnodes: int, max_restarts: int,
            restarts_used: int) -> None:
    """Describe the job of the current round (its size may change between rounds)."""
    global _run_id
    _run_id = run_id
    JOB_INFO.clear()
    JOB_INFO.labels(world_size=str(world_size), nnodes=str(nnodes),
                    max_restarts=str(max_restarts)).set(1)
    MAX_RESTARTS.set(max_restarts)
    JOB_RESTARTS.set(restarts_used)


def set_run_id(run_id: str) -> None:
    """The run id every served sample is labelled with (before the first round too)."""
    global _run_id
    _run_id = run_id


def note_restart(reason: str) -> None:
    """Count one restart of this node's workers and stamp its time."""
    RESTARTS.labels(reason=reason).inc()
    LAST_RESTART.set(time.time())


def exit_state(exitcode: int, stopped: bool) -> str:
    """How a worker ended, as counted in WORKER_EXITS."""
    if stopped:
        return "stopped"
    if exitcode == 0:
        return "succeeded"
    return "aborted" if exitcode == ASYNC_ERROR_EXIT_CODE else "failed"


def count_worker_exit(exitcode: int, stopped: bool) -> None:
    """Count one worker process that ended."""
    WORKER_EXITS.labels(state=exit_state(exitcode, stopped)).inc()


def observe_rendezvous(seconds: float, round_: int) -> None:
    """Record one completed rendezvous."""
    RENDEZVOUS_DURATION.observe(seconds)
    RENDEZVOUS_LAST.set(seconds)
    RENDEZVOUS_ROUND.set(round_)


def set_worker_pids(pids: Mapping[int, int]) -> None:
    """The workers of the round just started ({global rank: pid}): the next scrapes read their
    memory and CPU, and serve the workers' files for their ranks only (an empty mapping: for
    every rank)."""
    global _round_ranks
    with _pids_lock:
        _worker_pids.clear()
        _worker_pids.update(pids)
        _job_pids.update(pids.values())
        _round_ranks = frozenset(str(rank) for rank in pids) or None


def set_dump_dir(path: Optional[str]) -> None:
    """Where this job's workers write collective watchdog dumps (SHOAL_DUMP_DIR)."""
    global _dump_dir
    _dump_dir = path


def count_dumps() -> int:
    """Watchdog dumps in the dump folder written by any worker this agent started."""
    if not _dump_dir:
        return 0
    with _pids_lock:
        pids = set(_job_pids)
    try:
        names = os.listdir(_dump_dir)
    except OSError:
        return 0
    return sum(1 for name in names
               if (m := _DUMP_NAME.fullmatch(name)) and int(m.group(1)) in pids)


def forget_worker(rank: int, pid: int) -> None:
    """Stop reporting a worker that ended."""
    with _pids_lock:
        if _worker_pids.get(rank) == pid:
            del _worker_pids[rank]


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def read_proc(pid: int) -> Optional[tuple[float, int]]:
    """(CPU seconds, resident bytes) of `pid` from /proc; None once it is gone (or off Linux).

    CPU is user + system time of the process itself (fields 14 and 15 of /proc/PID/stat, after
    the parenthesised command name, which may contain spaces); children it did not wait for
    are not included.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open(f"/proc/{pid}/statm", "rb") as f:
            statm = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    cpu = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return cpu, int(statm.split()[1]) * _PAGE_SIZE


def _worker_families() -> list:
    memory = Metric("shoal_worker_resident_memory_bytes",
                    "Resident memory of each of this node's worker processes (from /proc).",
                    "gauge")
    cpu = Metric("shoal_worker_cpu_seconds",
                 "CPU time (user + system) each of this node's worker processes used (from "
                 "/proc; restarts from 0 with the process).", "counter")
    with _pids_lock:
        pids = dict(_worker_pids)
    for rank, pid in sorted(pids.items()):
        reading = read_proc(pid)
        if reading is None:
            continue
        labels = {"rank": str(rank)}
        cpu.add_sample("shoal_worker_cpu_seconds_total", labels, reading[0])
        memory.add_sample("shoal_worker_resident_memory_bytes", labels, reading[1])
    dumps = Metric("shoal_elastic_dumps", "Collective watchdog dumps (SHOAL_DUMP_DIR) written "
                   "by the workers this agent started.", "gauge")
    dumps.add_sample("shoal_elastic_dumps", {}, count_dumps())
    return [memory, cpu, dumps]


def _with_run_id(family, run_id: str):
    """`family` with run_id=`run_id` on every sample (a label it already has is kept)."""
    out = Metric(family.name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        labels = sample.labels if "run_id" in sample.labels else {**sample.labels,
                                                                    "run_id": run_id}
        out.samples.append(sample._replace(labels=labels))
    return out


def _only_ranks(family, ranks: frozenset):
    """`family` without the samples of a rank outside `ranks` (samples without a rank stay)."""
    out = Metric(family.name, family.documentation, family.type, family.unit)
    out.samples.extend(s for s in family.samples
                       if "rank" not in s.labels or s.labels["rank"] in ranks)
    return out


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
        run_id = _run_id
        for family in self._families():
            yield family if run_id is None else _with_run_id(family, run_id)

    def _families(self) -> Iterable:
        names = set()
        ranks = _round_ranks
        if self._dir and os.path.isdir(self._dir):
            workers = CollectorRegistry()
            multiprocess.MultiProcessCollector(workers, path=self._dir)
            for family in workers.collect():
                names.add(family.name)
                yield family if ranks is None else _only_ranks(family, ranks)
        for family in prometheus_client.REGISTRY.collect():
            if family.name not in names:
                yield family
        yield from _worker_families()


DEFAULT_LINGER_S = settings.METRICS_LINGER_S.default
WEB_CONFIG_ENV = settings.METRICS_WEB_CONFIG.name
_TLS_KEYS = {"cert_file", "key_file", "client_ca_file", "client_auth_type"}
_CLIENT_AUTH_TYPES = ("NoClientCert", "RequireAndVerifyClientCert")


class WebConfigError(ValueError):
    """A metrics web config that cannot be used (the message names the file and the key)."""


@dataclasses.dataclass
class WebConfig:
    """TLS and basic auth for /metrics, in Prometheus' exporter web config format (the file
    node_exporter and others take with --web.config.file): `tls_server_config` (cert_file,
    key_file, optional client_ca_file and client_auth_type) and `basic_auth_users` (name:
    bcrypt hash). Relative file names are taken from the config's own folder."""

    ssl_context: Optional[ssl.SSLContext]
    users: dict

    @classmethod
    def load(cls, path: str) -> "WebConfig":
        """Read and check `path`.

        Raises:
            WebConfigError: unreadable, unknown keys, missing files, or basic auth without the
                bcrypt package.
        """
        def fail(why: str) -> "WebConfigError":
            return WebConfigError(f"Metrics web config {path}: {why}")

        try:
            import yaml  # noqa: PLC0415  (optional dependency, only for a web config)
        except ImportError as exc:
            raise fail("reading it needs the PyYAML package (pip install pyyaml)") from exc

        try:
            with open(path) as f:
                doc = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise fail(f"cannot be read: {exc}") from exc
        if not isinstance(doc, dict):
            raise fail("must be a mapping")
        unknown = sorted(set(doc) - {"tls_server_config", "basic_auth_users"})
        if unknown:
            raise fail(f"unknown key(s) {unknown}; shoal reads tls_server_config and "
                       "basic_auth_users")
        base = os.path.dirname(os.path.abspath(path))
        tls = doc.get("tls_server_config")
        context = None
        if tls:
            extra = sorted(set(tls) - _TLS_KEYS)
            if extra:
                raise fail(f"tls_server_config: unsupported key(s) {extra}")
            if "cert_file" not in tls or "key_file" not in tls:
                raise fail("tls_server_config needs cert_file and key_file")
            files = {k: os.path.join(base, tls[k]) for k in ("cert_file", "key_file",
                                                             "client_ca_file") if k in tls}
            auth = tls.get("client_auth_type",
                           "RequireAndVerifyClientCert" if "client_ca_file" in tls
                           else "NoClientCert")
            if auth not in _CLIENT_AUTH_TYPES:
                raise fail(f"client_auth_type {auth!r} is not one of {list(_CLIENT_AUTH_TYPES)}")
            if auth == "RequireAndVerifyClientCert" and "client_ca_file" not in files:
                raise fail("client_auth_type RequireAndVerifyClientCert needs client_ca_file")
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                context.load_cert_chain(files["cert_file"], files["key_file"])
                if auth == "RequireAndVerifyClientCert":
                    context.load_verify_locations(files["client_ca_file"])
                    context.verify_mode = ssl.CERT_REQUIRED
            except (OSError, ssl.SSLError) as exc:
                raise fail(f"tls_server_config: {exc}") from exc
        users = doc.get("basic_auth_users") or {}
        if users:
            try:
                import bcrypt  # noqa: F401, PLC0415  (optional: checked here, used by _basic_auth)
            except ImportError as exc:
                raise fail("basic_auth_users needs the bcrypt package (pip install bcrypt)") \
                    from exc
        return cls(context, {str(k): str(v) for k, v in users.items()})


def _basic_auth(app, users: dict):
    """`app` behind HTTP basic auth; a checked password is remembered (as a SHA-256) so that
    bcrypt's deliberate slowness is paid once per credential, not per scrape."""
    import bcrypt  # noqa: PLC0415  (optional dependency, only for basic auth)

    good: set = set()

    def guarded(environ, start_response):
        header = environ.get("HTTP_AUTHORIZATION", "")
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "basic":
            try:
                name, _, password = base64.b64decode(value, validate=True).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                name, password = "", ""
            digest = hashlib.sha256(f"{name}\0{password}".encode()).digest()
            if digest in good:
                return app(environ, start_response)
            hashed = users.get(name)
            if hashed is not None and bcrypt.checkpw(password.encode(), hashed.encode()):
                good.add(digest)
                return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                            ("WWW-Authenticate", 'Basic realm="shoal metrics"')])
        return [b"Unauthorized.\n"]
    return guarded


class _ScrapeClock:
    """When the last scrapes came, so stop() can wait for the next one."""

    def __init__(self):
        self._cond = threading.Condition()
        self._times: list[float] = []

    def wrap(self, app):
        def counted(environ, start_response):
            body = app(environ, start_response)
            with self._cond:
                self._times = (self._times + [time.monotonic()])[-2:]
                self._cond.notify_all()
            return body
        return counted

    def wait_for_next(self, limit: float) -> None:
        with self._cond:
            if len(self._times) < 2 or limit <= 0:
                return
            interval = self._times[-1] - self._times[-2]
            seen = self._times[-1]
            deadline = time.monotonic() + min(limit, 1.5 * interval + 0.5)
            while self._times[-1] == seen:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)


class MetricsServer:
    """Serve /metrics for this agent and its workers on `host:port` (port 0: any free one).

    `web_config` (default: the file named by SHOAL_METRICS_WEB_CONFIG) adds TLS, client
    certificates and basic auth, in Prometheus' exporter web config format (see WebConfig).

    The exposition is prometheus_client's; the HTTP server around it is `HardenedHTTPServer`
    (read/write timeouts, a cap on open connections, an accept loop that survives running out
    of file descriptors). `server_options` passes its limits (tests shorten them).

    Raises:
        OSError: the port cannot be bound.
        WebConfigError: the web config cannot be used.
    """

    def __init__(self, host: str, port: int, multiproc_dir: Optional[str],
                 web_config: Optional[str] = None, **server_options):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_AgentAndWorkers(multiproc_dir))
        self._scrapes = _ScrapeClock()
        app = self._scrapes.wrap(prometheus_client.make_wsgi_app(registry))
        web_config = web_config or settings.METRICS_WEB_CONFIG.get()
        web = WebConfig.load(web_config) if web_config else WebConfig(None, {})
        if web.users:
            app = _basic_auth(app, web.users)
        self._httpd = HardenedHTTPServer(host, port, app, ssl_context=web.ssl_context,
                                         **server_options)
        self.scheme = "https" if web.ssl_context is not None else "http"
        self.host = host
        self.port = self._httpd.port

    @property
    def url(self) -> str:
        """The scrape URL."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}/metrics"

    def stop(self, linger: Optional[float] = None) -> None:
        """Stop serving and release the port, after one more scrape if one is due soon.

        A job's last state (workers succeeded or failed, the final restart) would otherwise
        never reach Prometheus when the agent exits between two scrapes. If this server was
        scraped at a steady interval, it serves until the next scrape has been answered, at most
        1.5 intervals and never more than `linger` seconds (default SHOAL_METRICS_LINGER_S, 30);
        never scraped or scraped once: it stops at once.
        """
        if linger is None:
            linger = settings.METRICS_LINGER_S.get()
        self._scrapes.wait_for_next(linger)
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

