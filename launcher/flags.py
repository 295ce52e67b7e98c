"""The flags of `shoal run` and `shoal store`, each backed by a `SHOAL_<FLAG>` variable.

This is the launcher's one module that reads the environment. A flag given on the command line
beats its variable, which beats the default. Every flag accepts both spellings
(`--max-restarts` and `--max_restarts`). A bad value, from either source, ends in argparse's
usage error (exit status 2) with a message that names the flag, and the variable when the value
came from one. The rendezvous' own rules (its settings, the backends, their endpoints and
options) live in elastic; parsing applies them, so a bad value is still a usage error here.
Each value's converter is in `launcher.converters`, the `Flag` type and how a table of them
meets argparse and the variables in `launcher.flag_spec`. torchrun's flags and `PET_<FLAG>`
variables are understood with torchrun's meaning (see `parse_run` and `launcher.torch_conf`,
which holds torchrun's flags that have no counterpart here).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import uuid
from typing import Mapping, Optional, Sequence

from shoal import __version__
from shoal.elastic.api import SETTINGS_CONF_KEYS, RendezvousSettings
from shoal.elastic.rendezvous.registry import BACKENDS, backend_options, check_endpoints
from shoal.launcher.converters import (  # noqa: F401  (DEFAULT_* and RDZV_CONF_KEYS re-exported)
    DEFAULT_GRACE_PERIOD_S,
    DEFAULT_MASTER_PORT,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_MONITOR_INTERVAL_S,
    DEFAULT_NPROC_PER_NODE,
    DEFAULT_SIGNALS,
    DEFAULT_STORE_PORT,
    DEFAULT_STORE_TIMEOUT_S,
    LAUNCHER_CONF_KEYS,
    RDZV_CONF_KEYS,
    TORCHRUN_BACKENDS,
    boolean,
    directory,
    endpoints,
    nnodes,
    nonnegative_seconds,
    nproc,
    port,
    positive_seconds,
    ranks_filter,
    rdzv_backend,
    rdzv_conf,
    readable_file,
    run_id,
    signal_names,
    start_method,
    std_spec,
    text_value,
    _int_at_least,
)
from shoal.launcher import slurm, torch_conf
from shoal.launcher.flag_spec import ENV_PREFIX, CommandParser, Flag, add_flag, apply_env
from shoal.launcher.streams import StdSpec

# ----------------------------------------------------------------------------- flag table

RUN_GROUPS: dict[str, list[Flag]] = {
    "nodes and workers": [
        Flag("nnodes", nnodes, (1, 1), "number of nodes, N or MIN:MAX (default 1)"),
        Flag("nproc-per-node", nproc, DEFAULT_NPROC_PER_NODE,
             "workers per node: an integer, cpu (one per core), gpu (one per CUDA device) or "
             "auto (gpu if any, else cpu) (default 1)"),
        Flag("node-rank", _int_at_least(0), None,
             "this node's rank; 0 hosts the embedded store at --rdzv-endpoint (ranks in the "
             "group are assigned by the rendezvous)"),
        Flag("local-addr", text_value, None,
             "address other nodes reach this node at, one of this host's own (default "
             "127.0.0.1 when the rendezvous is on this machine, else the local address that "
             "routes to the rendezvous endpoint)"),
        Flag("collective-timeout", positive_seconds, None,
             "seconds a worker's process group and its collectives wait before a hang is an "
             "error (the default of init_process_group; default 600)"),
        Flag("master-addr", text_value, None,
             "static rendezvous (torchrun's default backend): the address of node rank 0, "
             "which hosts the store (default 127.0.0.1)"),
        Flag("master-port", port, None,
             f"static rendezvous: the store's port on node rank 0 (default {DEFAULT_MASTER_PORT})"),
        Flag("role", text_value, "default", "the workers' role (ROLE_NAME; default 'default')"),
    ],
    "rendezvous": [
        Flag("rdzv-backend", rdzv_backend, None,
             "; ".join(f"{name}: {kind.summary}" for name, kind in BACKENDS.items())
             + "; torchrun's c10d (a store hosted by the node the endpoint names), static "
             "(node rank 0 hosts it at --master-addr:--master-port) and etcd-v2 (etcd) "
             "(default: static with --master-addr/--master-port, else store)"),
        Flag("rdzv-endpoint", endpoints, (),
             "HOST:PORT[,HOST:PORT...] of etcd or of the store; none: an embedded store here"),
        Flag("rdzv-id", run_id, None,
             "the job's id, shared by its nodes (default: random for an embedded store, "
             "'default' otherwise)"),
        Flag("rdzv-conf", rdzv_conf, {},
             "k=v,... with keys " + ", ".join(sorted(RDZV_CONF_KEYS))),
        Flag("standalone", boolean, False,
             "one node, an embedded store on 127.0.0.1 with a random port and run id",
             switch=True),
    ],
    "restarts": [
        Flag("max-restarts", _int_at_least(0), DEFAULT_MAX_RESTARTS,
             f"restarts allowed for the whole job (default {DEFAULT_MAX_RESTARTS})"),
        Flag("monitor-interval", positive_seconds, DEFAULT_MONITOR_INTERVAL_S,
             f"seconds between checks of the rendezvous (default {DEFAULT_MONITOR_INTERVAL_S})"),
        Flag("grace-period", nonnegative_seconds, DEFAULT_GRACE_PERIOD_S,
             "seconds workers get after SIGTERM before SIGKILL "
             f"(default {DEFAULT_GRACE_PERIOD_S:g})"),
        Flag("shutdown-timeout", nonnegative_seconds, None,
             "torchrun's name for --grace-period (beats it when given)"),
        Flag("signals-to-handle", signal_names, signal_names(DEFAULT_SIGNALS),
             "signals the agent forwards to its workers before stopping them and exiting "
             f"(default {DEFAULT_SIGNALS})"),
        Flag("checkpoint-dir", directory, None,
             "SHOAL_CHECKPOINT_DIR for workers (default: a per-job temporary directory)"),
    ],
    "output and metrics": [
        Flag("metrics-port", port, None,
             "serve /metrics of the agent and its workers on this port (0: any free port, logged)"),
        Flag("metrics-host", text_value, "127.0.0.1", "address the metrics server binds"),
        Flag("log-dir", directory, None,
             "write each worker's output to LOG_DIR/RUN_ID/round_N/rank_R.log (also shown on "
             "the console unless --redirects says otherwise)"),
        Flag("redirects", std_spec, None,
             "send streams to the log file only: 0 none, 1 stdout, 2 stderr, 3 both, or per "
             "local rank as 0:1,1:2 (as torchrun)", short="-r"),
        Flag("tee", std_spec, None,
             "send streams to the log file and the console (same format as --redirects; "
             "a bare --tee means 3)", short="-t"),
        Flag("profile-dir", directory, None,
             "every rank writes its profiler trace for a step window to DIR (see shoal trace)",
             short="--profile"),
        Flag("local-ranks-filter", ranks_filter, (),
             "show only these local ranks' output on the console, e.g. 0,1 (files keep all)"),
    ],
    torch_conf.NO_COUNTERPART_TITLE: torch_conf.NO_COUNTERPART_FLAGS,
    "security": [
        Flag("auth-token-file", readable_file, None,
             "file holding the job's secret (else SHOAL_AUTH_TOKEN, else a fresh one per job)"),
    ],
    "script": [
        Flag("module", boolean, False, "run SCRIPT as a module (python -m SCRIPT)", switch=True,
             short="-m"),
        Flag("no-python", boolean, False,
             "run SCRIPT as a program of its own, not through python", switch=True),
        Flag("run-path", boolean, False,
             "run SCRIPT with runpy.run_path in a python worker (as torchrun; beats "
             "--no-python)", switch=True),
        Flag("start-method", start_method, "spawn",
             "accepted for torchrun's command lines: every worker is a fresh process here "
             "(spawn, fork or forkserver)"),
        Flag("virtual-local-rank", boolean, False,
             "each worker sees only its own GPU, as device 0: LOCAL_RANK=0 and "
             "CUDA_VISIBLE_DEVICES set to its device (as torchrun)", switch=True),
    ],
}

# `shoal store`'s --host and --port read SHOAL_STORE_HOST and SHOAL_STORE_PORT.
STORE_ENV_PREFIX = ENV_PREFIX + "STORE_"
STORE_FLAGS: list[Flag] = [
    Flag("host", text_value, "127.0.0.1", "address to bind (default 127.0.0.1)",
         env_prefix=STORE_ENV_PREFIX),
    Flag("port", port, DEFAULT_STORE_PORT,
         f"port to bind, 0 for any free one (default {DEFAULT_STORE_PORT})",
         env_prefix=STORE_ENV_PREFIX),
    Flag("auth-token-file", readable_file, None, "file holding the job's secret"),
]


# ----------------------------------------------------------------------------- run settings

@dataclasses.dataclass(frozen=True)
class RunSettings:
    """Everything `shoal run` was asked to do, after flags, variables and defaults."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    node_rank: Optional[int]
    local_addr: Optional[str]
    collective_timeout: Optional[float]
    # The backend shoal runs ("store" or "etcd") and the name it was asked for (torchrun's
    # c10d, static and etcd-v2 map onto those two).
    rdzv_backend: str
    rdzv_endpoints: tuple[tuple[str, int], ...]
    rdzv_id: str
    rdzv_conf: Mapping[str, object]
    # Built from the flags above, so that their rules were checked while parsing.
    rendezvous: RendezvousSettings
    backend_options: Mapping[str, object]
    standalone: bool
    max_restarts: int
    monitor_interval: float
    grace_period: float
    checkpoint_dir: Optional[str]
    metrics_port: Optional[int]
    metrics_host: str
    log_dir: Optional[str]
    redirects: StdSpec
    tee: StdSpec
    local_ranks_filter: tuple[int, ...]
    signals: tuple[signal.Signals, ...]
    auth_token_file: Optional[str]
    module: bool
    no_python: bool
    run_path: bool
    role: str
    script: str
    script_args: tuple[str, ...]
    requested_backend: str = "store"
    # c10d with an endpoint naming this host: host the store there, or, if another agent on
    # this host already does (its port is taken), be its client, as torchrun does.
    try_host: bool = False
    profile_dir: Optional[str] = None  # --profile DIR (SHOAL_PROFILE_DIR)
    virtual_local_rank: bool = False
    # One line each, logged once logging is set up: torchrun's flags and --rdzv-conf keys that
    # are accepted but mean nothing here, a run id shared by every job on an etcd, ...
    notices: tuple[str, ...] = ()

    @property
    def embedded_store(self) -> bool:
        """True when the store backend is hosted by this launcher (see also try_host)."""
        if self.rdzv_backend != "store":
            return False
        if self.standalone or not self.rdzv_endpoints:
            return True
        host, number = self.rdzv_endpoints[0]
        return number == 0 or self.node_rank == 0 or bool(self.rdzv_conf.get("is_host", False))


