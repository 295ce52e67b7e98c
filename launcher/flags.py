"""The flags of `shoal run` and `shoal store`, each backed by a `SHOAL_<FLAG>` variable.

This is the launcher's one module that reads the environment. A flag given on the command line
beats its variable, which beats the default. Every flag accepts both spellings
(`--max-restarts` and `--max_restarts`). A bad value, from either source, ends in argparse's
usage error (exit status 2) with a message that names the flag, and the variable when the value
came from one. The rendezvous' own rules (its settings, the backends, their endpoints and
options) live in elastic; parsing applies them, so a bad value is still a usage error here.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import uuid
from typing import Callable, Mapping, Optional, Sequence

from shoal.elastic.api import SETTINGS_CONF_KEYS, RendezvousSettings
from shoal.elastic.rendezvous.registry import (
    BACKENDS,
    backend_options,
    check_backend,
    check_endpoints,
    parse_endpoint,
)

DEFAULT_MAX_RESTARTS = 3
DEFAULT_MONITOR_INTERVAL_S = 0.1
DEFAULT_GRACE_PERIOD_S = 5.0
DEFAULT_NPROC_PER_NODE = 1
DEFAULT_STORE_PORT = 29400
DEFAULT_STORE_TIMEOUT_S = 30.0

# --rdzv-conf keys: name -> (converter, meaning). Timeouts are seconds.
RDZV_CONF_KEYS: dict[str, tuple[Callable[[str], object], str]] = {}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


# ----------------------------------------------------------------------------- converters
# Each raises argparse.ArgumentTypeError with a sentence; argparse prefixes the flag's name.

def _int_at_least(lowest: int) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(str(text).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"{value} is below the minimum of {lowest}")
        return value
    return convert


def _seconds(text: str, allow_zero: bool = False) -> float:
    try:
        value = float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if math.isnan(value) or math.isinf(value) or value < 0 or (value == 0 and not allow_zero):
        raise argparse.ArgumentTypeError(
            f"{text!r} must be a finite number of seconds {'>= 0' if allow_zero else '> 0'}"
        )
    return value


def number(text: str) -> float:
    """Any number; its rule is checked where the value is used (RendezvousSettings, the
    rendezvous registry), so that one rule serves code and command line alike."""
    try:
        return float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def positive_seconds(text: str) -> float:
    """A number of seconds greater than zero."""
    return _seconds(text)


def nonnegative_seconds(text: str) -> float:
    """A number of seconds, zero allowed."""
    return _seconds(text, allow_zero=True)


def boolean(text: str) -> bool:
    """1/true/yes/on or 0/false/no/off (any case)."""
    lowered = str(text).strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (use 1/0, true/false, yes/no)")


def nnodes(text: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` with 1 <= MIN <= MAX."""
    parts = str(text).strip().split(":")
    if len(parts) not in (1, 2):
        raise argparse.ArgumentTypeError(f"{text!r} is not N or MIN:MAX")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or MIN:MAX with integers") from None
    low, high = values[0], values[-1]
    if low < 1 or high < low:
        raise argparse.ArgumentTypeError(
            f"{text!r} needs 1 <= MIN <= MAX (got MIN={low}, MAX={high})"
        )
    return low, high


def port(text: str) -> int:
    """A TCP port, 0 (any free one, chosen by the kernel) to 65535."""
    value = _int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (0 to 65535)")
    return value


