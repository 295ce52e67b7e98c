"""Stores, process groups (tcp, nccl), the watchdog and DistributedDataParallel.

Names are imported lazily so that importing `collectives` for a store does not pay for the
backends, numpy or core's tensors, and a backend's optional dependency (cupy for nccl) is only
needed when used.
"""

from __future__ import annotations

import importlib

from shoal.collectives.store.api import Store
from shoal.collectives.types import (
    ASYNC_ERROR_EXIT_CODE,
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    BackendUnavailable,
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    GroupDestroyed,
    PeerLost,
    PremulSum,
    ReduceOp,
    StoreError,
    StoreBindError,
    StoreTimeout,
    StoreUnreachable,
    make_premul_sum,
)

__all__ = [
    "ProcessGroup", "Work", "Store", "Future", "ASYNC_ERROR_EXIT_CODE", "AllgatherOptions",
    "AllreduceCoalescedOptions", "AllreduceOptions", "AllToAllOptions", "BarrierOptions",
    "BroadcastOptions", "GatherOptions", "ReduceOptions", "ReduceScatterOptions", "ScatterOptions",
    "BackendUnavailable", "CollectiveError", "CollectiveMismatch", "CollectiveTimeout",
    "DistBackendError", "DistError", "DistNetworkError", "DistStoreError", "GroupDestroyed",
    "PeerLost", "PremulSum", "ReduceOp", "StoreError", "StoreBindError", "StoreTimeout",
    "StoreUnreachable", "make_premul_sum", "collect_all", "wait_all",
]

# public name -> module that defines it
_LAZY = {
    # api and futures import numpy and core's arrays; a process that needs only a store (the
    # launcher's agent, `shoal store`) never loads them.
    "ProcessGroup": "shoal.collectives.api",
    "Work": "shoal.collectives.api",
    "Future": "shoal.collectives.futures",  # torch.futures.Future
    "collect_all": "shoal.collectives.futures",  # torch.futures.collect_all
    "wait_all": "shoal.collectives.futures",  # torch.futures.wait_all
    "HashStore": "shoal.collectives.store.hash",
    "PrefixStore": "shoal.collectives.store.prefix",
    "TCPStore": "shoal.collectives.store.tcp",
    "FileStore": "shoal.collectives.store.file",
    "ProcessGroupTCP": "shoal.collectives.backends.tcp.group",
    "DistributedDataParallel": "shoal.collectives.ddp.ddp",
    "DDPError": "shoal.collectives.ddp.ddp",
    "GradBucket": "shoal.collectives.ddp.buckets",
    "BuiltinCommHookType": "shoal.collectives.ddp.comm_hooks",
    "Join": "shoal.collectives.ddp.join",
    "Joinable": "shoal.collectives.ddp.join",
    "JoinHook": "shoal.collectives.ddp.join",
    "EarlyTermination": "shoal.collectives.ddp.join",
    "SyncBatchNorm": "shoal.collectives.sync_batchnorm",
    "DistributedSampler": "shoal.collectives.data",
    "set_datapipe_sharding": "shoal.collectives.data",
    "gather_loader_state": "shoal.collectives.data",
}
# The torch.distributed-style module-level API lives in collectives.distributed.
_LAZY.update({name: "shoal.collectives.distributed" for name in (
    "init_process_group", "destroy_process_group", "is_initialized", "get_rank",
    "get_world_size", "get_backend", "new_group", "get_default_group", "get_process_group_ranks",
    "register_backend", "GroupMember", "all_reduce", "broadcast", "reduce", "all_gather",
    "all_gather_into_tensor", "all_gather_object", "broadcast_object_list", "gather", "scatter",
    "reduce_scatter", "all_to_all", "send", "recv", "isend", "irecv", "barrier",
    "monitored_barrier",
)})
_LAZY.update({name: "shoal.collectives.distributed" for name in (
    "group", "get_group_rank", "get_global_rank", "get_node_local_rank", "is_available",
    "is_gloo_available", "is_nccl_available", "is_mpi_available", "is_ucc_available",
    "is_torchelastic_launched", "new_subgroups", "new_subgroups_by_enumeration",
)})
_LAZY.update({name: "shoal.collectives.distributed" for name in (
    "reduce_scatter_tensor", "all_to_all_single", "gather_object", "scatter_object_list",
    "all_reduce_coalesced", "all_gather_coalesced", "P2POp", "batch_isend_irecv",
    "_make_nccl_premul_sum", "_all_gather_base", "_reduce_scatter_base",
    "reduce_scatter_single", "all_gather_single", "rendezvous", "send_object_list",
    "recv_object_list",
)})
_LAZY.update({"Backend": "shoal.collectives.backends.registry"})
_LAZY.update({name: "shoal.collectives.debug" for name in (
    "DebugLevel", "get_debug_level", "set_debug_level", "set_debug_level_from_env",
)})
# The lazy names are public too; `from shoal.collectives import *` imports their modules.
__all__ += sorted(name for name in _LAZY if not name.startswith("_") and name not in __all__)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'collectives' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
