"""`shoal run` (an elastic job's node agent) and `shoal store` (a standalone TCPStore).

Heavy imports (prometheus_client, the agent, the stores, the etcd client) happen inside the
commands, so that `shoal --help` is quick and PROMETHEUS_MULTIPROC_DIR can be taken out of this
process's environment before prometheus_client reads it. The flags import only the
rendezvous' rules (elastic.api and the registry, which loads each backend when it is built);
elastic.errors and virtual_local_rank need only the standard library and load at once.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from typing import Optional, Sequence

from shoal.elastic.errors import (
    TERMINATION_MESSAGE_LIMIT,
    error_document,
    read_error_file,
    write_error_file,
)
from shoal.launcher import flags, virtual_local_rank

logger = logging.getLogger("shoal.run")

USAGE = """usage: shoal {run,store,--version} ...

  shoal run [flags] SCRIPT [ARGS...]   run an elastic job's workers on this node
  shoal store [--host H] [--port P]     serve a standalone TCPStore for rendezvous
  shoal trace {merge,summary,plot} DIR  the job view of `shoal run --profile DIR` traces
  shoal top [HOST:PORT|URL]             a live per-rank view of an agent's /metrics

`shoal run --help` lists every flag; each also reads SHOAL_<FLAG>."""

# Where the launcher's own log lines go, and their prefix.
_LOG_FORMAT = "[shoal] %(asctime)s.%(msecs)03d %(levelname)s %(message)s"


def _configure_logging() -> None:
    """The launcher's and agent's own news at INFO, other layers' at WARNING, unless
    SHOAL_LOG_LEVEL sets one level for everything."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_LOG_FORMAT, datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    level = os.environ.get("SHOAL_LOG_LEVEL", "").strip().upper()
    if level:
        try:
            root.setLevel(level)
            return
        except ValueError:
            logger.warning("SHOAL_LOG_LEVEL=%r is not a logging level; using the defaults", level)
    root.setLevel(logging.WARNING)
    for name in ("shoal", "elastic"):
        logging.getLogger(name).setLevel(logging.INFO)


def _usage_error(message: str) -> int:
    sys.stderr.write(f"{USAGE}\nshoal: error: {message}\n")
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the `shoal` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        return _usage_error("name a command: run or store")
    command, rest = argv[0], argv[1:]
    if command in ("-h", "--help", "help"):
        sys.stdout.write(USAGE + "\n")
        return 0
    if command in ("-V", "--version", "version"):
        from shoal import __version__

        sys.stdout.write(f"shoal {__version__}\n")
        return 0
    if command == "run":
        return run(rest)
    if command == "store":
        return store(rest)
    if command == "trace":  # the profiler's job view (launcher/trace/)
        from shoal.launcher.trace.cli import main as trace_main

        return trace_main(rest)
    if command == "top":  # a terminal view of an agent's /metrics (launcher/top.py)
        from shoal.launcher.top import main as top_main

        return top_main(rest)
    return _usage_error(f"unknown command {command!r}; choose run or store")


# ----------------------------------------------------------------------------- shoal run

def _auth_token(settings: flags.RunSettings) -> str:
    """The job's secret: --auth-token-file, else SHOAL_AUTH_TOKEN, else a fresh one."""
    if settings.auth_token_file is not None:
        with open(settings.auth_token_file, "rb") as f:
            token = f.read().strip()
        if not token:
            flags.run_parser().error(
                f"argument --auth-token-file/--auth_token_file: {settings.auth_token_file!r} "
                "is empty; put the job's secret in it"
            )
        return token.decode("utf-8", errors="surrogateescape")
    if os.environ.get("SHOAL_AUTH_TOKEN"):
        return os.environ["SHOAL_AUTH_TOKEN"]
    if settings.max_nodes > 1:
        flags.run_parser().error(
            "argument --auth-token-file/--auth_token_file: a job of several nodes needs one "
            "shared secret; give --auth-token-file or set SHOAL_AUTH_TOKEN on every node"
        )
    from shoal.core.auth import generate_token

    return generate_token()


