"""gRPC core's process-wide settings that shoal's RPC latency is measured with, applied just
before shoal loads grpc.

Both cut thread hand-offs in gRPC's C core, measured with a bare 64-byte ping-pong between two
processes and in the agent (see bench/rpc.py):
- EventEngine client/listener off: the EventEngine does socket I/O on its own threads and posts
  results to the completion queue a Python thread polls, one more hand-off per message per
  side; the older iomgr path does the I/O on the polling thread itself.
- the `poll` strategy: under iomgr's default `epoll1` every completion queue of the process
  shares one epoll set, so the agent's idle server thread wakes for its client streams'
  messages and passes them on; with `poll` each queue polls only its own connections.

gRPC core reads them from the environment once per process, as grpcio's Cython module
(`grpc._cython.cygrpc`) loads, that is on the process's first `import grpc`; a value set later
changes nothing (grpcio 1.85 checked: GRPC_POLL_STRATEGY=bogus set before that import aborts the
process, set after it is ignored). They cannot be set per channel or per server. Hence:
- importing shoal.rpc_agent neither sets them nor imports grpc;
- `apply()` runs when the agent is about to make its gRPC transport (init_rpc), before shoal
  first imports grpc, and sets each one the user has not set;
- where grpc is loaded already (the script or a library such as aetcd imported it first), they
  could not take effect: nothing is set, and a debug message says so once;
- SHOAL_RPC_GRPC_TUNING=0 leaves the environment alone.
What `apply()` sets holds for every gRPC user in the process, aetcd included, and for child
processes started afterwards, which inherit the environment: the README documents it as the one
process-wide choice.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

from shoal.core.config import SettingError
from shoal.rpc_agent import settings

logger = logging.getLogger(__name__)

GRPC_ENVIRONMENT = {
    "GRPC_EXPERIMENTS": "-event_engine_client,-event_engine_listener",
    "GRPC_POLL_STRATEGY": "poll",
}
# Its variable opts out with 0 (1, the default, applies GRPC_ENVIRONMENT).
ENV_TUNING = settings.GRPC_TUNING.name
# The module whose loading starts gRPC's C core and makes it read its configuration.
GRPC_CORE_MODULE = "grpc._cython.cygrpc"

# gRPC core reads the settings once per process, so they are decided once: by the first agent.
_decided = False
# The GRPC_ENVIRONMENT variables as gRPC core reads them in this process, where the first
# apply() ran before it loaded; None where that is not known (grpc was loaded first).
_read_by_core: Optional[dict] = None


def apply() -> dict[str, str]:
    """Set the variables of GRPC_ENVIRONMENT the user has not set, where gRPC core has not read
    its configuration yet; return those set (none when opted out, too late, or decided by an
    earlier call in this process).

    Raises:
        SettingError: SHOAL_RPC_GRPC_TUNING is neither 0 nor 1 (a ValueError).
    """
    global _decided
    setting = settings.GRPC_TUNING
    try:
        choice = setting.get()
    except SettingError as exc:
        raise SettingError(f"{setting.name} must be 0 or 1, got {setting.raw()!r}.") from exc
    if _decided:
        return {}
    _decided = True
    global _read_by_core
    if GRPC_CORE_MODULE not in sys.modules:
        # What core will read as it loads: these values, whatever apply() sets below.
        _read_by_core = {name: os.environ.get(name) for name in GRPC_ENVIRONMENT}
    if choice == "0":
        return {}
    if GRPC_CORE_MODULE in sys.modules:
        logger.debug(
            "grpc was imported before init_rpc, so gRPC core has read its settings already and "
            "shoal's tuning (%s) does not apply in this process; set these variables before the "
            "first import of grpc to get it.",
            ", ".join(f"{name}={value}" for name, value in GRPC_ENVIRONMENT.items()),
        )
        return {}
    applied = {name: value for name, value in GRPC_ENVIRONMENT.items() if name not in os.environ}
    os.environ.update(applied)
    _read_by_core.update(applied)
    return applied


def poll_without_listener_engine() -> bool:
    """True when this process's gRPC core is known to run iomgr's `poll` strategy with the
    EventEngine listener off (shoal's tuning, or the user's same choice): then the server's
    completion queue polls every accepted connection (transport/direct_server.py)."""
    if _read_by_core is None:
        return False
    experiments = (_read_by_core.get("GRPC_EXPERIMENTS") or "").replace(" ", "").split(",")
    return (_read_by_core.get("GRPC_POLL_STRATEGY") == "poll"
            and "-event_engine_listener" in experiments)
