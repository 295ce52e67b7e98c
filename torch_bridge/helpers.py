"""What torch.distributed's module-level functions cannot reach on a third-party backend."""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from shoal.collectives.api import ProcessGroup as ShoalGroup
from shoal.torch_bridge.group import ShoalProcessGroup

__all__ = ["monitored_barrier", "shoal_group"]


def _bridge_group(group: Optional[Any], what: str) -> ShoalProcessGroup:
    pg = dist.group.WORLD if group is None else group
    if not isinstance(pg, ShoalProcessGroup):
        raise TypeError(
            f"{what} needs a group of the 'shoal' backend, got {type(pg).__name__} "
            f"({dist.get_backend(pg)!r})."
        )
    return pg


def shoal_group(group: Optional[Any] = None) -> ShoalGroup:
    """The shoal process group under a torch group of the "shoal" backend (default: the world):
    its `timeout`, `topology`, op ledger and shoal's own collectives."""
    return _bridge_group(group, "shoal_group").shoal_group


def monitored_barrier(group: Optional[Any] = None, timeout: Any = None,
                      wait_all_ranks: bool = False) -> None:
    """torch's monitored_barrier for "shoal" groups (torch's own accepts gloo groups only):
    rank 0 raises `CollectiveTimeout` naming the ranks that did not arrive within `timeout`."""
    _bridge_group(group, "monitored_barrier").monitored_barrier(timeout, wait_all_ranks)
