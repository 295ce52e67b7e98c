"""The default process group lends its store to the job profiler, which measures each rank's
clock offset to rank 0 through it (core/profiler/clock.py) before writing a trace window.

The group owns the store, so it hands it down: core never reaches up for one. Keys go under the
group's own prefix, which is new for every incarnation of the group, so a restarted job never
reads an earlier incarnation's pings.
"""

from __future__ import annotations

from shoal.collectives.backends.api import WatchedGroup
from shoal.core.profiler import clock


def lend_store(group: WatchedGroup) -> None:
    """Let the job profiler measure this rank's clock through `group`'s store (every rank of
    the default group calls it when the group forms)."""
    clock.use_store(group.store, group.rank(), group.size(),
                    f"{group.store_prefix}/profiler/clock")


def take_back_store(group: WatchedGroup) -> None:
    """The group is going away (its store may close): the job profiler stops using it."""
    clock.forget_store(group.store)