def _local_addr(settings: flags.RunSettings) -> str:
    """Where the other nodes reach this node (its master store, its workers' ports).

    Default: loopback for a rendezvous on this machine, else the local address that routes to
    the rendezvous endpoint, never the hostname's /etc/hosts entry (127.0.1.1 on Debian).
    """
    from shoal.core.auth import is_loopback
    from shoal.core.netaddr import address_towards, is_local_address

    if settings.local_addr:
        if not is_local_address(settings.local_addr):
            flags.run_parser().error(
                f"argument --local-addr/--local_addr: {settings.local_addr!r} is not an address "
                "of this host; give one of its own addresses (see `ip addr`), or leave it out "
                "to use the one that routes to the rendezvous endpoint"
            )
        return settings.local_addr
    if not settings.rdzv_endpoints or all(is_loopback(h) for h, _ in settings.rdzv_endpoints):
        return "127.0.0.1"
    for host, _ in settings.rdzv_endpoints:
        address = address_towards(host)
        if address is not None:
            return address
    where = ",".join(f"{h}:{p}" for h, p in settings.rdzv_endpoints)
    flags.run_parser().error(
        f"argument --local-addr/--local_addr: no local address routes to the rendezvous "
        f"endpoint {where}; give --local-addr"
    )


def _make_handler(settings: flags.RunSettings, node_id: str):
    """This node's rendezvous handler and whether this process hosts the store; every value
    was checked by flags.parse_run."""
    from shoal.elastic.rendezvous import RendezvousHandler, create_backend

    timeout = float(settings.rdzv_conf.get("store_timeout", flags.DEFAULT_STORE_TIMEOUT_S))
    if settings.embedded_store and not settings.rdzv_endpoints:
        endpoint = "127.0.0.1:0"
    else:
        endpoint = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}"
                            for h, p in settings.rdzv_endpoints)
    kwargs = dict(settings.backend_options, timeout=timeout)
    hosted = settings.rdzv_backend == "store" and settings.embedded_store
    if settings.rdzv_backend == "store":
        kwargs["is_host"] = hosted
    if settings.try_host and not hosted:
        # torchrun's c10d: the endpoint names this machine, so host the store there; if another
        # agent on this machine already does, its port is taken and we are its client.
        try:
            backend, store = create_backend("store", endpoint, settings.rdzv_id,
                                            **dict(kwargs, is_host=True))
            hosted = True
        except OSError as exc:
            logger.info("The store at %s is hosted by another process (%s); joining it as a "
                        "client", endpoint, exc)
            backend, store = create_backend("store", endpoint, settings.rdzv_id, **kwargs)
    else:
        if hosted and settings.requested_backend == "static":
            endpoint = _static_bind(settings.rdzv_endpoints[0])
        backend, store = create_backend(settings.rdzv_backend, endpoint, settings.rdzv_id,
                                        **kwargs)
    # Not owned: the agent leaves the rendezvous first, then tells the store's host it is done,
    # and only then are the backend and store closed (see `run`).
    handler = RendezvousHandler(backend, settings.rendezvous, node_id, store, owns=False,
                                backend_timeout=timeout)
    return handler, hosted


def _static_bind(master: tuple[str, int]) -> str:
    """Where node rank 0 of a static rendezvous listens: the master address when it is one of
    this host's, else every interface, as torchrun's store does. Under Kubeflow the master
    address is the name of a Service, which may not resolve yet in its own pod; the store
    still admits only peers that prove the job's secret."""
    from shoal.core.netaddr import is_local_address

    host, port = master
    if is_local_address(host):
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    logger.info("The master address %s is not this host's (yet): the store listens on every "
                "interface, port %d", host, port)
    return f"0.0.0.0:{port}"


def _watch_store_host(settings: flags.RunSettings, handler, agent, hosted: bool):
    """On a node that uses another node's embedded store, end the agent within seconds of
    that node dying (see elastic.store_host); None where there is nothing to watch."""
    if settings.rdzv_backend != "store" or hosted:
        return None
    from shoal.collectives.types import StoreError
    from shoal.collectives.store.tcp import TCPStore
    from shoal.elastic.agent.store_host import StoreHostWatch

    rdzv = handler.settings
    lost_after = rdzv.heartbeat_timeout
    try:
        # A connection of its own with a short timeout: a probe stuck on a hung host must
        # fail well within lost_after, and must not queue behind the agent's own calls.
        probe = TCPStore(handler.store.host, handler.store.port, is_master=False,
                         timeout=max(0.5, lost_after / 3))
    except (StoreError, OSError) as exc:
        logger.warning("Cannot watch the rendezvous store at %s: %s", handler.store.address, exc)
        return None

    def on_lost(error) -> None:
        handler.abort(error)
        agent.store_host_lost(error)

    return StoreHostWatch(probe, handler.store.address, interval=rdzv.heartbeat_interval,
                          lost_after=lost_after, on_lost=on_lost).start()


