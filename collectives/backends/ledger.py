"""Ordering and bookkeeping shared by process-group backends: sequence numbers, in-order
execution, the flight-recorder history the watchdog dumps, and `Work` handles.

A synchronous call on an idle group runs inline in the caller's thread (a thread hand-off
costs more than a whole 4 KiB all_reduce); anything else goes to the group's worker thread,
which runs operations strictly in submission order, so several outstanding async ops complete
correctly and in order.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Optional

from shoal.collectives.api import Work
from shoal.collectives.types import CollectiveTimeout, GroupDestroyed
from shoal.collectives.constants import HISTORY_LENGTH
from shoal.core.timeouts import TimeoutLike, to_seconds


class OpRecord:
    """One submitted operation: what it is, when it ran, how it ended."""

    __slots__ = (
        "seq", "op", "desc", "nbytes", "timeout", "state", "enqueued", "started", "finished",
        "error", "fn", "p2p", "work", "source",
    )

    def __init__(self, seq, op, desc, nbytes, timeout, fn, p2p):
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
        self.fn = fn
        self.p2p = p2p
        self.work: Optional["OpWork"] = None
        self.source: Optional[int] = None  # the sender's rank, for a recv from any rank

    @property
    def label(self) -> str:
        """`all_reduce #5` (point-to-point ops count separately: `send p2p#2`)."""
        return f"{self.op} p2p#{self.seq}" if self.p2p else f"{self.op} #{self.seq}"

    def as_dict(self) -> dict:
        now = time.monotonic()
        started = self.started
        return {
            "seq": self.seq,
            "op": self.op,
            "p2p": self.p2p,
            "call": self.desc,
            "bytes": self.nbytes,
            "state": self.state,
            "timeout_s": self.timeout,
            "enqueued_at": self.enqueued,
            "running_for_s": (now - started) if started is not None and self.finished is None else None,
            "duration_s": (self.finished - started) if started is not None and self.finished is not None else None,
            "error": self.error,
        }


class OpWork(Work):
    """The handle of one submitted operation."""

    __slots__ = ("_record", "_event", "_done", "_exc", "_result", "_callbacks", "_lock",
                 "_describe")

    def __init__(self, record: OpRecord, describe: Callable[[OpRecord], str], waitable: bool):
        self._record = record
        # An Event costs more than a 4 KiB all_reduce's Python overhead; an op run inline is
        # finished before anyone can wait on it, so only queued ops get one.
        self._event = threading.Event() if waitable else None
        self._done = False
        self._exc: Optional[BaseException] = None
        self._result: list = []
        self._callbacks: list = []
        self._lock = threading.Lock()
        self._describe = describe

    @property
    def seq(self) -> int:
        """The operation's sequence number in its group."""
        return self._record.seq

    @property
    def source_rank(self) -> Optional[int]:
        """For a recv: the rank the message came from."""
        return self._record.source

    def _finish(self, result: Optional[list], exc: Optional[BaseException]) -> None:
        with self._lock:
            self._result = result if result is not None else []
            self._exc = exc
            self._done = True
            if self._event is not None:
                self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def wait(self, timeout: TimeoutLike = None) -> bool:
        seconds = to_seconds(timeout)
        if not self._done and not self._event.wait(seconds):
            raise CollectiveTimeout(
                f"{self._describe(self._record)} did not complete within the {seconds:g}s that "
                "wait() allowed; it is still running and the group's watchdog still times it."
            )
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done and self._exc is None

    def exception(self) -> Optional[BaseException]:
        return self._exc

    def result(self) -> list:
        self.wait()
        return self._result

    def add_done_callback(self, fn: Callable[[Work], Any]) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(fn)
                return
        fn(self)


