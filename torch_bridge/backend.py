"""The "shoal" backend of torch.distributed: the creator torch calls for every group it makes
(`init_process_group`, `new_group`, subgroups), and its registration."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.torch_bridge.group import ShoalProcessGroup
from shoal.torch_bridge.store import TorchStore

logger = logging.getLogger(__name__)

__all__ = ["BACKEND_NAME", "create_process_group", "register"]

BACKEND_NAME = "shoal"


def create_process_group(opts: Any, backend_options: Any = None) -> ShoalProcessGroup:
    """torch's extended creator: a shoal tcp group over the store, ranks and timeout torch
    gives (`opts` is a `_DistributedBackendOptions`)."""
    timeout = opts.timeout.total_seconds()
    members = list(opts.global_ranks_in_group)
    # The world is "default", as in shoal's own messages; torch names other groups "1", "2", ...
    name = f"torch-{opts.group_id}" if members else "default"
    group = ProcessGroupTCP(TorchStore(opts.store, timeout), opts.group_rank, opts.group_size,
                            timeout=timeout, name=name, global_ranks=members or None)
    logger.debug("Rank %d: shoal group %r of %d ranks formed for torch", opts.group_rank, name,
                 opts.group_size)
    return ShoalProcessGroup(group)


def register() -> None:
    """Make `init_process_group("shoal")` (and "cpu:shoal") build a `ShoalProcessGroup`;
    calling it again does nothing."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True,
                                  devices=["cpu"])
