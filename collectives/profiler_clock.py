"""The default process group lends its store to the job profiler, which measures each rank's
clock offset to rank 0 through it (core/profiler/clock.py) before writing a trace window.

The group owns the store, so it hands it down: core never reaches up for one. Keys go under the
group's own prefix, which is new for every incarnation of the group, so a restarted job never
reads an earlier incarnation's pings.
"""

from __future__ import annotations

from shoal.collectives.backends.api import WatchedGroup
from shoal.core.profiler import clock, distributed


def lend_store(group: WatchedGroup) -> None:
    """Let the job profiler measure this rank's clock through `group`'s store (every rank of
    the default group calls it when the group forms). A group of a third-party backend without
    a store of its own lends nothing: its traces then carry no clock estimate.

    It also describes the group for the traces' distributedInfo (backend, rank, members)."""
    ranks = getattr(group, "global_ranks", None)
    distributed.describe_default_group(
        group.name, getattr(group, "backend_name", "") or type(group).__name__, group.rank(),
        group.size(), list(ranks) if ranks is not None else list(range(group.size())))
    store = getattr(group, "store", None)
    prefix = getattr(group, "store_prefix", None)
    if store is None or prefix is None:
        return
    clock.use_store(store, group.rank(), group.size(), f"{prefix}/profiler/clock")


def take_back_store(group: WatchedGroup) -> None:
    """The group is going away (its store may close): the job profiler stops using it."""
    distributed.forget_default_group(group.name)
    store = getattr(group, "store", None)
    if store is not None:
        clock.forget_store(store)
