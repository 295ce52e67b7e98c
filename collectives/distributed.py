"""`init_process_group` and the module-level collectives on the default group, as in
`torch.distributed`: the one module that gathers them (`shoal.collectives` exports these names
lazily from here).

Ranks given to module-level functions (`src`, `dst`, `new_group(ranks)`) are world ranks, as in
torch; `ProcessGroup` methods take the group's own ranks. The functions live by concept:
`groups` (forming and leaving groups), `init_method` (env://, tcp://, file:// and rendezvous),
`world` (the world's state and the questions asked of it), `tensor_collectives`, `p2p` and
`object_collectives`.
"""

from __future__ import annotations

from shoal.collectives.groups import (
    destroy_process_group,
    init_process_group,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
    register_backend,
)
from shoal.collectives.init_method import rendezvous
from shoal.collectives.object_collectives import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from shoal.collectives.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from shoal.collectives.tensor_collectives import (
    _all_gather_base,
    _make_nccl_premul_sum,
    _reduce_scatter_base,
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    monitored_barrier,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
)
from shoal.collectives.types import make_premul_sum
from shoal.collectives.world import (
    GroupMember,
    get_backend,
    get_default_group,
    get_global_rank,
    get_group_rank,
    get_node_local_rank,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    group,
    is_available,
    is_gloo_available,
    is_initialized,
    is_mpi_available,
    is_nccl_available,
    is_torchelastic_launched,
    is_ucc_available,
)

__all__ = [
    "init_process_group", "destroy_process_group", "is_initialized", "get_rank", "get_world_size",
    "get_backend", "new_group", "get_default_group", "get_process_group_ranks", "register_backend",
    "GroupMember", "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_object", "broadcast_object_list", "gather", "scatter", "reduce_scatter",
    "all_to_all", "send", "recv", "isend", "irecv", "barrier", "monitored_barrier",
    "group", "get_group_rank", "get_global_rank", "get_node_local_rank", "is_available",
    "is_gloo_available", "is_nccl_available", "is_mpi_available", "is_ucc_available",
    "is_torchelastic_launched", "new_subgroups", "new_subgroups_by_enumeration",
    "rendezvous", "send_object_list", "recv_object_list", "reduce_scatter_tensor",
    "all_to_all_single", "gather_object", "scatter_object_list",
    "all_reduce_coalesced", "all_gather_coalesced", "P2POp", "batch_isend_irecv",
    "make_premul_sum", "_make_nccl_premul_sum", "reduce_scatter_single", "all_gather_single",
    "_all_gather_base", "_reduce_scatter_base",
]
