"""Ranks as threads of the test process, each holding its process groups: what the process-group
contract runs on (a group forms in milliseconds this way; spawning costs seconds).

Usage:
    job = ThreadWorld(make_group, world=3)        # forms the default group on 3 threads
    values = job.run(lambda r: job.pgs[r].all_reduce(x[r]))   # fn(world_rank) on every rank
    sub = job.form([0, 2], "sub")                 # world rank -> group, as new_group does
    job.close()                                   # every group shut down, all ranks at once

`make_group(store, rank, size, name=..., global_ranks=..., timeout=...)` builds one rank's group
in that rank's thread (all members at once, since a group forms only when all have joined).
"""

from __future__ import annotations

import threading
import traceback
from typing import Any, Callable, Iterable, Optional

from shoal.collectives.api import ProcessGroup
from shoal.collectives.store.hash import HashStore

FORM_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 30.0


_local = threading.local()


def current_rank() -> Optional[int]:
    """The rank the calling thread runs as (inside `on_threads`), else None."""
    return getattr(_local, "rank", None)


class RankFailed(AssertionError):
    """A rank's function raised or did not return in time; the message names the rank."""


def on_threads(fn: Callable[[int], Any], ranks: Iterable[int], timeout: float) -> dict[int, Any]:
    """fn(rank) on one thread per rank; rank -> its return value or the exception it raised."""
    ranks = list(ranks)
    out: dict[int, Any] = {}

    def body(r: int) -> None:
        _local.rank = r
        try:
            out[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001  (the caller decides whether an exception is a failure)
            exc.__rank_traceback__ = traceback.format_exc()
            out[r] = exc

    threads = {r: threading.Thread(target=body, args=(r,), name=f"rank-{r}", daemon=True)
               for r in ranks}
    for t in threads.values():
        t.start()
    for t in threads.values():
        t.join(timeout)
    hung = [r for r, t in threads.items() if t.is_alive()]
    if hung:
        raise RankFailed(f"Ranks {hung} did not return within {timeout:g}s.")
    return out


def raise_first(results: dict[int, Any]) -> None:
    """Fail naming the first rank whose result is an exception, with its traceback."""
    for r, value in sorted(results.items()):
        if isinstance(value, BaseException):
            raise RankFailed(
                f"rank {r} raised {type(value).__name__}: {value}\n"
                f"{getattr(value, '__rank_traceback__', '')}"
            ) from value


class ThreadWorld:
    """`world` thread ranks sharing a HashStore, with the default group formed."""

    def __init__(self, make_group: Callable[..., ProcessGroup], world: int,
                 timeout: float = 10.0):
        self.world = world
        self.timeout = timeout
        self.store = HashStore()
        self._make_group = make_group
        self._formed: list[ProcessGroup] = []
        try:
            groups = self.form(range(world), "default")
        except BaseException:
            self.close()  # the ranks that did form leave again
            raise
        self.pgs = [groups[r] for r in range(world)]

    def form(self, members: Iterable[int], name: str,
             timeout: Optional[float] = None) -> dict[int, ProcessGroup]:
        """A group of the world ranks `members` (sorted), as `new_group` builds it: world rank ->
        that rank's group (whose own rank is its index in `members`)."""
        members = sorted(members)
        seconds = self.timeout if timeout is None else timeout

        def make(world_rank: int) -> ProcessGroup:
            return self._make_group(self.store, members.index(world_rank), len(members),
                                    name=name, global_ranks=list(members), timeout=seconds)

        results = on_threads(make, members, FORM_TIMEOUT_S)
        self._formed.extend(g for g in results.values() if isinstance(g, ProcessGroup))
        raise_first(results)
        return results

    def run(self, fn: Callable[[int], Any], ranks: Optional[Iterable[int]] = None,
            timeout: float = RUN_TIMEOUT_S) -> list:
        """fn(world_rank) on every rank (or `ranks`); their values, failing if any raised."""
        ranks = list(range(self.world) if ranks is None else ranks)
        results = on_threads(fn, ranks, timeout)
        raise_first(results)
        return [results[r] for r in ranks]

    def outcomes(self, fn: Callable[[int], Any], ranks: Optional[Iterable[int]] = None,
                 timeout: float = RUN_TIMEOUT_S) -> list:
        """As `run`, but a rank's exception is its value instead of a failure."""
        ranks = list(range(self.world) if ranks is None else ranks)
        results = on_threads(fn, ranks, timeout)
        return [results[r] for r in ranks]

    def close(self) -> None:
        """Shut every group down, all ranks at once (a rank's goodbye waits for its peers')."""
        groups = list(self._formed)
        self._formed.clear()
        on_threads(lambda i: groups[i].shutdown(), range(len(groups)), FORM_TIMEOUT_S)