def _metrics_port_error(settings: flags.RunSettings, exc: OSError) -> int:
    """One sentence instead of a traceback when the metrics port cannot be bound (status 2)."""
    import errno

    where = f"{settings.metrics_host}:{settings.metrics_port}"
    if exc.errno == errno.EADDRINUSE:
        why = "is already in use; choose another port, or 0 for any free one"
    elif exc.errno == errno.EADDRNOTAVAIL:
        why = "is not an address of this machine; check --metrics-host"
    else:
        why = f"cannot be served ({exc.strerror or exc})"
    sys.stderr.write(f"shoal run: error: argument --metrics-port/--metrics_port: {where} {why}.\n")
    return 2


def _scratch_dir() -> Optional[str]:
    """The temporary directory the agent may write (tempfile's choice: TMPDIR, /tmp, ...), or
    None when there is none, as on a read-only root filesystem without an emptyDir at /tmp."""
    try:
        return tempfile.gettempdir()
    except FileNotFoundError:
        return None


def _no_scratch_error() -> int:
    candidates = ", ".join(tempfile._candidate_tempdir_list())  # noqa: SLF001  (for the message)
    sys.stderr.write(
        "shoal run: error: no writable temporary directory (tried " + candidates + "). "
        "The root filesystem is probably read-only: mount a writable volume (a Kubernetes "
        "emptyDir) at /tmp, or point TMPDIR at a writable directory.\n")
    return 2


def _worker_argv(settings: flags.RunSettings) -> tuple[str, ...]:
    """The worker command line, as torchrun builds it (--run-path beats --no-python)."""
    from shoal.elastic.agent.agent import python_argv

    python = os.environ.get("PYTHON_EXEC") or sys.executable  # torchrun's override
    if settings.run_path:
        argv = (python, "-u", "-m", "shoal.launcher.run_path",
                os.path.abspath(settings.script), *settings.script_args)
    elif settings.no_python:
        argv = (settings.script, *settings.script_args)
    else:
        argv = (python,) + python_argv(settings.script, settings.script_args,
                                       settings.module)[1:]
    if settings.virtual_local_rank:
        # It picks the worker's device, then execs the worker in its place (same pid).
        argv = (sys.executable, "-I", os.path.abspath(virtual_local_rank.__file__), *argv)
    return argv


def _omp_notice(settings: flags.RunSettings, worker_env: dict) -> None:
    """torchrun's rule: several workers per node and no OMP_NUM_THREADS -> 1 per worker."""
    if "OMP_NUM_THREADS" in os.environ or settings.nproc_per_node <= 1:
        return
    worker_env["OMP_NUM_THREADS"] = "1"
    logger.warning("Setting OMP_NUM_THREADS=1 for each of the %d workers on this node, so they "
                   "do not overload it; set OMP_NUM_THREADS yourself to tune it",
                   settings.nproc_per_node)


