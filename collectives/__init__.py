"""Stores, process groups (tcp, nccl), the watchdog and DistributedDataParallel.

Names are imported lazily so that importing `collectives` for a store does not pay for the
backends, and a backend's optional dependency (cupy for nccl) is only needed when used.
"""

from __future__ import annotations

import importlib

from collectives.api import (  # noqa: F401  (re-exports)
    ASYNC_ERROR_EXIT_CODE,
    BackendUnavailable,
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    GroupDestroyed,
    PeerLost,
    ProcessGroup,
    ReduceOp,
    Store,
    StoreError,
    StoreTimeout,
    Work,
)

# public name -> module that defines it
_LAZY = {
    "HashStore": "collectives.store_hash",
    "PrefixStore": "collectives.store_prefix",
    "TCPStore": "collectives.store_tcp",
    "FileStore": "collectives.store_file",
    "ProcessGroupTCP": "collectives.pg_tcp",
    "DistributedDataParallel": "collectives.ddp",
    "DDPError": "collectives.ddp",
    "Join": "collectives.join",
    "Joinable": "collectives.join",
    "JoinHook": "collectives.join",
    "EarlyTermination": "collectives.join",
}
# The torch.distributed-style module-level API lives in collectives.distributed.
_LAZY.update({name: "collectives.distributed" for name in (
    "init_process_group", "destroy_process_group", "is_initialized", "get_rank",
    "get_world_size", "get_backend", "new_group", "get_default_group", "get_process_group_ranks",
    "register_backend", "GroupMember", "all_reduce", "broadcast", "reduce", "all_gather",
    "all_gather_into_tensor", "all_gather_object", "broadcast_object_list", "gather", "scatter",
    "reduce_scatter", "all_to_all", "send", "recv", "isend", "irecv", "barrier",
    "monitored_barrier",
)})


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'collectives' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