def endpoints(text: str) -> tuple[tuple[str, int], ...]:
    """`HOST:PORT[,HOST:PORT...]` (`HOST` alone: the default store port; IPv6 as
    `[::1]:PORT`); an empty string means no endpoint."""
    text = str(text).strip()
    if not text:
        return ()
    try:
        return tuple(parse_endpoint(part, DEFAULT_STORE_PORT) for part in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def rdzv_backend(text: str) -> str:
    """The name of a rendezvous backend (see elastic.rendezvous.registry.BACKENDS)."""
    name = str(text).strip()
    try:
        check_backend(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name


def run_id(text: str) -> str:
    """Letters, digits, `_`, `.` and `-`, up to 128 characters (it becomes a key prefix)."""
    text = str(text).strip()
    if not _RUN_ID.match(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a run id (letters, digits, '_', '.', '-'; 1-128 characters, "
            "starting with a letter or digit)"
        )
    return text


def nproc(text: str) -> int:
    """A worker count >= 1, or `cpu` for one per CPU core."""
    if str(text).strip().lower() == "cpu":
        return os.cpu_count() or 1
    return _int_at_least(1)(text)


def _conf_keys() -> dict[str, tuple[Callable[[str], object], str]]:
    # The rendezvous settings and the backends' options are checked by elastic when parse_run
    # builds them; here they only need to be numbers. The rest are the launcher's own.
    keys: dict[str, tuple[Callable[[str], object], str]] = {
        key: (number, meaning) for key, meaning in SETTINGS_CONF_KEYS.items()}
    for name, kind in BACKENDS.items():
        keys.update((key, (number, f"{meaning} ({name})")) for key, meaning in kind.options.items())
    keys.update({
        "store_timeout": (positive_seconds, "timeout of store operations (embedded store)"),
        "exit_barrier_timeout": (
            positive_seconds, "seconds an agent waits at the exit barrier for the other nodes"),
        "is_host": (boolean, "this node hosts the embedded store at --rdzv-endpoint"),
    })
    return keys


RDZV_CONF_KEYS.update(_conf_keys())
# The --rdzv-conf keys that shoal run itself reads (the rest go to elastic).
LAUNCHER_CONF_KEYS = ("store_timeout", "exit_barrier_timeout", "is_host")


def rdzv_conf(text: str) -> dict[str, object]:
    """`k=v,k=v` with known keys only (see RDZV_CONF_KEYS)."""
    result: dict[str, object] = {}
    text = str(text).strip()
    if not text:
        return result
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"{item!r} is not key=value")
        if key not in RDZV_CONF_KEYS:
            raise argparse.ArgumentTypeError(
                f"unknown key {key!r}; known keys: {', '.join(sorted(RDZV_CONF_KEYS))}"
            )
        try:
            result[key] = RDZV_CONF_KEYS[key][0](value)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"key {key!r}: {exc}") from None
    return result


def readable_file(text: str) -> str:
    """A path to a file that exists and can be read."""
    path = os.path.expanduser(str(text).strip())
    if not path:
        raise argparse.ArgumentTypeError("an empty path")
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"{path!r} is not an existing file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{path!r} cannot be read")
    return path


def directory(text: str) -> str:
    """A directory path (created later if missing); must not name an existing file."""
    path = os.path.expanduser(str(text).strip())
    if not path:
        raise argparse.ArgumentTypeError("an empty path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} exists and is not a directory")
    return path


def text_value(text: str) -> str:
    """Any non-empty text."""
    text = str(text).strip()
    if not text:
        raise argparse.ArgumentTypeError("an empty value")
    return text


# ----------------------------------------------------------------------------- flag table

@dataclasses.dataclass(frozen=True)
class Flag:
    """One option: its name (dashes), converter, default, help and whether it takes no value."""

    name: str
    convert: Callable[[str], object]
    default: object
    help: str
    switch: bool = False
    short: Optional[str] = None
    env_prefix: str = "SHOAL_"

    @property
    def dest(self) -> str:
        """The attribute name (underscores)."""
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        """The variable that backs this flag."""
        return self.env_prefix + self.dest.upper()

    @property
    def option_strings(self) -> list[str]:
        """Both spellings (and the short one, if any)."""
        spellings = [f"--{self.name}"]
        if "-" in self.name:
            spellings.append(f"--{self.dest}")
        if self.short:
            spellings.insert(0, self.short)
        return spellings


