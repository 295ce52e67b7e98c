"""`shoal run` on this node once its flags are parsed, phase by phase: check every layer's
settings, the job's secret, the workers' environment, the job's directories, the metrics
endpoint, the rendezvous (hosting its store here where this node should), then the agent.

This module imports prometheus_client (through the agent and the metrics server), which reads
PROMETHEUS_MULTIPROC_DIR once, when first imported: `cli.run` takes that variable out of the
environment before importing this module, so the agent's own metrics stay in its registry.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
from typing import Optional

from shoal.collectives import settings as collectives_settings
from shoal.core import settings as core_settings
from shoal.core.auth import is_loopback
from shoal.core.errors import ShoalError
from shoal.elastic.agent.agent import Agent, AgentResult, WorkerSpec, default_node_id
from shoal.elastic.agent.env import node_env, python_argv
from shoal.elastic.agent.spec import DEFAULT_EXIT_BARRIER_TIMEOUT_S
from shoal.elastic.agent.store_host import announce_host
from shoal.elastic import settings as elastic_settings
from shoal.elastic.errors import (
    ERROR_FILE_ENV,
    TERMINATION_MESSAGE_LIMIT,
    error_document,
    read_error_file,
    write_error_file,
)
from shoal.elastic.metrics import MetricsServer, WebConfigError
from shoal.launcher import (
    flags,
    job_dirs,
    profile_notice,
    rendezvous_setup,
    secret,
    settings,
    virtual_local_rank,
)
from shoal.launcher.console import configure_logging
from shoal.launcher.streams import route

logger = logging.getLogger("shoal.run")

# Set for the agent's own process only: the agent forks workers while the etcd client's gRPC
# threads run, and gRPC's fork handlers are of no use before an exec (they only log a warning
# per fork). Workers keep the user's setting, or none.
_GRPC_FORK = "GRPC_ENABLE_FORK_SUPPORT"


class LaunchError(Exception):
    """A phase of `shoal run` cannot go on: `message` goes to stderr, `status` is the exit."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.message = message
        self.status = status


def run(run_settings: flags.RunSettings, metrics_parent: Optional[str]) -> int:
    """Run this node's part of the job; returns the exit status. `metrics_parent` is the
    PROMETHEUS_MULTIPROC_DIR `shoal run` was started with (the workers' files go below it)."""
    settings.check_or_exit(flags.run_parser())
    local_addr = rendezvous_setup.local_addr(run_settings)
    configure_logging()
    for notice in run_settings.notices:
        logger.warning("%s", notice)
    try:
        with contextlib.ExitStack() as cleanup:
            return _run(run_settings, local_addr, metrics_parent, cleanup)
    except LaunchError as exc:
        sys.stderr.write(exc.message + "\n")
        return exc.status


def _run(run_settings: flags.RunSettings, local_addr: str, metrics_parent: Optional[str],
         cleanup: contextlib.ExitStack) -> int:
    scratch = job_dirs.scratch_dir()
    if scratch is None:
        raise LaunchError(f"shoal run: error: {job_dirs.no_scratch_message()}", 2)
    token = secret.run_token(run_settings)
    # Stores this process opens (the embedded one, the workers' master store) use it too.
    os.environ[core_settings.AUTH_TOKEN.name] = token
    base_env = _worker_base_env(run_settings)
    dirs = _make_dirs(run_settings, metrics_parent,
                      collectives_settings.DUMP_DIR.get() or scratch)
    ended: list[AgentResult] = []
    # A failed job keeps its error files (evidence); a job that never ran or succeeded does not.
    cleanup.callback(lambda: dirs.remove(keep_errors=bool(ended) and ended[0].exit_code != 0))
    metrics_server = _start_metrics(run_settings, dirs.multiproc_dir)
    if metrics_server is not None:
        cleanup.callback(metrics_server.stop)
    node_id = default_node_id(run_settings.node_rank)
    handler, hosted = _open_rendezvous(run_settings, node_id)
    cleanup.callback(_close_rendezvous, handler)
    logger.info("Watchdog dumps of this node's workers go to %s (%s)", dirs.dump_dir,
                collectives_settings.DUMP_DIR.name)
    spec = _worker_spec(run_settings, token=token, local_addr=local_addr, dirs=dirs,
                        base_env=base_env)
    profiled_since = profile_notice.announce(run_settings.profile_dir)
    result = _run_agent(run_settings, spec, handler, hosted)
    ended.append(result)
    if result.exit_code == 0:
        profile_notice.report_missing(run_settings.profile_dir, profiled_since)
    if result.summary:
        sys.stderr.write(result.summary + "\n")
        sys.stderr.flush()
    write_agent_error_file(result)
    return result.exit_code