class DoneWork(Work):
    """The handle of an operation that ran inline and succeeded (cheaper than an OpWork)."""

    __slots__ = ("seq", "_result", "source_rank")

    def __init__(self, record: OpRecord, result: list):
        self.seq = record.seq
        self.source_rank = record.source
        self._result = result

    def wait(self, timeout: TimeoutLike = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> Optional[BaseException]:
        return None

    def result(self) -> list:
        return self._result

    def add_done_callback(self, fn: Callable[[Work], Any]) -> None:
        fn(self)


class Engine:
    """Runs a group's operations one at a time, in submission order."""

    def __init__(self, name: str, run: Callable[[OpRecord], list], describe: Callable[[OpRecord], str]):
        self.name = name
        self._run = run
        self._describe = describe
        self._lock = threading.Condition(threading.Lock())
        self._queue: collections.deque[OpRecord] = collections.deque()
        self._busy = False
        self._stopped = False
        self._worker: Optional[threading.Thread] = None
        self.seq = 0
        self.p2p_seq = 0
        self.started_seq = 0
        self.finished_seq = 0
        self.current: Optional[OpRecord] = None
        self.history: collections.deque[OpRecord] = collections.deque(maxlen=HISTORY_LENGTH)

    def submit(self, op: str, desc: str, fn, nbytes: int, timeout: float, async_op: bool,
               p2p: bool = False) -> Work:
        """Number, record and run (inline or queued) one operation; returns its Work."""
        with self._lock:
            if self._stopped:
                raise GroupDestroyed(
                    f"{op} was called on process group '{self.name}' after it was destroyed."
                )
            if p2p:
                self.p2p_seq += 1
                seq = self.p2p_seq
            else:
                self.seq += 1
                seq = self.seq
            rec = OpRecord(seq, op, desc, nbytes, timeout, fn, p2p)
            self.history.append(rec)
            inline = not async_op and not self._busy and not self._queue
            if inline:
                self._busy = True
            else:
                work = rec.work = OpWork(rec, self._describe, True)
                self._queue.append(rec)
                if self._worker is None:
                    self._worker = threading.Thread(
                        target=self._loop, name=f"shoal-pg-{self.name}-worker", daemon=True
                    )
                    self._worker.start()
                self._lock.notify_all()
        if inline:
            return self._run_inline(rec)
        if not async_op:
            work.wait()
        return work

    def _run_recorded(self, rec: OpRecord):
        # Runs one op and keeps its record (state, times, this rank's progress) up to date: the
        # watchdog, the dump and the progress other ranks read all come from these fields.
        rec.state = "running"
        rec.started = time.monotonic()
        if not rec.p2p:
            self.started_seq = rec.seq
        self.current = rec
        try:
            result = self._run(rec)
        except BaseException as exc:
            rec.finished = time.monotonic()
            rec.state = "failed"
            rec.error = str(exc)
            raise
        else:
            rec.finished = time.monotonic()
            rec.state = "completed"
            if not rec.p2p:
                self.finished_seq = rec.seq
            return result
        finally:
            self.current = None
            rec.fn = None

    def _run_inline(self, rec: OpRecord) -> Work:
        # The synchronous fast path: no Work object exists until the op has finished.
        try:
            return DoneWork(rec, self._run_recorded(rec))
        finally:
            with self._lock:
                self._busy = False
                if self._queue:
                    self._lock.notify_all()

    def _execute(self, rec: OpRecord) -> None:
        try:
            result = self._run_recorded(rec)
        except BaseException as exc:
            rec.work._finish(None, exc)
            return
        rec.work._finish(result, None)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while (self._busy or not self._queue) and not self._stopped:
                    self._lock.wait()
                if self._stopped and not self._queue:
                    return
                rec = self._queue.popleft()
                self._busy = True
            try:
                self._execute(rec)
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()

    def pending(self) -> int:
        """Operations queued or running."""
        with self._lock:
            return len(self._queue) + (1 if self._busy else 0)

    def stop(self, error: BaseException) -> None:
        """Refuse new work and fail whatever is still queued with `error`."""
        with self._lock:
            self._stopped = True
            queued = list(self._queue)
            self._queue.clear()
            self._lock.notify_all()
        for rec in queued:
            rec.state = "failed"
            rec.error = str(error)
            rec.work._finish(None, error)
