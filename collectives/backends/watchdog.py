"""The watchdog: fails overdue collectives with a diagnosis instead of letting ranks hang.

Each group has one watchdog thread and one progress publisher. The publisher writes this
rank's last started and finished sequence numbers to the store (often while a collective is
slow, rarely otherwise), so a rank that times out can read everyone's progress and name the
ranks that never arrived. On a timeout the watchdog writes a JSON dump of this rank's recent
collectives, fails the group with `CollectiveTimeout` (which tells every peer why and breaks
the connections so blocked threads return), and with SHOAL_ASYNC_ERROR_HANDLING=1 ends the
process with `ASYNC_ERROR_EXIT_CODE` so the elastic agent restarts the group.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Optional

from shoal.collectives import env
from shoal.collectives import metrics
from shoal.collectives.types import ASYNC_ERROR_EXIT_CODE
from shoal.collectives.constants import (
    PROGRESS_EAGER_AFTER_S,
    PROGRESS_PUBLISH_S,
    PROGRESS_QUERY_TIMEOUT_S,
    WATCHDOG_TICK_S,
)

if TYPE_CHECKING:  # pragma: no cover
    from shoal.collectives.backends.tcp.group import ProcessGroupTCP

logger = logging.getLogger(__name__)

__all__ = ["Watchdog", "write_dump", "exit_after_error", "ASYNC_ERROR_EXIT_CODE"]


_dump_ids = itertools.count(1)


def _ranks(ranks) -> str:
    ranks = list(ranks)
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{word} {', '.join(map(str, ranks))}"


def write_dump(pg: "ProcessGroupTCP", reason: str, record=None, progress: Optional[dict] = None) -> Optional[str]:
    """Write this rank's recent collectives as JSON; returns the file's path (None on failure)."""
    engine = pg._engine
    entries = [r.as_dict() for r in list(engine.history)]
    doc = {
        "group": pg.name,
        "rank": pg.rank(),
        "global_rank": pg.global_rank,
        "world_size": pg.size(),
        "backend": pg.backend_name,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),
        "reason": reason,
        "timeout_s": pg.timeout,
        "failed_op": record.as_dict() if record is not None else None,
        "last_started_seq": engine.started_seq,
        "last_finished_seq": engine.finished_seq,
        "progress_of_ranks": progress,
        "entries": entries,
    }
    directory = env.dump_dir()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    safe_group = "".join(c if c.isalnum() or c in "-_" else "_" for c in pg.name)
    # Two threads of one rank may dump at once (its own timeout and a peer's relayed one).
    path = os.path.join(
        directory,
        f"shoal-collectives-{safe_group}-rank{pg.rank()}-pid{os.getpid()}-{stamp}-{next(_dump_ids)}.json",
    )
    try:
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.replace(tmp, path)
        return path
    except OSError as exc:
        logger.error("Rank %d of group %r could not write its collectives dump to %s: %s",
                     pg.rank(), pg.name, path, exc)
        return None


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
    """Watches one group's running operation and publishes this rank's progress."""

    def __init__(self, pg: "ProcessGroupTCP"):
        self.pg = pg
        self._stop = threading.Event()
        self._handled: set = set()
        self._published: Optional[tuple[int, int]] = None
        self._published_at = 0.0
        self._thread = threading.Thread(
            target=self._watch, name=f"shoal-pg-{pg.name}-watchdog", daemon=True
        )
        self._publisher = threading.Thread(
            target=self._publish_loop, name=f"shoal-pg-{pg.name}-progress", daemon=True
        )

    def start(self) -> "Watchdog":
        self._thread.start()
        self._publisher.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ progress

    def _progress_key(self, rank: int) -> str:
        return f"{self.pg._mesh.prefix}/progress/{rank}"

    def _publish_loop(self) -> None:
        engine = self.pg._engine
        ticks = 0
        while not self._stop.wait(WATCHDOG_TICK_S):
            ticks += 1
            if ticks % 10 == 0:
                self.pg._adapt_to_load()
            state = (engine.started_seq, engine.finished_seq)
            if state == self._published:
                continue
            now = time.monotonic()
            cur = engine.current
            slow = cur is not None and cur.started is not None and now - cur.started > PROGRESS_EAGER_AFTER_S
            if not slow and now - self._published_at < PROGRESS_PUBLISH_S:
                continue
            try:
                self.pg._store.set(self._progress_key(self.pg.rank()), f"{state[0]},{state[1]}")
                self._published = state
                self._published_at = now
            except Exception as exc:  # the store may be gone with its host rank; keep watching
                logger.debug("Rank %d could not publish progress: %s", self.pg.rank(), exc)
                self._stop.wait(1.0)

    def _read_progress(self) -> Optional[dict]:
        """Other ranks' (started, finished) from the store, or None if it does not answer."""
        result: dict = {}
        store = self.pg._store
        me = self.pg.rank()

        def query():
            for q in range(self.pg.size()):
                if q == me:
                    continue
                key = self._progress_key(q)
                try:
                    if store.check([key]):
                        started, finished = store.get(key, timeout=1.0).decode().split(",")
                        result[q] = (int(started), int(finished))
                    else:
                        result[q] = (0, 0)
                except Exception as exc:
                    result["error"] = str(exc)
                    return

        t = threading.Thread(target=query, daemon=True, name="shoal-progress-query")
        t.start()
        t.join(PROGRESS_QUERY_TIMEOUT_S)
        if t.is_alive() or "error" in result:
            return None
        return result

    # ------------------------------------------------------------------ timeouts

    def _watch(self) -> None:
        engine = self.pg._engine
        while not self._stop.wait(WATCHDOG_TICK_S):
            rec = engine.current
            if rec is None or rec.started is None or rec.finished is not None:
                continue
            if time.monotonic() - rec.started <= rec.timeout:
                continue
            key = (rec.p2p, rec.seq)
            if key in self._handled:
                continue
            self._handled.add(key)
            try:
                self.on_timeout(rec)
            except Exception:  # the watchdog must survive its own errors
                logger.exception("Rank %d's watchdog failed while handling a timeout", self.pg.rank())

    def on_timeout(self, rec) -> None:
        """Diagnose, dump, fail the group, and (if configured) end the process."""
        pg = self.pg
        me = pg.rank()
        progress = None
        if rec.p2p:
            clause = "its point-to-point peer never matched it"
            culprits: list[int] = []
        else:
            progress = self._read_progress()
            if progress is None:
                clause = ("the other ranks' progress could not be read from the store (it did not "
                          f"answer within {PROGRESS_QUERY_TIMEOUT_S:g}s; its host rank may be stuck)")
                culprits = []
            else:
                missing = sorted(q for q, (started, _f) in progress.items() if started < rec.seq)
                stuck = sorted(q for q, (_s, finished) in progress.items() if finished < rec.seq)
                if missing:
                    clause = f"{_ranks(missing)} never arrived"
                    culprits = missing
                elif stuck:
                    clause = f"every rank arrived but {_ranks(stuck)} did not finish"
                    culprits = stuck
                else:
                    clause = "every other rank reports it finished; this rank's links stalled"
                    culprits = []
        t = f"{rec.timeout:g}s"
        cause = f"rank {me} timed out after {t} in {rec.label}: {clause}"
        message = f"Rank {me} timed out after {t} in {rec.label} of group '{pg.name}': {clause}."
        path = write_dump(pg, message, rec, progress)
        if path:
            message += f" This rank's recent collectives are in {path}."
        metrics.count_timeout(rec.op)
        logger.error("%s", message)
        pg._fail_timeout(cause, message, culprits, path, rec)