def _worker_base_env(run_settings: flags.RunSettings) -> dict[str, str]:
    """The environment every worker starts from (elastic.agent.env builds it)."""
    agent_only = ()
    if _GRPC_FORK not in os.environ:
        os.environ[_GRPC_FORK] = "false"
        agent_only = (_GRPC_FORK,)
    return node_env(os.environ, nproc_per_node=run_settings.nproc_per_node,
                    collective_timeout=run_settings.collective_timeout,
                    profile_dir=run_settings.profile_dir, agent_only=agent_only)


def _make_dirs(run_settings: flags.RunSettings, metrics_parent: Optional[str],
               dump_dir: str) -> job_dirs.JobDirs:
    try:
        return job_dirs.make_job_dirs(run_settings, metrics_parent=metrics_parent,
                                      dump_dir=dump_dir)
    except OSError as exc:
        raise LaunchError(
            f"shoal run: error: cannot create the job's directories: {exc}. Give writable "
            f"--checkpoint-dir/--log-dir, {collectives_settings.DUMP_DIR.name} and TMPDIR (on "
            "a read-only root filesystem: an emptyDir at /tmp).", 2) from exc


def _start_metrics(run_settings: flags.RunSettings,
                   multiproc_dir: str) -> Optional[MetricsServer]:
    """The agent's /metrics for itself and its workers, when --metrics-port asks for it."""
    if run_settings.metrics_port is None:
        return None
    try:
        server = MetricsServer(run_settings.metrics_host, run_settings.metrics_port,
                               multiproc_dir)
    except WebConfigError as exc:
        raise LaunchError(f"shoal run: error: {exc}", 2) from exc
    except OSError as exc:
        raise LaunchError(metrics_port_message(run_settings, exc), 2) from exc
    logger.info("Metrics of this node's agent and workers at %s", server.url)
    web_config = elastic_settings.METRICS_WEB_CONFIG
    if not is_loopback(run_settings.metrics_host) and web_config.get() is None:
        logger.warning(
            "The metrics endpoint %s is served on %s without TLS or authentication: anyone "
            "who can reach this machine on the network can read the job's metrics (run id, "
            "hosts, ranks, losses). Set %s to a web config file (TLS, basic auth) or bind "
            "--metrics-host 127.0.0.1 behind a scraper on this machine.", server.url,
            run_settings.metrics_host or "every interface", web_config.name)
    return server


def metrics_port_message(run_settings: flags.RunSettings, exc: OSError) -> str:
    """One sentence instead of a traceback when the metrics port cannot be bound."""
    where = f"{run_settings.metrics_host}:{run_settings.metrics_port}"
    if exc.errno == errno.EADDRINUSE:
        why = "is already in use; choose another port, or 0 for any free one"
    elif exc.errno == errno.EADDRNOTAVAIL:
        why = "is not an address of this machine; check --metrics-host"
    else:
        why = f"cannot be served ({exc.strerror or exc})"
    return f"shoal run: error: argument --metrics-port/--metrics_port: {where} {why}."


def _open_rendezvous(run_settings: flags.RunSettings, node_id: str):
    """This node's rendezvous handler, and whether this process hosts its store."""
    try:
        handler, hosted = rendezvous_setup.make_handler(run_settings, node_id)
    except (ShoalError, OSError, ValueError) as exc:
        # StoreError (an unreachable store endpoint) is a ShoalError like RendezvousError.
        where = rendezvous_setup.describe_endpoints(run_settings) or "an embedded store"
        raise LaunchError(f"shoal run: cannot reach the {run_settings.rdzv_backend} rendezvous "
                          f"at {where}: {exc}", 1) from exc
    if hosted:
        announce_host(handler.store, node_id)
        logger.info("Rendezvous store listening on %s:%s (run id %s)",
                    handler.store.host, handler.store.port, run_settings.rdzv_id)
    backend_name = run_settings.rdzv_backend
    if run_settings.requested_backend != backend_name:
        backend_name = f"{run_settings.requested_backend} ({backend_name})"
    logger.info("Node %s joins run %s (%s backend, nodes %d:%d, %d worker(s) here)",
                node_id, run_settings.rdzv_id, backend_name, run_settings.min_nodes,
                run_settings.max_nodes, run_settings.nproc_per_node)
    return handler, hosted