RUN_GROUPS: dict[str, list[Flag]] = {
    "nodes and workers": [
        Flag("nnodes", nnodes, (1, 1), "number of nodes, N or MIN:MAX (default 1)"),
        Flag("nproc-per-node", nproc, DEFAULT_NPROC_PER_NODE,
             "workers per node, an integer or 'cpu' (default 1)"),
        Flag("node-rank", _int_at_least(0), None,
             "this node's rank; 0 hosts the embedded store at --rdzv-endpoint (ranks in the "
             "group are assigned by the rendezvous)"),
        Flag("local-addr", text_value, None,
             "address other nodes reach this node at (default 127.0.0.1 on one machine, else "
             "this host's FQDN)"),
        Flag("collective-timeout", positive_seconds, None,
             "seconds a worker's process group and its collectives wait before a hang is an "
             "error (the default of init_process_group; default 600)"),
    ],
    "rendezvous": [
        Flag("rdzv-backend", rdzv_backend, "store",
             "; ".join(f"{name}: {kind.summary}" for name, kind in BACKENDS.items())
             + " (default store)"),
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
        Flag("checkpoint-dir", directory, None,
             "SHOAL_CHECKPOINT_DIR for workers (default: a per-job temporary directory)"),
    ],
    "output and metrics": [
        Flag("metrics-port", port, None,
             "serve /metrics of the agent and its workers on this port (0: any free port, logged)"),
        Flag("metrics-host", text_value, "127.0.0.1", "address the metrics server binds"),
        Flag("log-dir", directory, None, "write each worker's output to LOG_DIR/.../rank_R.log"),
        Flag("tee", boolean, False,
             "with --log-dir, also show the output on the console", switch=True),
    ],
    "security": [
        Flag("auth-token-file", readable_file, None,
             "file holding the job's secret (else SHOAL_AUTH_TOKEN, else a fresh one per job)"),
    ],
    "script": [
        Flag("module", boolean, False, "run SCRIPT as a module (python -m SCRIPT)", switch=True,
             short="-m"),
    ],
}

STORE_FLAGS: list[Flag] = [
    Flag("host", text_value, "127.0.0.1", "address to bind (default 127.0.0.1)",
         env_prefix="SHOAL_STORE_"),
    Flag("port", port, DEFAULT_STORE_PORT,
         f"port to bind, 0 for any free one (default {DEFAULT_STORE_PORT})",
         env_prefix="SHOAL_STORE_"),
    Flag("auth-token-file", readable_file, None, "file holding the job's secret"),
]


def _add_flag(container, flag: Flag) -> None:
    kwargs = dict(dest=flag.dest, default=None, help=f"{flag.help} [{flag.env}]")
    if flag.switch:
        # A switch takes no value (so `--standalone train.py` keeps the script); its variable
        # may still say false.
        container.add_argument(*flag.option_strings, action="store_const", const=True, **kwargs)
    else:
        container.add_argument(*flag.option_strings, type=flag.convert,
                               metavar=flag.dest.upper(), **kwargs)


def _apply_env(parser: argparse.ArgumentParser, flags: Sequence[Flag], ns: argparse.Namespace,
               environ: Mapping[str, str]) -> None:
    for flag in flags:
        if getattr(ns, flag.dest) is not None:
            continue
        raw = environ.get(flag.env)
        if raw is not None and raw != "":
            try:
                value = flag.convert(raw)
            except argparse.ArgumentTypeError as exc:
                parser.error(
                    f"argument {'/'.join(flag.option_strings)} (from {flag.env}={raw!r}): {exc}"
                )
        else:
            value = flag.default
        setattr(ns, flag.dest, value)


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
    tee: bool
    auth_token_file: Optional[str]
    module: bool
    script: str
    script_args: tuple[str, ...]

    @property
    def embedded_store(self) -> bool:
        """True when the store backend is hosted by this launcher."""
        if self.rdzv_backend != "store":
            return False
        if self.standalone or not self.rdzv_endpoints:
            return True
        host, number = self.rdzv_endpoints[0]
        return number == 0 or self.node_rank == 0 or bool(self.rdzv_conf.get("is_host", False))


