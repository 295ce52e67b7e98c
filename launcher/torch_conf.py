"""torchrun's flags and torch's `--rdzv-conf` keys that shoal spells differently or lacks.

torch's rendezvous backends read keys that shoal spells differently (`timeout`, `read_timeout`,
`keep_alive_interval`, `keep_alive_max_attempt`) or does without (`close_timeout`,
`store_type=tcp`). `translate` gives each torch's meaning in shoal's terms, or drops it with a
one-line notice saying why; a key that means something shoal cannot do (`store_type=file`) is
refused. The etcd keys (`protocol`, `etcd_prefix`, etcd-v2's `ca_cert`/`ssl_cert`/
`ssl_cert_key`) are the etcd backend's own options (elastic.rendezvous.registry).

torchrun's flags that have no counterpart here are `NO_COUNTERPART_FLAGS` (a group of `shoal
run --help`), and `ignored_flags` words the notices for those given. `rendezvous_target` maps
torchrun's rendezvous backends (c10d, static, etcd-v2) onto shoal's, and
`virtual_local_rank_problem` checks `--virtual-local-rank` against CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import argparse
from typing import Mapping, Optional

from shoal.core import netaddr
from shoal.elastic.api import DEFAULT_HEARTBEAT_INTERVAL_S
from shoal.launcher.converters import (
    DEFAULT_MASTER_PORT,
    NUMA_MODES,
    TORCHRUN_BACKENDS,
    comma_list,
    numa_mode,
    text_value,
)
from shoal.launcher.flag_spec import Flag
from shoal.launcher.virtual_local_rank import visible_devices

# torch's name -> shoal's, for keys that mean the same.
RENAMED = {"timeout": "join_timeout", "read_timeout": "store_timeout",
           "keep_alive_interval": "heartbeat_interval"}


def translate(conf: Mapping[str, object]) -> tuple[dict[str, object], list[str]]:
    """`conf` with torch's keys as shoal's, and the notices to log (one line each).

    Raises:
        ValueError: two spellings of one setting disagree, or a value shoal cannot honour.
    """
    out = dict(conf)
    notices: list[str] = []
    for torch_name, name in RENAMED.items():
        if torch_name in out:
            _rename(out, torch_name, name)
    if "keep_alive_max_attempt" in out:
        attempts = int(out.pop("keep_alive_max_attempt"))  # type: ignore[arg-type]
        interval = float(out.get("heartbeat_interval", DEFAULT_HEARTBEAT_INTERVAL_S))
        if attempts < 2:
            raise ValueError(
                f"--rdzv-conf keep_alive_max_attempt={attempts} would declare a node dead "
                "after a single heartbeat interval; give 2 or more (heartbeat_timeout must "
                "exceed heartbeat_interval).")
        _set(out, "heartbeat_timeout", interval * attempts,
             f"keep_alive_max_attempt={attempts} (heartbeat_timeout = {attempts} x "
             f"heartbeat_interval {interval:g}s)")
    if "close_timeout" in out:
        out.pop("close_timeout")
        notices.append("--rdzv-conf close_timeout is torch's and is ignored: closing the "
                       "rendezvous is one write here, bounded by store_timeout.")
    if "store_type" in out:
        if out.pop("store_type") == "file":
            raise ValueError("--rdzv-conf store_type=file (torch's FileStore rendezvous) is not "
                             "supported: shoal's c10d rendezvous is a TCP store; give "
                             "--rdzv-endpoint HOST:PORT and leave store_type out (or tcp).")
    return out, notices


def _rename(conf: dict, torch_name: str, name: str) -> None:
    value = conf.pop(torch_name)
    _set(conf, name, value, f"{torch_name}={value!r} (torch's name for {name})")


def _set(conf: dict, name: str, value: object, source: str) -> None:
    if name in conf and float(conf[name]) != float(value):  # type: ignore[arg-type]
        raise ValueError(f"--rdzv-conf {name}={conf[name]!r} disagrees with {source}; give "
                         "one of them.")
    conf[name] = value


# A group of `shoal run --help`: torchrun's flags accepted for its command lines, each noticed
# by ignored_flags when given.
NO_COUNTERPART_TITLE = "torchrun's, with no counterpart here (accepted with a warning)"
NO_COUNTERPART_FLAGS: list[Flag] = [
    Flag("logs-specs", text_value, None,
         "torchrun's LogsSpecs entry point: ignored (shoal has no log plugins; --log-dir, "
         "-r and -t choose where streams go)"),
    Flag("event-log-handler", text_value, "null",
         "torchrun's event handler: only 'null' (its default) here, shoal emits no "
         "torchelastic events (its logs and --metrics-port report rounds and failures)"),
    Flag("numa-binding", numa_mode, None,
         f"torchrun's NUMA binding ({', '.join(NUMA_MODES)}): ignored, shoal does not pin "
         "workers to CPUs"),
    Flag("duplicate-stdout-filters", comma_list, (),
         "torchrun's copy of matching stdout lines to a file: ignored (every stream is in "
         "--log-dir's files; search them)"),
    Flag("duplicate-stderr-filters", comma_list, (),
         "the same for stderr: ignored"),
]


def ignored_flags(ns) -> list[str]:
    """One notice per torchrun flag given (`ns`: parsed flags) that shoal does without."""
    found = []
    if ns.logs_specs is not None:
        found.append(f"--logs-specs {ns.logs_specs} is torchrun's and is ignored: shoal has no "
                     "log plugins (--log-dir, -r and -t choose where streams go).")
    if ns.event_log_handler != "null":
        found.append(f"--event-log-handler {ns.event_log_handler} is torchrun's and is "
                     "ignored: shoal emits no torchelastic events (its log and "
                     "--metrics-port report rounds and failures).")
    if ns.numa_binding is not None:
        found.append(f"--numa-binding {ns.numa_binding} is torchrun's and is ignored: shoal "
                     "does not pin workers to CPUs (wrap the script, e.g. --no-python numactl "
                     "..., to bind them).")
    for stream in ("stdout", "stderr"):
        if getattr(ns, f"duplicate_{stream}_filters"):
            found.append(f"--duplicate-{stream}-filters is torchrun's and is ignored: every "
                         "stream is in --log-dir's files; search them instead.")
    return found


def rendezvous_target(parser: argparse.ArgumentParser, ns: argparse.Namespace
                      ) -> tuple[str, tuple, Optional[int], bool, dict]:
    """Map torchrun's backends onto shoal's: (backend, endpoints, node rank, try_host, conf)."""
    requested = ns.rdzv_backend
    conf = dict(ns.rdzv_conf)
    endpoints_, node_rank, try_host = tuple(ns.rdzv_endpoint), ns.node_rank, False
    if requested == "static":
        if ns.nnodes[0] != ns.nnodes[1]:
            parser.error(f"argument --nnodes: the static rendezvous needs a fixed node count, "
                         f"got {ns.nnodes[0]}:{ns.nnodes[1]}; use --rdzv-backend c10d (or "
                         "etcd) for an elastic range")
        if not endpoints_:
            endpoints_ = ((ns.master_addr or "127.0.0.1",
                           DEFAULT_MASTER_PORT if ns.master_port is None else ns.master_port),)
        node_rank = 0 if node_rank is None else node_rank
        if node_rank >= ns.nnodes[1]:
            parser.error(f"argument --node-rank/--node_rank: {node_rank} is not below --nnodes "
                         f"{ns.nnodes[1]}")
        conf.setdefault("is_host", node_rank == 0)
    elif requested == "c10d" and endpoints_ and "is_host" not in conf and node_rank is None:
        host, number = endpoints_[0]
        if number != 0:
            # torchrun hosts the store where the endpoint names this machine.
            try_host = host == "localhost" or netaddr.is_local_address(host)
    return TORCHRUN_BACKENDS.get(requested, requested), endpoints_, node_rank, try_host, conf


def virtual_local_rank_problem(nproc: int, environ: Mapping[str, str]) -> Optional[str]:
    """Why `nproc` workers cannot each get a device of their own from CUDA_VISIBLE_DEVICES
    (None when they can, or when it is unset: every device is visible)."""
    listed = visible_devices(environ)
    if listed is None or len(listed) >= nproc:
        return None
    return (f"{nproc} workers need a device each, but "
            f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r} lists {len(listed)}")