_RDZV_ID_FLAG = next(f for f in RUN_GROUPS["rendezvous"] if f.name == "rdzv-id")
_SPEC_TOKEN = re.compile(r"^(\d|\d+:\d(,\d+:\d)*)$")


def _bare_tee(argv: Sequence[str]) -> list[str]:
    """shoal's older `--tee` switch took no value; torchrun's -t does. A --tee followed by
    something that is not a spec (a script, another flag) means --tee 3."""
    out = list(argv)
    i = 0
    while i < len(out):
        token = out[i]
        if not token.startswith("-"):
            break  # the script: everything after it is the script's own
        if token in ("--tee", "-t") and (i + 1 >= len(out) or not _SPEC_TOKEN.match(out[i + 1])
                                         and out[i + 1].lower() not in ("true", "false", "yes",
                                                                        "no", "on", "off")):
            out.insert(i + 1, "3")
        elif "=" not in token and token not in _SWITCHES:
            i += 1  # skip the flag's value
        i += 1
    return out


_SWITCHES = {spelling for group in RUN_GROUPS.values() for flag in group if flag.switch
             for spelling in flag.option_strings} | {"-h", "--help", "--version"}


def run_parser() -> argparse.ArgumentParser:
    """The argparse parser of `shoal run` (defaults are applied afterwards, from variables)."""
    parser = CommandParser(
        prog="shoal run", short_usage="shoal run [flags] SCRIPT [ARGS...]",
        description="Start workers on this node, form a group with the other nodes through a "
                    "rendezvous, and restart everyone from the last checkpoint on a failure. "
                    "torchrun's flags and PET_* variables are understood with torchrun's "
                    "meaning.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"shoal {__version__}")
    for title, flags in RUN_GROUPS.items():
        group = parser.add_argument_group(title)
        for flag in flags:
            add_flag(group, flag)
    parser.add_argument("script", help="the training script (or module with -m, or program "
                                       "with --no-python)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")
    return parser


def parse_run(argv: Sequence[str], environ: Optional[Mapping[str, str]] = None) -> RunSettings:
    """Parse `shoal run` arguments; exits with status 2 and a message on a bad value."""
    environ = os.environ if environ is None else environ
    parser = run_parser()
    ns = parser.parse_args(_bare_tee(argv))
    environ = slurm.fill_in(parser, ns, environ)  # inside `srun`: Slurm's nodes and rendezvous
    apply_env(parser, [flag for group in RUN_GROUPS.values() for flag in group], ns, environ)
    if ns.rdzv_backend is None:
        # torchrun's default is static at --master-addr:--master-port; shoal's is an embedded
        # store. A master address or port (flag or PET_ variable) asks for torchrun's.
        ns.rdzv_backend = ("static" if ns.master_addr is not None or ns.master_port is not None
                           else "store")
    min_nodes, max_nodes = ns.nnodes
    if ns.standalone:
        _check_standalone(parser, ns, min_nodes, max_nodes)
        ns.rdzv_backend = "store"
    requested = ns.rdzv_backend
    target = _Target(*torch_conf.rendezvous_target(parser, ns), requested=requested)
    notices = target.name_run(parser, ns, environ)
    try:
        conf, conf_notices = torch_conf.translate(target.conf)
    except ValueError as exc:
        parser.error(f"argument --rdzv-conf/--rdzv_conf: {exc}")
    notices += conf_notices + torch_conf.ignored_flags(ns)
    if ns.virtual_local_rank:
        problem = torch_conf.virtual_local_rank_problem(ns.nproc_per_node, environ)
        if problem:
            parser.error(f"argument --virtual-local-rank/--virtual_local_rank: {problem}")
    try:
        rendezvous = RendezvousSettings.from_conf(ns.rdzv_id, min_nodes, max_nodes, conf)
        options = backend_options(target.backend, {
            k: v for k, v in conf.items()
            if k not in SETTINGS_CONF_KEYS and k not in LAUNCHER_CONF_KEYS})
    except ValueError as exc:
        parser.error(f"argument --rdzv-conf/--rdzv_conf: {exc}")
    _check_script(parser, ns)
    _check_directories(parser, ns)
    return RunSettings(
        min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=ns.nproc_per_node,
        node_rank=target.node_rank, local_addr=ns.local_addr,
        collective_timeout=ns.collective_timeout, rdzv_backend=target.backend,
        rdzv_endpoints=tuple(target.endpoints), rdzv_id=ns.rdzv_id,
        rdzv_conf=conf, rendezvous=rendezvous, backend_options=options,
        standalone=ns.standalone, max_restarts=ns.max_restarts,
        monitor_interval=ns.monitor_interval,
        grace_period=ns.grace_period if ns.shutdown_timeout is None else ns.shutdown_timeout,
        checkpoint_dir=ns.checkpoint_dir, metrics_port=ns.metrics_port,
        metrics_host=ns.metrics_host, log_dir=ns.log_dir,
        redirects=ns.redirects or StdSpec(), tee=ns.tee or StdSpec(),
        local_ranks_filter=ns.local_ranks_filter, signals=ns.signals_to_handle,
        auth_token_file=ns.auth_token_file, module=ns.module, no_python=ns.no_python,
        run_path=ns.run_path, role=ns.role, script=ns.script,
        script_args=tuple(ns.script_args), requested_backend=requested,
        try_host=target.try_host, profile_dir=ns.profile_dir,
        virtual_local_rank=ns.virtual_local_rank, notices=tuple(notices),
    )


def _check_standalone(parser: argparse.ArgumentParser, ns: argparse.Namespace,
                      min_nodes: int, max_nodes: int) -> None:
    if ns.rdzv_backend not in ("store", "c10d", "static") or ns.rdzv_endpoint:
        parser.error("argument --standalone: it runs an embedded store on this machine; "
                     "do not combine it with --rdzv-backend etcd or --rdzv-endpoint")
    if (min_nodes, max_nodes) != (1, 1):
        parser.error(f"argument --standalone: it runs one node, but --nnodes asks for "
                     f"{min_nodes}:{max_nodes}")


@dataclasses.dataclass
class _Target:
    """Where the rendezvous is, once torchrun's backends are mapped onto shoal's."""

    backend: str
    endpoints: tuple[tuple[str, int], ...]
    node_rank: Optional[int]
    try_host: bool
    conf: dict
    requested: str

    def name_run(self, parser: argparse.ArgumentParser, ns: argparse.Namespace,
                 environ: Mapping[str, str]) -> list[str]:
        """Check the endpoints and give the run its id when none was given; returns notices."""
        # No store endpoint: this node hosts an embedded store on 127.0.0.1 (embedded_store).
        embedded = self.backend == "store" and (ns.standalone or not self.endpoints)
        private = embedded or (self.backend == "store" and self.endpoints[0][1] == 0)
        if not embedded:
            try:
                check_endpoints(self.backend, self.endpoints)
            except ValueError as exc:
                parser.error(f"argument --rdzv-endpoint/--rdzv_endpoint: {exc}")
        notices: list[str] = []
        if ns.rdzv_id is None or (ns.rdzv_id == "none" and self.requested in TORCHRUN_BACKENDS):
            if self.backend == "etcd":
                notices.append(_shared_run_id(parser, ns, environ))
            # torchrun's default id is the word "none"; one job per endpoint makes it harmless.
            ns.rdzv_id = uuid.uuid4().hex[:12] if private else (ns.rdzv_id or "default")
        return notices


def _check_script(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """The script must exist (caught here, not as the same crash in every worker and every
    restart)."""
    if ns.no_python and ns.module and not ns.run_path:
        parser.error("argument --no-python/--no_python: do not combine it with -m/--module "
                     "(a module needs python)")
    if ns.run_path:
        if not os.path.isfile(ns.script):
            parser.error(f"argument --run-path/--run_path: {ns.script!r} is not a file "
                         f"(from {os.getcwd()!r})")
    elif ns.no_python:
        if shutil.which(ns.script) is None:
            parser.error(f"argument script: {ns.script!r} is not an executable program (with "
                         "--no-python it runs as it is: give a path or a name on PATH)")
    elif not ns.module and not os.path.isfile(ns.script):
        parser.error(f"argument script: {ns.script!r} is not a file (from {os.getcwd()!r}); "
                     "give a script path, or -m with a module name")


def _check_directories(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Made here so that an unusable directory is a usage error before any worker starts."""
    for flag, path in (("--log-dir/--log_dir", ns.log_dir),
                       ("--checkpoint-dir/--checkpoint_dir", ns.checkpoint_dir),
                       ("--profile/--profile-dir/--profile_dir", ns.profile_dir)):
        if path:
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as exc:
                parser.error(f"argument {flag}: cannot create directory {path!r}: "
                             f"{exc.strerror or exc}")
            if not os.access(path, os.W_OK):
                parser.error(f"argument {flag}: directory {path!r} is not writable")


def _shared_run_id(parser, ns, environ: Mapping[str, str]) -> str:
    """etcd keys a run by its id, so an etcd job without one meets every other such job.

    A run id variable that is set but empty is refused (exit 2): on Kubernetes it is a
    downward-API field that did not resolve (the Job's uid label is
    batch.kubernetes.io/controller-uid from 1.27 on; before, it has another name), and the
    pods of every Job would share one rendezvous. No id at all is torchrun's default and only
    warned about (the returned notice).
    """
    for name in _RDZV_ID_FLAG.envs:
        if name in environ and not environ[name].strip():
            parser.error(
                f"argument --rdzv-id/--rdzv_id: {name} is set but empty, so this job would "
                "meet every other job on the etcd under run id 'default'. On Kubernetes, the "
                "label batch.kubernetes.io/controller-uid it is read from exists from 1.27 on: "
                "upgrade, or set the run id another way (--rdzv-id, a unique value per job)")
    where = ",".join(f"{h}:{p}" for h, p in ns.rdzv_endpoint) or "the etcd endpoint"
    return (f"No run id was given (--rdzv-id or {_RDZV_ID_FLAG.env}): this job uses "
            f"'{ns.rdzv_id or 'default'}' on {where}, and so would any other job there "
            "without one, meeting in one rendezvous. Give each job its own --rdzv-id.")


@dataclasses.dataclass(frozen=True)
class StoreSettings:
    """What `shoal store` was asked to do."""

    host: str
    port: int
    auth_token_file: Optional[str]


def store_parser() -> argparse.ArgumentParser:
    """The argparse parser of `shoal store`."""
    parser = CommandParser(
        prog="shoal store", short_usage="shoal store [--host HOST] [--port PORT]",
        description="Run a standalone TCPStore server (rendezvous for --rdzv-backend store) "
                    "until SIGTERM or SIGINT.",
        allow_abbrev=False,
    )
    for flag in STORE_FLAGS:
        add_flag(parser, flag)
    return parser


def parse_store(argv: Sequence[str], environ: Optional[Mapping[str, str]] = None) -> StoreSettings:
    """Parse `shoal store` arguments; exits with status 2 and a message on a bad value."""
    environ = os.environ if environ is None else environ
    parser = store_parser()
    ns = parser.parse_args(list(argv))
    # --host and --port read STORE_ENV_PREFIX's variables: a bare host or port variable would
    # be too easy to set by accident.
    apply_env(parser, STORE_FLAGS, ns, environ)
    return StoreSettings(host=ns.host, port=ns.port, auth_token_file=ns.auth_token_file)