def run_parser() -> argparse.ArgumentParser:
    """The argparse parser of `shoal run` (defaults are applied afterwards, from variables)."""
    parser = argparse.ArgumentParser(
        prog="shoal run",
        description="Start workers on this node, form a group with the other nodes through a "
                    "rendezvous, and restart everyone from the last checkpoint on a failure.",
        allow_abbrev=False,
    )
    for title, flags in RUN_GROUPS.items():
        group = parser.add_argument_group(title)
        for flag in flags:
            _add_flag(group, flag)
    parser.add_argument("script", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")
    return parser


def parse_run(argv: Sequence[str], environ: Optional[Mapping[str, str]] = None) -> RunSettings:
    """Parse `shoal run` arguments; exits with status 2 and a message on a bad value."""
    environ = os.environ if environ is None else environ
    parser = run_parser()
    ns = parser.parse_args(list(argv))
    flags = [flag for group in RUN_GROUPS.values() for flag in group]
    _apply_env(parser, flags, ns, environ)

    min_nodes, max_nodes = ns.nnodes
    if ns.standalone:
        if ns.rdzv_backend != "store" or ns.rdzv_endpoint:
            parser.error("argument --standalone: it runs an embedded store on this machine; "
                         "do not combine it with --rdzv-backend etcd or --rdzv-endpoint")
        if (min_nodes, max_nodes) != (1, 1):
            parser.error(f"argument --standalone: it runs one node, but --nnodes asks for "
                         f"{min_nodes}:{max_nodes}")
    # No store endpoint: this node hosts an embedded store on 127.0.0.1 (see embedded_store).
    embedded = ns.rdzv_backend == "store" and (ns.standalone or not ns.rdzv_endpoint)
    if not embedded:
        try:
            check_endpoints(ns.rdzv_backend, ns.rdzv_endpoint)
        except ValueError as exc:
            parser.error(f"argument --rdzv-endpoint/--rdzv_endpoint: {exc}")
    if ns.rdzv_id is None:
        ns.rdzv_id = uuid.uuid4().hex[:12] if embedded else "default"
    conf = dict(ns.rdzv_conf)
    try:
        rendezvous = RendezvousSettings.from_conf(ns.rdzv_id, min_nodes, max_nodes, conf)
        options = backend_options(ns.rdzv_backend, {
            k: v for k, v in conf.items()
            if k not in SETTINGS_CONF_KEYS and k not in LAUNCHER_CONF_KEYS})
    except ValueError as exc:
        parser.error(f"argument --rdzv-conf/--rdzv_conf: {exc}")
    if not ns.module and not os.path.isfile(ns.script):
        # Caught here, not as the same crash in every worker and every restart.
        parser.error(f"argument script: {ns.script!r} is not a file (from {os.getcwd()!r}); "
                     "give a script path, or -m with a module name")
    for flag, directory in (("--log-dir/--log_dir", ns.log_dir),
                            ("--checkpoint-dir/--checkpoint_dir", ns.checkpoint_dir)):
        # Made here so that an unusable directory is a usage error before any worker starts.
        if directory:
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as exc:
                parser.error(f"argument {flag}: cannot create directory {directory!r}: "
                             f"{exc.strerror or exc}")
            if not os.access(directory, os.W_OK):
                parser.error(f"argument {flag}: directory {directory!r} is not writable")

    return RunSettings(
        min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=ns.nproc_per_node,
        node_rank=ns.node_rank, local_addr=ns.local_addr,
        collective_timeout=ns.collective_timeout, rdzv_backend=ns.rdzv_backend,
        rdzv_endpoints=tuple(ns.rdzv_endpoint), rdzv_id=ns.rdzv_id,
        rdzv_conf=conf, rendezvous=rendezvous, backend_options=options,
        standalone=ns.standalone, max_restarts=ns.max_restarts,
        monitor_interval=ns.monitor_interval, grace_period=ns.grace_period,
        checkpoint_dir=ns.checkpoint_dir, metrics_port=ns.metrics_port,
        metrics_host=ns.metrics_host, log_dir=ns.log_dir, tee=ns.tee,
        auth_token_file=ns.auth_token_file, module=ns.module, script=ns.script,
        script_args=tuple(ns.script_args),
    )


@dataclasses.dataclass(frozen=True)
class StoreSettings:
    """What `shoal store` was asked to do."""

    host: str
    port: int
    auth_token_file: Optional[str]


def store_parser() -> argparse.ArgumentParser:
    """The argparse parser of `shoal store`."""
    parser = argparse.ArgumentParser(
        prog="shoal store",
        description="Run a standalone TCPStore server (rendezvous for --rdzv-backend store) "
                    "until SIGTERM or SIGINT.",
        allow_abbrev=False,
    )
    for flag in STORE_FLAGS:
        _add_flag(parser, flag)
    return parser


def parse_store(argv: Sequence[str], environ: Optional[Mapping[str, str]] = None) -> StoreSettings:
    """Parse `shoal store` arguments; exits with status 2 and a message on a bad value."""
    environ = os.environ if environ is None else environ
    parser = store_parser()
    ns = parser.parse_args(list(argv))
    # --host and --port read SHOAL_STORE_HOST and SHOAL_STORE_PORT: bare SHOAL_HOST would be
    # too easy to set by accident.
    _apply_env(parser, STORE_FLAGS, ns, environ)
    return StoreSettings(host=ns.host, port=ns.port, auth_token_file=ns.auth_token_file)
