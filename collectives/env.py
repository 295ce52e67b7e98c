"""The process-group layer's environment: its `SHOAL_*` settings (declared in
`collectives.settings`) as the values callers use, and the names torchrun sets (RANK, MASTER_ADDR)."""

from __future__ import annotations

import os
import tempfile
from typing import Optional

from shoal.collectives import settings
from shoal.collectives.types import DistNetworkError
from shoal.core.auth import is_loopback
from shoal.core.config import SettingError
from shoal.core.netaddr import address_towards, is_local_address


def async_error_handling() -> bool:
    """SHOAL_ASYNC_ERROR_HANDLING=1: a failed collective ends the process (the launcher sets it)."""
    return settings.ASYNC_ERROR_HANDLING.get()


def dump_dir() -> str:
    """Where watchdog dumps go: SHOAL_DUMP_DIR, else the system's temporary directory."""
    return settings.DUMP_DIR.get() or tempfile.gettempdir()


def _int_var(name: str) -> Optional[int]:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"Environment variable {name} must be an integer, got {raw!r}.") from exc


def collective_timeout() -> Optional[float]:
    """SHOAL_COLLECTIVE_TIMEOUT: seconds, the default timeout of a group and its collectives
    when init_process_group is given none (`shoal run --collective-timeout` sets it).

    Raises:
        SettingError: the value is not a positive, finite number.
    """
    setting = settings.COLLECTIVE_TIMEOUT
    try:
        return setting.get()
    except SettingError as exc:
        raise SettingError(
            f"{setting.name} must be a positive, finite number of seconds, got "
            f"{setting.raw()!r}.") from exc


def env_rank() -> Optional[int]:
    """RANK, if set."""
    return _int_var("RANK")


def env_world_size() -> Optional[int]:
    """WORLD_SIZE, if set."""
    return _int_var("WORLD_SIZE")


def env_local_rank() -> Optional[int]:
    """LOCAL_RANK, if set (the nccl backend's default CUDA device)."""
    return _int_var("LOCAL_RANK")


def env_master() -> tuple[Optional[str], Optional[int]]:
    """(MASTER_ADDR, MASTER_PORT), each None when unset."""
    return os.environ.get("MASTER_ADDR") or None, _int_var("MASTER_PORT")


def local_transport() -> str:
    """SHOAL_LOCAL_TRANSPORT: how the tcp backend links ranks on the same host.

    "shm" (default on Linux): abstract Unix-domain sockets, plus shared memory for all_reduce
    above the small-message size when every rank of a group shares the host; "unix": the
    sockets only; "tcp": every link on TCP over loopback.
    """
    return settings.LOCAL_TRANSPORT.get()


def hierarchical_collectives() -> bool:
    """SHOAL_HIERARCHICAL (default 1): whether tcp groups that span hosts run their large
    collectives in two levels (shared memory within a host, TCP between hosts); 0 runs the flat
    algorithms over sockets, for comparison."""
    return settings.HIERARCHICAL.get()


def hierarchical_leaders() -> Optional[int]:
    """SHOAL_HIER_LEADERS: at most this many ranks per host carry a share of the two-level
    collectives' traffic between hosts (default: every rank of the smallest host). Every rank
    must use the same value."""
    return settings.HIER_LEADERS.get()


def hierarchical_pipeline() -> Optional[bool]:
    """SHOAL_HIER_PIPELINE: 1 pipelines two-level all_reduces (a leader's cross-host transfer of
    one piece overlaps its host's shared-memory work on the next), 0 runs the phases one after
    the other; unset, the group decides by cores per rank. Every rank must agree, or none
    pipelines."""
    return settings.HIER_PIPELINE.get()


def p2p_direct() -> bool:
    """SHOAL_P2P_DIRECT (default 1): whether large point-to-point messages between ranks of one
    host may be written straight into the receiving array (`backends.tcp.vm_p2p`)."""
    return settings.P2P_DIRECT.get()


def spin_seconds(group_size: int, default: float) -> float:
    """How long small receives poll before blocking: SHOAL_SPIN_US if set, else `default` when
    this process may use at least `group_size` CPUs (so ranks do not steal each other's core).

    Raises:
        SettingError: SHOAL_SPIN_US is not a number of microseconds of at least 0.
    """
    spin_us = settings.SPIN_US.get()
    if spin_us is not None:
        return spin_us * 1e-6
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return default if cpus >= group_size else 0.0


def use_agent_store() -> bool:
    """SHOAL_USE_AGENT_STORE=1 (or torch's TORCHELASTIC_USE_AGENT_STORE=True): the store at
    MASTER_ADDR:MASTER_PORT is hosted by the launcher's agent, so rank 0 connects as a client."""
    return settings.USE_AGENT_STORE.get()


def bind_host(master_addr: Optional[str]) -> str:
    """The address this rank's backend listens on and advertises to its peers.

    SHOAL_COLLECTIVES_HOST wins (it must be one of this host's addresses); otherwise loopback
    when the master is on this machine, else the local address that routes to the master, which
    is the one peers on other hosts can reach (`core.netaddr.address_towards`).

    Raises:
        DistNetworkError: SHOAL_COLLECTIVES_HOST is not an address of this host, or the master
            is on another host and no route leads there. Advertising loopback instead would
            only fail later, on every peer, as "could not connect to rank N at 127.0.0.1".
    """
    explicit = settings.COLLECTIVES_HOST.get()
    if explicit:
        if not is_local_address(explicit):
            raise DistNetworkError(
                f"SHOAL_COLLECTIVES_HOST={explicit!r} is not an address of this host, so this "
                f"rank cannot listen on it; set it to one of this host's addresses, or unset it "
                f"to use the address that routes to the master.")
        return explicit
    if not master_addr or is_loopback(master_addr):
        return "127.0.0.1"
    route = address_towards(master_addr)
    if route is None:
        raise DistNetworkError(
            f"This host has no route to the master address {master_addr!r}, so ranks on other "
            f"hosts could not reach this one; check MASTER_ADDR, or set SHOAL_COLLECTIVES_HOST "
            f"to an address of this host that they can reach.")
    return route


def bind_host_for(store) -> str:
    """`bind_host` for ranks that meet through `store`: the TCPStore's host (under any
    PrefixStores), else MASTER_ADDR. Peers on other hosts reach this rank at the local address
    that routes there."""
    while not hasattr(store, "host") and hasattr(store, "underlying_store"):
        store = store.underlying_store
    return bind_host(getattr(store, "host", None) or os.environ.get("MASTER_ADDR"))


def torchelastic_run_id() -> Optional[str]:
    """TORCHELASTIC_RUN_ID: set by `shoal run` (and torchrun) for the ranks it starts."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or None


def distributed_debug() -> str:
    """SHOAL_DISTRIBUTED_DEBUG, else torch's TORCH_DISTRIBUTED_DEBUG: OFF, INFO or DETAIL.

    Raises:
        SettingError: the level is none of those.
    """
    setting = settings.DISTRIBUTED_DEBUG
    try:
        return setting.get().upper()
    except SettingError as exc:
        raise SettingError(
            f"The debug level must be one of OFF, INFO or DETAIL, got "
            f"{setting.raw().strip().upper()!r} (from {setting.name} or "
            f"{' or '.join(setting.aliases)}).") from exc
