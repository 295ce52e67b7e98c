"""The values of `shoal run`'s flags and `--rdzv-conf` keys: one converter per kind, each
raising argparse.ArgumentTypeError with a sentence (argparse prefixes the flag's name), and the
defaults. torchrun's spellings of values (backends c10d/static/etcd-v2, gpu/auto process
counts, stream specs, signal lists) are accepted here with torchrun's meaning.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
from typing import Callable

from shoal.elastic.api import SETTINGS_CONF_KEYS
from shoal.elastic.rendezvous.registry import BACKENDS, check_backend, parse_endpoint
from shoal.launcher import devices
from shoal.launcher.streams import StdSpec

DEFAULT_MAX_RESTARTS = 3
DEFAULT_MONITOR_INTERVAL_S = 0.1
DEFAULT_GRACE_PERIOD_S = 5.0
DEFAULT_NPROC_PER_NODE = 1
DEFAULT_STORE_PORT = 29400
DEFAULT_STORE_TIMEOUT_S = 30.0
DEFAULT_MASTER_PORT = 29500  # torchrun's static rendezvous port
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's default

# --rdzv-conf keys: name -> (converter, meaning). Timeouts are seconds.
RDZV_CONF_KEYS: dict[str, tuple[Callable[[str], object], str]] = {}
# Backend options that are text (files, names), not numbers.
_TEXT_OPTIONS: dict[str, Callable[[str], object]] = {}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


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


def choice(*words: str) -> Callable[[str], str]:
    """A converter to one of `words` (given in lowercase), in any case and spacing."""
    def convert(text: str) -> str:
        word = str(text).strip().lower()
        if word not in words:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(words)}")
        return word
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


# torchrun's backend names -> what each means here. c10d: a TCPStore hosted by the node whose
# address the endpoint names (shoal's `store`); static: node rank 0 hosts it at
# --master-addr:--master-port and the node count is fixed; etcd-v2: etcd (shoal speaks v3).
TORCHRUN_BACKENDS = {"c10d": "store", "static": "store", "etcd-v2": "etcd"}


def rdzv_backend(text: str) -> str:
    """The name of a rendezvous backend (see elastic.rendezvous.registry.BACKENDS), or one of
    torchrun's names (TORCHRUN_BACKENDS)."""
    name = str(text).strip()
    if name in TORCHRUN_BACKENDS:
        return name
    try:
        check_backend(name)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown rendezvous backend {name!r}; choose one of "
            f"{list(BACKENDS) + list(TORCHRUN_BACKENDS)}") from None
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
    """A worker count >= 1, or as torchrun: `cpu` (one per core), `gpu` (one per CUDA device),
    `auto` (gpu if there is one, else cpu)."""
    word = str(text).strip().lower()
    if word == "cpu":
        return devices.cpu_count()
    if word in ("gpu", "cuda"):
        count = devices.gpu_count()
        if count == 0:
            raise argparse.ArgumentTypeError(
                f"{text!r} asks for one worker per GPU, but no CUDA device is visible "
                f"({devices.why_no_gpu()})")
        return count
    if word == "auto":
        return devices.gpu_count() or devices.cpu_count()
    try:
        return _int_at_least(1)(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (give an integer, cpu, gpu or auto)") from None


def std_spec(text: str) -> "StdSpec":
    """torchrun's -r/-t value: `0` none, `1` stdout, `2` stderr, `3` both, for every local rank,
    or per local rank as `0:1,1:2`."""
    try:
        return StdSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def ranks_filter(text: str) -> tuple[int, ...]:
    """Local ranks whose output reaches the console, `0,1,2` (empty: all)."""
    text = str(text).strip()
    if not text:
        return ()
    try:
        ranks = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of local ranks, e.g. 0,1,2") from None
    if any(rank < 0 for rank in ranks):
        raise argparse.ArgumentTypeError(f"{text!r} names a negative local rank")
    return ranks


# torchrun's --numa-binding modes (torch.numa.binding.AffinityMode).
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")
numa_mode = choice(*NUMA_MODES)


def comma_list(text: str) -> tuple[str, ...]:
    """torchrun's comma-separated list, `,,` standing for a comma inside an item."""
    placeholder = "\0"
    return tuple(item.replace(placeholder, ",")
                 for item in str(text).replace(",,", placeholder).split(",") if item)


def signal_names(text: str) -> tuple[signal.Signals, ...]:
    """`SIGTERM,SIGINT,...` (with or without the SIG prefix)."""
    found = []
    for part in str(text).split(","):
        name = part.strip().upper()
        if not name:
            continue
        if not name.startswith("SIG"):
            name = "SIG" + name
        try:
            found.append(signal.Signals[name])
        except KeyError:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} is not a signal name") from None
        if found[-1] in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            raise argparse.ArgumentTypeError(f"{name} cannot be handled or forwarded")
    if not found:
        raise argparse.ArgumentTypeError("no signal named")
    return tuple(dict.fromkeys(found))


# torch's --rdzv-conf keys that shoal names differently or does without; launcher.torch_conf
# turns them into shoal's (or a notice that they are ignored, and why).
TORCH_CONF_KEYS: dict[str, tuple[Callable[[str], object], str]] = {
    "timeout": (lambda t: positive_seconds(t),
                "torch's etcd and static rendezvous: the same as join_timeout"),
    "read_timeout": (lambda t: positive_seconds(t),
                     "torch's c10d and etcd-v2: the same as store_timeout"),
    "keep_alive_interval": (lambda t: positive_seconds(t),
                            "torch's name for heartbeat_interval"),
    "keep_alive_max_attempt": (lambda t: _int_at_least(1)(t),
                               "torch's: a node is dead after this many heartbeats are missed "
                               "(heartbeat_timeout = heartbeat_interval x this)"),
    "close_timeout": (lambda t: positive_seconds(t), "torch's; accepted and ignored"),
    "store_type": (choice("tcp", "file"),
                   "torch's c10d: tcp (shoal's store backend); file is refused"),
}


def _conf_keys() -> dict[str, tuple[Callable[[str], object], str]]:
    # Late-bound: those converters are defined further down.
    files = {name: (lambda t: readable_file(t))
             for name in ("cacert", "cert", "key", "ca_cert", "ssl_cert", "ssl_cert_key")}
    # protocol (http or https) is checked once, by the etcd backend's EtcdSecurity, which code
    # that builds a backend without shoal run reaches as well.
    _TEXT_OPTIONS.update(files, user=lambda t: text_value(t), password=lambda t: text_value(t),
                         protocol=lambda t: text_value(t), etcd_prefix=lambda t: text_value(t))
    # The rendezvous settings and the backends' options are checked by elastic when parse_run
    # builds them; here they only need to be numbers. The rest are the launcher's own.
    keys: dict[str, tuple[Callable[[str], object], str]] = {
        key: (number, meaning) for key, meaning in SETTINGS_CONF_KEYS.items()}
    for name, kind in BACKENDS.items():
        keys.update((key, (_TEXT_OPTIONS.get(key, number), f"{meaning} ({name})"))
                    for key, meaning in kind.options.items())
    keys.update({
        "store_timeout": (positive_seconds, "timeout of store operations (embedded store)"),
        "exit_barrier_timeout": (
            positive_seconds, "seconds an agent waits at the exit barrier for the other nodes"),
        "is_host": (boolean, "this node hosts the embedded store at --rdzv-endpoint"),
    })
    keys.update(TORCH_CONF_KEYS)
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


start_method = choice("spawn", "fork", "forkserver")  # torchrun's choices


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
