"""What the shared machinery (the watchdog, the progress publisher, the dump) needs from a
backend's process group, declared once: `WatchedGroup`, and the `Verdict` it hands back.

`backends.base.BackendGroup` implements the generic half (identity, store, ledger); each
backend supplies the rest. Nothing here reads a group's private attributes.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol

from shoal.collectives.backends.ledger import OpLedger, OpRecord
from shoal.collectives.store.api import Store

__all__ = ["Verdict", "WatchedGroup"]


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The watchdog's decision that a group has failed, and why."""

    kind: str  # "timeout" or "mismatch" (an overdue operation), "error" (an asynchronous error)
    cause: str  # a clause from this rank's view: "rank 0 timed out after 5s in all_reduce #3: ..."
    message: str  # the whole sentence the caller of `record` gets
    culprits: tuple[int, ...]  # the group ranks at fault
    record: Optional[OpRecord]  # the overdue operation, or the one running at an async error
    dump_path: Optional[str]  # this rank's flight-recorder dump, if it could be written


class WatchedGroup(Protocol):
    """A process group as the watchdog and the dump see it."""

    backend_name: str

    @property
    def name(self) -> str:
        """The group's name."""

    def rank(self) -> int:
        """This process's rank in the group."""

    def size(self) -> int:
        """Number of ranks in the group."""

    @property
    def global_rank(self) -> int:
        """This process's rank in the world."""

    @property
    def global_ranks(self) -> list[int]:
        """The world ranks of the group's members, by group rank."""

    @property
    def timeout(self) -> float:
        """The group's default timeout, in seconds."""

    @property
    def store(self) -> Store:
        """The store the group's ranks share (progress is published there)."""

    @property
    def store_prefix(self) -> str:
        """The prefix of this incarnation of the group's keys in the store."""

    @property
    def ledger(self) -> OpLedger:
        """The group's op ledger."""

    @property
    def failed(self) -> bool:
        """True once the group has failed (the watchdog then stops timing operations)."""

    def watchdog_tick(self) -> None:
        """The backend's own periodic work, run in the watchdog's thread every tick."""

    def async_error(self) -> Optional[str]:
        """An error the backend learned of outside any call (NCCL's async error), or None."""

    def fail_from_watchdog(self, verdict: Verdict) -> None:
        """Fail the group: every pending and later operation raises, peers learn why.

        Args:
            verdict: what failed and why; `verdict.record`'s caller gets `verdict.message`.
        """
