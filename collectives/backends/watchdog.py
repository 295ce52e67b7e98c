"""The watchdog: fails overdue operations with a diagnosis instead of letting ranks hang; one
for every backend, through `backends.api.WatchedGroup`.

Each group has one watchdog thread and one progress publisher. The publisher writes this
rank's progress to the store (`backends.progress`: often while an operation is slow, rarely
otherwise), so a rank that times out can read everyone's and name the ranks that never arrived.
Every tick the watchdog runs the backend's own periodic work (the nccl backend finishes work
whose CUDA events fired), then times the operation that has been running longest. On a timeout
it reads the other ranks' progress, writes the flight-recorder dump and hands the group a
`Verdict`; the group fails every pending operation, tells its peers where it can, and with
SHOAL_ASYNC_ERROR_HANDLING=1 ends the process with `ASYNC_ERROR_EXIT_CODE` so that the elastic
agent restarts the job. An asynchronous error the backend reports fails the group the same way.
The publisher is a thread of its own because a store write may block (the store's host rank may
be the one that hangs), and the watchdog must keep timing meanwhile.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Optional

from shoal.collectives import metrics
from shoal.collectives.backends import progress as progress_
from shoal.collectives.backends.api import Verdict, WatchedGroup
from shoal.collectives.backends.dump import write_dump
from shoal.collectives.backends.ledger import OpRecord
from shoal.collectives.constants import (
    PROGRESS_EAGER_AFTER_S,
    PROGRESS_PUBLISH_S,
    PROGRESS_QUERY_TIMEOUT_S,
    WATCHDOG_TICK_S,
)
from shoal.collectives.types import ASYNC_ERROR_EXIT_CODE

logger = logging.getLogger(__name__)

__all__ = ["Watchdog", "exit_after_error"]


def exit_after_error(message: str) -> None:
    """End the process with ASYNC_ERROR_EXIT_CODE (SHOAL_ASYNC_ERROR_HANDLING=1)."""
    logger.critical("%s Ending this process with exit code %d (SHOAL_ASYNC_ERROR_HANDLING=1).",
                    message, ASYNC_ERROR_EXIT_CODE)
    try:
        sys.stderr.write(f"shoal: {message} Exiting with code {ASYNC_ERROR_EXIT_CODE}.\n")
        sys.stderr.flush()
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os._exit(ASYNC_ERROR_EXIT_CODE)


class Watchdog:
    """Watches one group's running operations and publishes this rank's progress."""

    def __init__(self, group: WatchedGroup, tick: float = WATCHDOG_TICK_S):
        self.group = group
        self._tick = tick
        self._stop = threading.Event()
        self._handled: set[tuple[bool, int]] = set()
        self._published: Optional[progress_.RankProgress] = None
        self._published_at = 0.0
        self._waiting_in: Optional[OpRecord] = None  # the long collective last reported
        self._waiting_for: dict[int, float] = {}  # whom it waits for, as last read
        self._wait_read_at = 0.0  # when to read the others' progress next (monotonic)
        prefix = f"shoal-{group.backend_name}-{group.name}"
        self._thread = threading.Thread(target=self._watch, name=f"{prefix}-watchdog",
                                        daemon=True)
        self._publisher = threading.Thread(target=self._publish_loop, name=f"{prefix}-progress",
                                           daemon=True)

    def start(self) -> "Watchdog":
        """Start both threads; returns self."""
        self._thread.start()
        self._publisher.start()
        return self

    def stop(self) -> None:
        """Stop both threads at their next tick."""
        self._stop.set()

    # ------------------------------------------------------------------ progress

    def _publish_loop(self) -> None:
        try:
            while not self._stop.wait(self._tick):
                self._publish_once()
                self._report_wait()
        finally:
            metrics.WAITS.update(id(self), 0.0, {})

    def _publish_once(self) -> None:
        group = self.group
        ledger = group.ledger
        state = progress_.snapshot(ledger)
        if state == self._published:
            return
        now = time.monotonic()
        cur = ledger.current
        slow = (cur is not None and cur.started is not None
                and now - cur.started > PROGRESS_EAGER_AFTER_S)
        if not slow and now - self._published_at < PROGRESS_PUBLISH_S:
            return
        try:
            group.store.set(progress_.progress_key(group.store_prefix, group.rank()),
                            progress_.encode(state))
            self._published = state
            self._published_at = now
        # The store may be gone with its host rank, or fail in any way a store can: the
        # watchdog must keep watching this group's operations whatever publishing hit.
        except Exception as exc:  # noqa: BLE001 - logged; watching outlives the store
            logger.debug("Rank %d could not publish progress: %s", group.rank(), exc)
            self._stop.wait(1.0)

    def _report_wait(self) -> None:
        """Publish (collectives.metrics) since when this rank is inside a collective, once one
        has run for WAIT_REPORT_AFTER_S, and whom it waits for: the others' progress names the
        ranks that never arrived, as a timeout's diagnosis would, long before the timeout.

        Reading that progress costs a store read per rank of the group, from every waiting
        rank, so it starts later in large groups (metrics.wait_read_after) and then backs off:
        the next read comes after as long again as the collective has run (capped at
        WAIT_READ_MAX_S), so a legitimately long collective costs a few reads, not one a second.
        """
        group = self.group
        cur = group.ledger.current
        now = time.monotonic()
        started = None if cur is None or cur.p2p or cur.finished is not None else cur.started
        if started is None or now - started < metrics.WAIT_REPORT_AFTER_S:
            if self._waiting_in is not None:
                self._waiting_in = None
                metrics.WAITS.update(id(self), 0.0, {})
            return
        since = time.time() - (now - started)
        if self._waiting_in is not cur:
            self._waiting_in, self._waiting_for = cur, {}
            self._wait_read_at = started + metrics.wait_read_after(group.size())
            metrics.WAITS.update(id(self), since, {})
        if now < self._wait_read_at:
            return
        self._wait_read_at = now + min(metrics.WAIT_READ_MAX_S, now - started)
        me = group.rank()
        progress = progress_.read_all(group.store, group.store_prefix, me, group.size(),
                                      PROGRESS_QUERY_TIMEOUT_S)
        if progress is not None and cur.finished is None:
            world = group.global_ranks
            diagnosis = progress_.diagnose(cur, me, progress, PROGRESS_QUERY_TIMEOUT_S)
            self._waiting_for = {world[q]: since for q in diagnosis.culprits if q != me}
        metrics.WAITS.update(id(self), since if cur.finished is None else 0.0,
                             self._waiting_for)

    # ------------------------------------------------------------------ timeouts

    def _watch(self) -> None:
        while not self._stop.wait(self._tick):
            try:
                self.check_once()
            except Exception:  # the watchdog must survive its own errors
                logger.exception("Rank %d's watchdog failed in one round", self.group.rank())

    def check_once(self) -> None:
        """One round: the backend's periodic work, then timeouts and asynchronous errors."""
        group = self.group
        group.watchdog_tick()
        if group.failed:
            return
        rec = group.ledger.oldest_running()
        if rec is not None:
            started = rec.started
            if (started is not None and rec.finished is None
                    and time.monotonic() - started > rec.timeout):
                key = (rec.p2p, rec.seq)
                if key not in self._handled:
                    self._handled.add(key)
                    self.on_timeout(rec)
                    return
        error = group.async_error()
        if error is not None:
            self.on_async_error(error)

    def on_timeout(self, rec: OpRecord) -> None:
        """Diagnose the overdue `rec`, dump, and fail the group."""
        group = self.group
        me = group.rank()
        progress = None
        if not rec.p2p:
            progress = progress_.read_all(group.store, group.store_prefix, me, group.size(),
                                          PROGRESS_QUERY_TIMEOUT_S)
        diagnosis = progress_.diagnose(rec, me, progress, PROGRESS_QUERY_TIMEOUT_S)
        t = f"{rec.timeout:g}s"
        cause = f"rank {me} timed out after {t} in {rec.label}: {diagnosis.clause}"
        message = (f"Rank {me} timed out after {t} in {rec.label} of group '{group.name}': "
                   f"{diagnosis.clause}.")
        path = write_dump(group, message, rec, progress)
        if path:
            message += f" This rank's recent collectives are in {path}."
        metrics.count_timeout(rec.op)
        logger.error("%s", message)
        group.fail_from_watchdog(Verdict(diagnosis.kind, cause, message, diagnosis.culprits,
                                         rec, path))

    def on_async_error(self, error: str) -> None:
        """The backend reported an asynchronous error: fail the group with it."""
        group = self.group
        me = group.rank()
        cause = f"{group.backend_name.upper()} reported an asynchronous error on rank {me}: {error}"
        message = f"Rank {me}'s {group.backend_name} group '{group.name}' failed: {cause}."
        rec = group.ledger.current
        path = write_dump(group, message, rec)
        logger.error("Rank %d: group %r: %s (dump: %s)", me, group.name, cause, path)
        group.fail_from_watchdog(Verdict("error", cause, message, (me,), rec, path))
