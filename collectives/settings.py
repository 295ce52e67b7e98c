"""The `SHOAL_*` variables the collectives layer reads (see `core.config`); `collectives.env`
turns them into the values its callers use."""

from __future__ import annotations

from shoal.core.config import Setting, SettingsTable

ASYNC_ERROR_HANDLING = Setting(
    "SHOAL_ASYNC_ERROR_HANDLING", "bool", False,
    "A failed collective ends the process with ASYNC_ERROR_EXIT_CODE, so that the agent "
    "restarts the job instead of waiting on a rank that cannot go on.", set_by="shoal run")
DUMP_DIR = Setting(
    "SHOAL_DUMP_DIR", "path", None,
    "Where the watchdog writes a group's record of its collectives when one fails or hangs "
    "(unset: the system's temporary directory).")
COLLECTIVE_TIMEOUT = Setting(
    "SHOAL_COLLECTIVE_TIMEOUT", "float", None,
    "Seconds: the default timeout of a process group and its collectives when "
    "init_process_group is given none (unset: 600).",
    positive=True, set_by="shoal run --collective-timeout")
LOCAL_TRANSPORT = Setting(
    "SHOAL_LOCAL_TRANSPORT", "choice", "shm",
    "How the tcp backend links ranks on the same host: shm (abstract Unix sockets, plus shared "
    "memory for large all_reduces when every rank of a group shares the host), unix (the "
    "sockets only) or tcp (TCP over loopback).",
    choices=("shm", "unix", "tcp"))
HIERARCHICAL = Setting(
    "SHOAL_HIERARCHICAL", "bool", True,
    "Whether tcp groups that span hosts run their large collectives in two levels (shared "
    "memory within a host, TCP between hosts); 0 runs the flat algorithms over sockets.")
HIER_LEADERS = Setting(
    "SHOAL_HIER_LEADERS", "int", None,
    "At most this many ranks per host carry a share of the two-level collectives' traffic "
    "between hosts (unset: every rank of the smallest host). Every rank must use the same value.",
    positive=True)
HIER_PIPELINE = Setting(
    "SHOAL_HIER_PIPELINE", "bool", None,
    "1 pipelines two-level all_reduces (a leader's transfer between hosts overlaps its host's "
    "shared-memory work on the next piece), 0 runs the phases one after the other; unset, the "
    "group decides by cores per rank. Every rank must agree, or none pipelines.")
P2P_DIRECT = Setting(
    "SHOAL_P2P_DIRECT", "bool", True,
    "Whether point-to-point messages from 8 MiB between ranks of one host are written straight "
    "into the receiving array (process_vm_writev, one copy); 0 keeps them in the shared-memory "
    "rings (two copies), for hosts whose policy forbids one process writing into another's "
    "memory. Ranks may differ: a pair writes directly only when both allow it.")
SPIN_US = Setting(
    "SHOAL_SPIN_US", "float", None,
    "Microseconds a small receive polls before it blocks (unset: the backend's default when "
    "this process may use a core per rank of the group, else 0).",
    minimum=0)
USE_AGENT_STORE = Setting(
    "SHOAL_USE_AGENT_STORE", "bool", False,
    "The store at MASTER_ADDR:MASTER_PORT is hosted by the launcher's agent, so rank 0 "
    "connects to it as a client.",
    aliases=("TORCHELASTIC_USE_AGENT_STORE",), set_by="shoal run")
COLLECTIVES_HOST = Setting(
    "SHOAL_COLLECTIVES_HOST", "str", None,
    "The address this rank's backend listens on and advertises to its peers; it must be an "
    "address of this host (unset: loopback when the master is on this host, else the local "
    "address that routes to the master).")
DISTRIBUTED_DEBUG = Setting(
    "SHOAL_DISTRIBUTED_DEBUG", "choice", "off",
    "torch.distributed's debug level (OFF, INFO or DETAIL): extra checks and logs.",
    choices=("off", "info", "detail"), aliases=("TORCH_DISTRIBUTED_DEBUG",))

TABLE = SettingsTable(
    "collectives", "Stores, process groups, the watchdog and DistributedDataParallel.",
    (ASYNC_ERROR_HANDLING, DUMP_DIR, COLLECTIVE_TIMEOUT, LOCAL_TRANSPORT, HIERARCHICAL,
     HIER_LEADERS, HIER_PIPELINE, P2P_DIRECT, SPIN_US, USE_AGENT_STORE, COLLECTIVES_HOST,
     DISTRIBUTED_DEBUG))
