"""`BackendGroup`: what every backend's process group shares, written once.

It checks the constructor's common arguments (the store, the world ranks of the members),
owns the group's `OpLedger` and `Watchdog`, answers the generic half of
`backends.api.WatchedGroup`, and keeps the registry of live groups that closes them at
interpreter exit (so that a script ending without destroy_process_group does not look like a
crash to its peers). A backend subclasses it, implements the collectives' `_` hooks and the
rest of `WatchedGroup`, calls `_start_watchdog()` once it is formed and `_leave()` first in
`shutdown()`.
"""

from __future__ import annotations

import abc
import atexit
import logging
import weakref
from typing import Optional, Sequence

from shoal.collectives.api import ProcessGroup
from shoal.collectives.backends.api import Verdict
from shoal.collectives.backends.ledger import OpLedger
from shoal.collectives.backends.watchdog import Watchdog
from shoal.collectives.constants import WATCHDOG_TICK_S
from shoal.collectives.store.api import Store
from shoal.core.timeouts import TimeoutLike

logger = logging.getLogger(__name__)

__all__ = ["BackendGroup"]

# Groups of any backend still open in this process, shut down at interpreter exit.
_LIVE: "weakref.WeakSet[BackendGroup]" = weakref.WeakSet()


def _close_live_groups() -> None:
    for group in list(_LIVE):
        try:
            group.shutdown()
        except Exception:
            logger.debug("Shutting down group %r at exit failed", group.name, exc_info=True)


atexit.register(_close_live_groups)


def _checked_global_ranks(global_ranks: Optional[Sequence[int]], size: int) -> tuple[int, ...]:
    ranks = tuple(global_ranks) if global_ranks is not None else tuple(range(size))
    if len(ranks) != size:
        raise ValueError(f"global_ranks has {len(ranks)} entries for a group of {size}.")
    return ranks


class BackendGroup(ProcessGroup):
    """A process group of some backend, watched by the shared watchdog.

    Args:
        store: where ranks meet and publish their progress (shared by all ranks).
        rank: this process's rank in the group.
        size: the number of ranks.
        timeout: default timeout of every operation (and of forming the group).
        name: the group's name, unique per concurrently existing group.
        global_ranks: the world ranks of this group's members, for messages and dumps.

    Raises:
        TypeError: `store` is not a `collectives.Store`.
        ValueError: `global_ranks` does not have `size` entries.
    """

    def __init__(self, store: Store, rank: int, size: int, timeout: TimeoutLike, name: str,
                 global_ranks: Optional[Sequence[int]]):
        super().__init__(rank, size, name, timeout)
        if not isinstance(store, Store):
            raise TypeError(
                f"{type(self).__name__} needs a collectives.Store, got {type(store).__name__}."
            )
        self._store = store
        self._global_ranks = _checked_global_ranks(global_ranks, size)
        self._ledger = OpLedger()
        self._ledger.group = name  # profiler events name the group (subgroups apart)
        self._ledger.backend = getattr(self, "backend_name", "")
        self._ledger.global_ranks = self._global_ranks
        self._watchdog: Optional[Watchdog] = None
        self._destroyed = False

    @classmethod
    def check_backend_availability(cls) -> Optional[str]:
        """None where this backend can run; otherwise the sentence that says why not."""
        return None

    # ------------------------------------------------------------------ WatchedGroup

    @property
    def store(self) -> Store:
        """The store the group's ranks share."""
        return self._store

    @property
    def global_ranks(self) -> list[int]:
        """The world ranks of the group's members, by group rank."""
        return list(self._global_ranks)

    @property
    def global_rank(self) -> int:
        """This process's rank in the world."""
        return self._global_ranks[self._rank]

    @property
    def ledger(self) -> OpLedger:
        """The group's op ledger (sequence numbers and recent operations)."""
        return self._ledger

    @property
    @abc.abstractmethod
    def store_prefix(self) -> str:
        """The prefix of this incarnation of the group's keys in the store."""

    @property
    @abc.abstractmethod
    def failed(self) -> bool:
        """True once the group has failed."""

    @property
    @abc.abstractmethod
    def failure(self) -> Optional[str]:
        """Why the group failed (a sentence), or None while it is healthy."""

    def watchdog_tick(self) -> None:
        """The backend's own periodic work, in the watchdog's thread (none by default)."""

    def async_error(self) -> Optional[str]:
        """An error the backend learned of outside any call (none by default)."""
        return None

    @abc.abstractmethod
    def fail_from_watchdog(self, verdict: Verdict) -> None:
        """Fail the group for the watchdog's `verdict` (see `WatchedGroup`)."""

    # ------------------------------------------------------------------ lifecycle

    def _start_watchdog(self, tick: float = WATCHDOG_TICK_S) -> None:
        """Start watching (once the group is formed) and close the group at exit."""
        self._watchdog = Watchdog(self, tick).start()
        _LIVE.add(self)

    def _leave(self) -> bool:
        """The shared first step of `shutdown()`: False if the group was left already."""
        if self._destroyed:
            return False
        self._destroyed = True
        _LIVE.discard(self)
        if self._watchdog is not None:
            self._watchdog.stop()
        return True
