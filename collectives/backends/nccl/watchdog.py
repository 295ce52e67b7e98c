"""The nccl backend's watchdog: finishes work whose events fired, and fails the group on a
timeout or on NCCL's asynchronous error.

It polls, every tick, the events of the group's outstanding work (oldest first: they finish in
order on the group's stream) and the communicator's async error. On an overdue collective it
reads the other ranks' progress from the store to name who never arrived (or who called a
different collective at that sequence number), writes the same JSON dump as the tcp backend,
and hands the group its failure: the group aborts the communicator from a separate thread with
its own deadline, fails every outstanding work, and with SHOAL_ASYNC_ERROR_HANDLING=1 ends the
process. A publisher thread writes this rank's progress to the store for the others' watchdogs.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Optional

from shoal.collectives import metrics
from shoal.collectives.constants import (
    PROGRESS_EAGER_AFTER_S,
    PROGRESS_PUBLISH_S,
    PROGRESS_QUERY_TIMEOUT_S,
    WATCHDOG_TICK_S,
)
from shoal.collectives.backends.watchdog import _ranks, write_dump

if TYPE_CHECKING:  # pragma: no cover
    from shoal.collectives.backends.nccl.work import NcclWork
    from shoal.collectives.backends.nccl.group import ProcessGroupNCCL

logger = logging.getLogger(__name__)

__all__ = ["NcclWatchdog"]


class NcclWatchdog:
    """Watches one nccl group's outstanding work and publishes this rank's progress."""

    def __init__(self, pg: "ProcessGroupNCCL", tick: float = WATCHDOG_TICK_S):
        self.pg = pg
        self._tick = tick
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._inflight: collections.deque["NcclWork"] = collections.deque()
        self._published: Optional[tuple] = None
        self._published_at = 0.0
        self._thread = threading.Thread(
            target=self._watch, name=f"shoal-nccl-{pg.name}-watchdog", daemon=True
        )
        self._publisher = threading.Thread(
            target=self._publish_loop, name=f"shoal-nccl-{pg.name}-progress", daemon=True
        )

    def start(self) -> "NcclWatchdog":
        self._thread.start()
        self._publisher.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def track(self, work: "NcclWork") -> None:
        """Watch `work` from now on (before it is enqueued, so a hang while enqueuing counts)."""
        with self._lock:
            self._inflight.append(work)

    def outstanding(self) -> list["NcclWork"]:
        """Work not yet seen finished, oldest first."""
        with self._lock:
            return [w for w in self._inflight if not w._done]

    # ------------------------------------------------------------------ polling

    def _watch(self) -> None:
        pg = self.pg
        try:
            # Callbacks run here; they see the group's device as current.
            pg._rt.use_device(pg.device)
        except Exception:  # the device is the caller's problem, not the watchdog's
            logger.debug("watchdog could not select device %s", pg.device, exc_info=True)
        while not self._stop.wait(self._tick):
            try:
                self.poll_once()
            except Exception:  # the watchdog must survive its own errors
                logger.exception("Rank %d's nccl watchdog failed in one round", pg.rank())

    def poll_once(self) -> None:
        """One round: finish fired work, time out the oldest overdue one, check async errors."""
        pg = self.pg
        now = time.monotonic()
        overdue = None
        with self._lock:
            works = list(self._inflight)
        finished = 0
        for work in works:
            if work.poll(caller=False):
                finished += 1
                continue
            rec = work.record
            if rec.started is not None and now - rec.started > rec.timeout:
                overdue = work
            break  # later work cannot finish before this one on the group's stream
        if finished:
            with self._lock:
                while self._inflight and self._inflight[0]._done:
                    self._inflight.popleft()
        if pg.failed:
            return
        if overdue is not None:
            self.on_timeout(overdue)
            return
        error = pg._async_error()
        if error is not None:
            self.on_async_error(error)

    # ------------------------------------------------------------------ failures

    def on_timeout(self, work: "NcclWork") -> None:
        """Diagnose the overdue `work`, dump, and fail the group with CollectiveTimeout."""
        pg = self.pg
        rec = work.record
        me = pg.rank()
        progress = None
        mismatch = False
        if rec.p2p:
            clause = "its point-to-point peer never matched it"
            culprits: list[int] = []
        else:
            progress = self._read_progress()
            if progress is None:
                clause = ("the other ranks' progress could not be read from the store (it did not "
                          f"answer within {PROGRESS_QUERY_TIMEOUT_S:g}s)")
                culprits = []
            else:
                missing = sorted(q for q, p in progress.items() if p["started"] < rec.seq)
                other = sorted(q for q, p in progress.items()
                               if p["started"] == rec.seq and p["desc"] and p["desc"] != rec.desc)
                stuck = sorted(q for q, p in progress.items() if p["finished"] < rec.seq)
                if other:
                    mismatch = True
                    q = other[0]
                    clause = (f"rank {q} called {progress[q]['desc']} as collective #{rec.seq} "
                              f"but this rank called {rec.desc}; every rank must call the same "
                              "collectives in the same order with the same shapes and dtypes")
                    culprits = [me, q]
                elif missing:
                    clause = f"{_ranks(missing)} never arrived"
                    culprits = missing
                elif stuck:
                    clause = f"every rank arrived but {_ranks(stuck)} did not finish"
                    culprits = stuck
                else:
                    clause = "every other rank reports it finished; this rank's NCCL kernels stalled"
                    culprits = []
        t = f"{rec.timeout:g}s"
        cause = f"rank {me} timed out after {t} in {rec.label}: {clause}"
        message = f"Rank {me} timed out after {t} in {rec.label} of group '{pg.name}': {clause}."
        path = write_dump(pg, message, rec, {str(k): v for k, v in (progress or {}).items()})
        if path:
            message += f" This rank's recent collectives are in {path}."
        metrics.count_timeout(rec.op)
        logger.error("%s", message)
        pg._fail_group("mismatch" if mismatch else "timeout", cause, work, message, culprits)

    def on_async_error(self, error: str) -> None:
        """NCCL reported an asynchronous error: fail the group with CollectiveError."""
        pg = self.pg
        cause = f"NCCL reported an asynchronous error on rank {pg.rank()}: {error}"
        path = write_dump(pg, f"Group '{pg.name}' failed: {cause}.", pg._ledger.current)
        logger.error("Rank %d: group %r: %s (dump: %s)", pg.rank(), pg.name, cause, path)
        pg._fail_group("error", cause, None, None, [pg.rank()], dump_path=path)

    # ------------------------------------------------------------------ progress

    def _progress_key(self, rank: int) -> str:
        return f"{self.pg._prefix}/progress/{rank}"

    def _state(self) -> tuple:
        ledger = self.pg._ledger
        cur = ledger.current
        desc = cur.desc if cur is not None and not cur.p2p and cur.seq == ledger.started_seq else ""
        return ledger.started_seq, ledger.finished_seq, desc

    def _publish_loop(self) -> None:
        pg = self.pg
        while not self._stop.wait(self._tick):
            state = self._state()
            if state == self._published:
                continue
            now = time.monotonic()
            cur = pg._ledger.current
            slow = (cur is not None and cur.started is not None
                    and now - cur.started > PROGRESS_EAGER_AFTER_S)
            if not slow and now - self._published_at < PROGRESS_PUBLISH_S:
                continue
            doc = json.dumps({"started": state[0], "finished": state[1], "desc": state[2]})
            try:
                pg._store.set(self._progress_key(pg.rank()), doc)
                self._published = state
                self._published_at = now
            except Exception as exc:  # the store may be gone with its host rank; keep watching
                logger.debug("Rank %d could not publish nccl progress: %s", pg.rank(), exc)
                self._stop.wait(1.0)

    def _read_progress(self) -> Optional[dict]:
        """Other ranks' progress from the store, or None if it does not answer in time."""
        pg = self.pg
        result: dict = {}
        failed: list = []

        def query() -> None:
            for q in range(pg.size()):
                if q == pg.rank():
                    continue
                key = self._progress_key(q)
                try:
                    if pg._store.check([key]):
                        result[q] = json.loads(pg._store.get(key, timeout=1.0))
                    else:
                        result[q] = {"started": 0, "finished": 0, "desc": ""}
                except Exception as exc:  # noqa: BLE001
                    failed.append(exc)
                    return

        t = threading.Thread(target=query, daemon=True, name="shoal-nccl-progress-query")
        t.start()
        t.join(PROGRESS_QUERY_TIMEOUT_S)
        if t.is_alive() or failed:
            return None
        return result
