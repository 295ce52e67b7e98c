"""The op ledger every backend keeps: sequence numbers, the flight-recorder history, and which
operations are running.

A backend opens a record when an operation is submitted (`record`), marks it running when it
starts (`start`) and finished or failed when it ends (`finish`); how it runs the operation is
its own business (the tcp backend in a worker thread, the nccl backend on a CUDA stream). The
watchdog, the progress other ranks read and the dump all come from these records, so every
backend is watched and diagnosed the same way.

Collectives and point-to-point operations are numbered separately: every rank calls the same
collectives in the same order, so `all_reduce #5` names the same call on every rank, while
sends and receives pair up between two ranks only.
"""

from __future__ import annotations

import collections
import time
from typing import Optional

from shoal.collectives.constants import HISTORY_LENGTH
from shoal.core.profiler import state as _profiler

__all__ = ["OpRecord", "OpLedger"]


class OpRecord:
    """One submitted operation: what it is, when it ran, how it ended."""

    __slots__ = (
        "seq", "op", "desc", "nbytes", "timeout", "state", "enqueued", "started", "finished",
        "error", "p2p", "source",
    )

    def __init__(self, seq: int, op: str, desc: str, nbytes: int, timeout: float, p2p: bool):
        self.seq = seq
        self.op = op
        self.desc = desc
        self.nbytes = nbytes
        self.timeout = timeout
        self.state = "queued"
        self.enqueued = time.time()
        self.started: Optional[float] = None  # time.monotonic() when it began running
        self.finished: Optional[float] = None
        self.error: Optional[str] = None
        self.p2p = p2p
        self.source: Optional[int] = None  # the sender's rank, for a recv from any rank

    @property
    def label(self) -> str:
        """`all_reduce #5` (point-to-point ops count separately: `send p2p#2`)."""
        return f"{self.op} p2p#{self.seq}" if self.p2p else f"{self.op} #{self.seq}"

    def as_dict(self) -> dict:
        """The record as the dump writes it."""
        now = time.monotonic()
        started, finished = self.started, self.finished
        return {
            "seq": self.seq,
            "op": self.op,
            "p2p": self.p2p,
            "call": self.desc,
            "bytes": self.nbytes,
            "state": self.state,
            "timeout_s": self.timeout,
            "enqueued_at": self.enqueued,
            "running_for_s": (now - started) if started is not None and finished is None else None,
            "duration_s": (finished - started) if started is not None and finished is not None
            else None,
            "error": self.error,
        }


class OpLedger:
    """Numbers a group's operations and keeps their records.

    Thread safety: `record` must be called in submission order under the caller's own lock (both
    backends already hold one there); `start` and `finish` touch only the record and the
    counters, which other threads (the watchdog, the progress publisher) read without a lock:
    each read is of one attribute, and a slightly stale value only delays a diagnosis by a tick.
    """

    # The group's name, backend and world ranks for profiler events; a backend that knows them
    # sets them after construction.
    group = ""
    backend = ""
    global_ranks: tuple = ()

    def __init__(self) -> None:
        self.seq = 0
        self.p2p_seq = 0
        self.started_seq = 0  # the last collective this rank started...
        self.finished_seq = 0  # ...and the last it finished: the progress other ranks read
        # The collective started last: while it runs, and after it failed, so that ranks whose
        # own timeout expires later still read what this rank called (a failed rank that
        # published an empty call would turn their mismatch diagnosis into a bare timeout).
        self.current: Optional[OpRecord] = None
        self.history: collections.deque[OpRecord] = collections.deque(maxlen=HISTORY_LENGTH)
        # Running operations, oldest first; they mostly finish in that order, so `finish` pops
        # from the left (a deque reuses its blocks: no allocation per operation).
        self._running: collections.deque[OpRecord] = collections.deque()

    def record(self, op: str, desc: str, nbytes: int, timeout: float, p2p: bool) -> OpRecord:
        """Number one operation and add it to the history, as queued."""
        if p2p:
            self.p2p_seq += 1
            seq = self.p2p_seq
        else:
            self.seq += 1
            seq = self.seq
        rec = OpRecord(seq, op, desc, nbytes, timeout, p2p)
        self.history.append(rec)
        return rec

    def start(self, rec: OpRecord) -> None:
        """Mark `rec` running from now."""
        rec.state = "running"
        rec.started = time.monotonic()
        if not rec.p2p:
            self.started_seq = rec.seq
        self.current = rec
        self._running.append(rec)

    def open(self, op: str, desc: str, nbytes: int, timeout: float, p2p: bool) -> OpRecord:
        """`record` and `start` at once, for an operation that runs as it is submitted."""
        rec = self.record(op, desc, nbytes, timeout, p2p)
        self.start(rec)
        return rec

    def finish(self, rec: OpRecord, error: Optional[BaseException] = None) -> None:
        """Mark `rec` completed, or failed with `error`."""
        rec.finished = time.monotonic()
        if error is None:
            rec.state = "completed"
            if not rec.p2p and rec.seq > self.finished_seq:
                self.finished_seq = rec.seq
        else:
            rec.state = "failed"
            rec.error = str(error)
        if self.current is rec and error is None:
            self.current = None
        if _profiler.recorder is not None and rec.started is not None:
            self._profile(rec)
        running = self._running
        if running and running[0] is rec:
            running.popleft()
        else:
            try:
                running.remove(rec)
            except ValueError:  # never started (a queued op failed by a shutdown)
                pass

    def _profile(self, rec: OpRecord) -> None:
        """Hand the finished operation to the recording profiler as one event."""
        recorder = _profiler.recorder
        if recorder is None or rec.finished is None or rec.started is None:
            return
        recorder.add_range(
            rec.op, "collective", int(rec.started * 1e9), int(rec.finished * 1e9),
            {"op": rec.op, "group": self.group, "seq": rec.seq, "p2p": rec.p2p,
             "bytes": rec.nbytes, "call": rec.desc, "state": rec.state,
             "backend": self.backend, "group_ranks": self.global_ranks},
        )

    def oldest_running(self) -> Optional[OpRecord]:
        """The operation that has been running longest (the first to time out), or None."""
        try:
            return self._running[0]
        except IndexError:
            return None

    def progress(self) -> tuple[int, int, Optional[OpRecord]]:
        """(last started collective, last finished collective, the running record of the
        started one if it is still running), what this rank publishes for the others."""
        started = self.started_seq
        cur = self.current
        if cur is None or cur.p2p or cur.seq != started:
            cur = None
        return started, self.finished_seq, cur