def _close_rendezvous(handler) -> None:
    handler.shutdown()  # a no-op after the agent's own shutdown
    for resource in (handler.backend, handler.store):
        try:
            resource.close()
        except Exception as exc:  # noqa: BLE001  (closing must not mask the outcome)
            logger.debug("Closing %r failed: %s", resource, exc)


def _worker_spec(run_settings: flags.RunSettings, *, token: str, local_addr: str,
                 dirs: job_dirs.JobDirs, base_env: dict[str, str]) -> WorkerSpec:
    s = run_settings
    routes = tuple(route(local, redirects=s.redirects, tee=s.tee, log_dir=dirs.log_dir,
                         ranks_filter=s.local_ranks_filter)
                   for local in range(s.nproc_per_node))
    return WorkerSpec(
        argv=worker_argv(s), nproc_per_node=s.nproc_per_node, run_id=s.rdzv_id,
        checkpoint_dir=dirs.checkpoint_dir, auth_token=token, local_addr=local_addr,
        max_restarts=s.max_restarts, monitor_interval=s.monitor_interval,
        grace_period=s.grace_period, log_dir=dirs.log_dir, tee=True,
        multiproc_dir=dirs.multiproc_dir, base_env=base_env,
        exit_barrier_timeout=float(s.rdzv_conf.get("exit_barrier_timeout",
                                                   DEFAULT_EXIT_BARRIER_TIMEOUT_S)),
        signals=tuple(s.signals), routes=routes, role=s.role, error_dir=dirs.error_dir,
        dump_dir=dirs.dump_dir,
    )


def _run_agent(run_settings: flags.RunSettings, spec: WorkerSpec, handler,
               hosted: bool) -> AgentResult:
    agent = Agent(spec, handler, is_store_host=hosted)
    host_watch = rendezvous_setup.watch_store_host(run_settings, handler, agent, hosted)
    restore = agent.install_signal_handlers()
    try:
        return agent.run()
    finally:
        restore()
        if host_watch is not None:
            host_watch.stop()


def worker_argv(run_settings: flags.RunSettings) -> tuple[str, ...]:
    """The worker command line, as torchrun builds it (--run-path beats --no-python)."""
    s = run_settings
    python = os.environ.get("PYTHON_EXEC") or sys.executable  # torchrun's override
    if s.run_path:
        argv = (python, "-u", "-m", "shoal.launcher.run_path", os.path.abspath(s.script),
                *s.script_args)
    elif s.no_python:
        argv = (s.script, *s.script_args)
    else:
        argv = (python,) + python_argv(s.script, s.script_args, s.module)[1:]
    if s.virtual_local_rank:
        # It picks the worker's device, then execs the worker in its place (same pid).
        argv = (sys.executable, "-I", os.path.abspath(virtual_local_rank.__file__), *argv)
    return argv


def write_agent_error_file(result: AgentResult) -> None:
    """torchrun's contract: on failure, the root cause goes to the agent's own
    TORCHELASTIC_ERROR_FILE (e.g. /dev/termination-log for a Kubernetes pod)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or result.exit_code == 0:
        return
    failure = result.failure or {}
    # The worker's own error file: its exception (@record), or what the agent wrote for a
    # worker that died without one (the rank and its signal or exit code).
    worker = (read_error_file(failure.get("error_file")) or {}).get("message", {})
    message = (failure.get("error") or worker.get("message") or result.summary
               or f"shoal run exited {result.exit_code}")
    callstack = failure.get("traceback") or "\n".join(failure.get("tail") or [])
    extra = {k: failure[k] for k in ("round", "rank", "local_rank", "node", "pid", "exitcode",
                                     "exit", "log_path", "error_file", "hang", "culprits",
                                     "detected_by", "dump_path")
             if k in failure}
    doc = error_document(message, callstack, dict(extra, summary=result.summary or ""))
    try:
        write_error_file(path, doc, limit=TERMINATION_MESSAGE_LIMIT
                         if path.startswith("/dev/") else None)
    except OSError as exc:
        logger.warning("Cannot write the error file %s (TORCHELASTIC_ERROR_FILE): %s", path, exc)