def _write_agent_error_file(result) -> None:
    """torchrun's contract: on failure, the root cause goes to the agent's own
    TORCHELASTIC_ERROR_FILE (e.g. /dev/termination-log for a Kubernetes pod)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
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


def run(argv: Sequence[str]) -> int:
    """`shoal run`: parse, set up the rendezvous, metrics and directories, run the agent."""
    settings = flags.parse_run(argv)
    local_addr = _local_addr(settings)
    _configure_logging()
    for notice in settings.notices:
        logger.warning("%s", notice)
    scratch = _scratch_dir()
    if scratch is None:
        return _no_scratch_error()
    token = _auth_token(settings)
    # Stores this process opens (the embedded one, the workers' master store) use it too.
    os.environ["SHOAL_AUTH_TOKEN"] = token
    # The agent's own metrics live in its registry; only its workers write multiprocess files.
    metrics_parent = os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    # The agent forks workers while the etcd client's gRPC threads run; gRPC's fork handlers
    # are of no use before an exec and only log a warning per fork.
    grpc_fork_default = "GRPC_ENABLE_FORK_SUPPORT" not in os.environ
    if grpc_fork_default:
        os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"
    worker_env = dict(os.environ)
    if grpc_fork_default:
        worker_env.pop("GRPC_ENABLE_FORK_SUPPORT")
    # The agent's error file is the agent's; each worker gets its own (see elastic.errors).
    worker_env.pop("TORCHELASTIC_ERROR_FILE", None)
    if settings.collective_timeout is not None:
        # init_process_group reads it as its default timeout (collectives.env).
        worker_env["SHOAL_COLLECTIVE_TIMEOUT"] = repr(settings.collective_timeout)
    _omp_notice(settings, worker_env)
    if settings.profile_dir:  # every worker's job profiler (core/profiler/job.py)
        worker_env["SHOAL_PROFILE_DIR"] = os.path.abspath(settings.profile_dir)

    from shoal.elastic.agent.agent import (
        DEFAULT_EXIT_BARRIER_TIMEOUT_S,
        Agent,
        WorkerSpec,
        default_node_id,
    )
    from shoal.core.errors import ShoalError
    from shoal.launcher.streams import route

    cleanup: list[str] = []
    keep_on_failure: list[str] = []
    metrics_server = None
    handler = None
    result = None
    try:
        try:
            if settings.checkpoint_dir is not None:
                checkpoint_dir = os.path.abspath(settings.checkpoint_dir)
                os.makedirs(checkpoint_dir, exist_ok=True)
            else:
                checkpoint_dir = tempfile.mkdtemp(prefix=f"shoal-{settings.rdzv_id}-checkpoints-")
                cleanup.append(checkpoint_dir)
            if metrics_parent:
                os.makedirs(metrics_parent, exist_ok=True)
            multiproc_dir = tempfile.mkdtemp(prefix=f"shoal-{settings.rdzv_id}-metrics-",
                                             dir=metrics_parent or None)
            cleanup.append(multiproc_dir)
            log_dir = os.path.abspath(settings.log_dir) if settings.log_dir else None
            if log_dir is None and (settings.redirects or settings.tee):
                # As torchrun: redirected or teed streams need files; make a directory for them.
                log_dir = tempfile.mkdtemp(prefix=f"shoal-{settings.rdzv_id}-logs-")
                logger.info("Worker logs go to %s (no --log-dir was given)", log_dir)
            error_dir = log_dir or tempfile.mkdtemp(prefix=f"shoal-{settings.rdzv_id}-errors-")
            if error_dir != log_dir:
                keep_on_failure.append(error_dir)
            # The agent writes <dir>/<run id>/round_N/...: a file of that name is refused here,
            # in a sentence, not mid-round with a traceback.
            os.makedirs(os.path.join(error_dir, settings.rdzv_id), exist_ok=True)
            dump_dir = worker_env.get("SHOAL_DUMP_DIR") or scratch
            os.makedirs(dump_dir, exist_ok=True)
            worker_env["SHOAL_DUMP_DIR"] = dump_dir
        except OSError as exc:
            sys.stderr.write(f"shoal run: error: cannot create the job's directories: {exc}. "
                             "Give writable --checkpoint-dir/--log-dir, SHOAL_DUMP_DIR and TMPDIR "
                             "(on a read-only root filesystem: an emptyDir at /tmp).\n")
            return 2
        if settings.metrics_port is not None:
            from shoal.elastic.metrics import MetricsServer, WebConfigError

            try:
                metrics_server = MetricsServer(settings.metrics_host, settings.metrics_port,
                                               multiproc_dir)
            except WebConfigError as exc:
                sys.stderr.write(f"shoal run: error: {exc}\n")
                return 2
            except OSError as exc:
                return _metrics_port_error(settings, exc)
            logger.info("Metrics of this node's agent and workers at %s", metrics_server.url)

        node_id = default_node_id(settings.node_rank)
        try:
            handler, hosted = _make_handler(settings, node_id)
        except (ShoalError, OSError, ValueError) as exc:
            # StoreError (an unreachable store endpoint) is a ShoalError like RendezvousError.
            where = ",".join(f"{h}:{p}" for h, p in settings.rdzv_endpoints) or "an embedded store"
            sys.stderr.write(f"shoal run: cannot reach the {settings.rdzv_backend} rendezvous "
                             f"at {where}: {exc}\n")
            return 1
        if hosted:
            from shoal.elastic.agent.store_host import announce_host

            announce_host(handler.store, node_id)
            logger.info("Rendezvous store listening on %s:%s (run id %s)",
                        handler.store.host, handler.store.port, settings.rdzv_id)
        backend_name = settings.rdzv_backend
        if settings.requested_backend != backend_name:
            backend_name = f"{settings.requested_backend} ({backend_name})"
        logger.info("Node %s joins run %s (%s backend, nodes %d:%d, %d worker(s) here)",
                    node_id, settings.rdzv_id, backend_name, settings.min_nodes,
                    settings.max_nodes, settings.nproc_per_node)
        logger.info("Watchdog dumps of this node's workers go to %s (SHOAL_DUMP_DIR)", dump_dir)

        routes = tuple(route(local, redirects=settings.redirects, tee=settings.tee,
                             log_dir=log_dir, ranks_filter=settings.local_ranks_filter)
                       for local in range(settings.nproc_per_node))
        spec = WorkerSpec(
            argv=_worker_argv(settings),
            nproc_per_node=settings.nproc_per_node, run_id=settings.rdzv_id,
            checkpoint_dir=checkpoint_dir, auth_token=token, local_addr=local_addr,
            max_restarts=settings.max_restarts, monitor_interval=settings.monitor_interval,
            grace_period=settings.grace_period, log_dir=log_dir,
            tee=True, multiproc_dir=multiproc_dir, base_env=worker_env,
            exit_barrier_timeout=float(settings.rdzv_conf.get(
                "exit_barrier_timeout", DEFAULT_EXIT_BARRIER_TIMEOUT_S)),
            signals=tuple(settings.signals), routes=routes, role=settings.role,
            error_dir=error_dir,
        )
        agent = Agent(spec, handler, is_store_host=hosted)
        host_watch = _watch_store_host(settings, handler, agent, hosted)
        restore = agent.install_signal_handlers()
        try:
            result = agent.run()
        finally:
            restore()
            if host_watch is not None:
                host_watch.stop()
        if result.summary:
            sys.stderr.write(result.summary + "\n")
            sys.stderr.flush()
        _write_agent_error_file(result)
        return result.exit_code
    finally:
        if handler is not None:
            handler.shutdown()  # a no-op after the agent's own shutdown
            for resource in (handler.backend, handler.store):
                try:
                    resource.close()
                except Exception as exc:  # noqa: BLE001  (closing must not mask the outcome)
                    logger.debug("Closing %r failed: %s", resource, exc)
        if metrics_server is not None:
            metrics_server.stop()
        if result is None or result.exit_code == 0:
            cleanup += keep_on_failure
        for path in cleanup:
            shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------- shoal store

def store(argv: Sequence[str]) -> int:
    """`shoal store`: serve a TCPStore until SIGTERM/SIGINT; the first line names the port."""
    settings = flags.parse_store(argv)
    _configure_logging()
    if settings.auth_token_file is not None:
        with open(settings.auth_token_file, "rb") as f:
            token = f.read().strip()
    elif os.environ.get("SHOAL_AUTH_TOKEN") or os.environ.get("SHOAL_AUTH_TOKEN_FILE"):
        # The job's secret from either variable, never the development fallback: a standalone
        # store is meant for other machines.
        from shoal.core.auth import load_token

        token = load_token()
    else:
        token = b""
    if not token:
        flags.store_parser().error(
            "argument --auth-token-file/--auth_token_file: the store needs the job's secret; "
            "give --auth-token-file or set SHOAL_AUTH_TOKEN"
        )
    from shoal.collectives.store.tcp import serve_forever

    def announce(server) -> None:
        sys.stdout.write(f"shoal store listening on {server.host}:{server.port}\n")
        sys.stdout.flush()

    try:
        serve_forever(settings.host, settings.port, token=token, on_ready=announce)
    except OSError as exc:
        sys.stderr.write(f"shoal store: cannot serve on {settings.host}:{settings.port}: {exc}\n")
        return 1
    return 0
