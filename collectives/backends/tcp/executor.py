"""How the tcp backend runs its operations: strictly in submission order, and `Work` handles.

A synchronous call on an idle group runs inline in the caller's thread (a thread hand-off
costs more than a whole 4 KiB all_reduce); anything else goes to the group's worker thread,
which runs operations one at a time in submission order, so several outstanding async ops
complete correctly and in order. Every operation is numbered and recorded in the group's
`OpLedger` (under this executor's lock, so numbers follow submission order).

The worker thread's receives poll for their peers only while some thread waits for one of the
group's operations (`Waiters`); until then nobody needs the answer early, and polling would
take a core from the ranks' own threads (`algorithms.poll_only_while`).
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Optional

from shoal.collectives.api import CompletedWork, PendingWork, Work
from shoal.collectives.backends.ledger import OpLedger, OpRecord
from shoal.collectives.backends.tcp.algorithms import poll_only_while
from shoal.collectives.types import GroupDestroyed
from shoal.core.timeouts import TimeoutLike

__all__ = ["InOrderExecutor", "OpWork", "Waiters", "DoneWork", "PartWork", "Handoff", "Job"]

# An operation's body: job(record, arrays) -> the Work's result list.
Job = Callable[[OpRecord, Any], list]
# How the group runs a job (failure handling around it): runner(record, job, arrays).
Runner = Callable[[OpRecord, Job, Any], list]


class Waiters:
    """How many threads are blocked in the wait() of a group's queued operations."""

    __slots__ = ("count", "_lock")

    def __init__(self):
        self.count = 0
        self._lock = threading.Lock()

    def any(self) -> bool:
        """True while some thread waits (read without the lock: a stale answer only costs
        one receive its poll, or one short poll)."""
        return self.count > 0

    def add(self, delta: int) -> None:
        """Count a thread starting (+1) or ending (-1) a wait."""
        with self._lock:
            self.count += delta


class OpWork(PendingWork):
    """The handle of one queued operation."""

    __slots__ = ("_record", "_describe", "_waiters")

    def __init__(self, record: OpRecord, describe: Callable[[OpRecord], str],
                 waiters: Optional[Waiters] = None):
        super().__init__()
        self._record = record
        self._describe = describe
        self._waiters = waiters

    def wait(self, timeout: TimeoutLike = None) -> bool:
        if self._done or self._waiters is None:
            return super().wait(timeout)
        self._waiters.add(1)
        try:
            return super().wait(timeout)
        finally:
            self._waiters.add(-1)

    @property
    def seq(self) -> int:
        """The operation's sequence number in its group."""
        return self._record.seq

    @property
    def source_rank(self) -> Optional[int]:
        """For a recv: the rank the message came from."""
        return self._record.source

    def _timeout_message(self, seconds: float) -> str:
        return (f"{self._describe(self._record)} did not complete within the {seconds:g}s that "
                "wait() allowed; it is still running and the group's watchdog still times it.")


class Handoff:
    """What an eager job returns to finish in the group's worker thread: `job`, the rest of it
    (run with the same record and arrays)."""

    __slots__ = ("job",)

    def __init__(self, job: Job):
        self.job = job


class DoneWork(CompletedWork):
    """The handle of an operation that ran inline and succeeded (cheaper than an OpWork: an
    op run inline is finished before anyone can wait on it, so it needs no Event)."""

    __slots__ = ("seq",)

    def __init__(self, record: OpRecord, result: list):
        super().__init__(result, record.source)
        self.seq = record.seq


class PartWork(Work):
    """The handle of one operation of a batch that ran as one job (batch_isend_irecv): it
    completes with the batch; the batch's result holds, at `index`, this operation's outcome
    (its source rank, or the exception that failed only this operation)."""

    __slots__ = ("_batch", "_index", "_result")

    def __init__(self, batch: Work, index: int, result: list):
        self._batch = batch
        self._index = index
        self._result = result

    def _outcome(self):
        return self._batch.result()[self._index]

    @property
    def source_rank(self) -> Optional[int]:
        """For a recv: the rank the message came from."""
        if not self._batch.is_completed() or self._batch.exception() is not None:
            return None
        got = self._outcome()
        return got if isinstance(got, int) else None

    def wait(self, timeout: TimeoutLike = None) -> bool:
        self._batch.wait(timeout)
        got = self._outcome()
        if isinstance(got, BaseException):
            raise got
        return True

    def is_completed(self) -> bool:
        return self._batch.is_completed()

    def is_success(self) -> bool:
        return self._batch.is_success() and not isinstance(self._outcome(), BaseException)

    def exception(self) -> Optional[BaseException]:
        exc = self._batch.exception()
        if exc is None and self._batch.is_completed():
            got = self._outcome()
            return got if isinstance(got, BaseException) else None
        return exc

    def result(self) -> list:
        self.wait()
        return self._result

    def add_done_callback(self, fn: Callable[[Work], Any]) -> None:
        self._batch.add_done_callback(lambda _batch: fn(self))


class InOrderExecutor:
    """Runs a group's operations one at a time, in submission order."""

    def __init__(self, name: str, ledger: OpLedger, runner: Runner,
                 describe: Callable[[OpRecord], str]):
        self.name = name
        self._ledger = ledger
        self._runner = runner
        self._describe = describe
        self._lock = threading.Condition(threading.Lock())
        self._queue: collections.deque[tuple[OpRecord, Job, Any, OpWork]] = collections.deque()
        self._busy = False
        self._stopped = False
        self._worker: Optional[threading.Thread] = None
        self._handed: set[int] = set()  # ids of queued OpWorks whose job started inline
        self.waiters = Waiters()

    def submit(self, op: str, desc: str, nbytes: int, timeout: float, async_op: bool, p2p: bool,
               job: Job, arrays: Any, eager: bool = False) -> Work:
        """Number, record and run (inline or queued) `job(record, arrays)`; returns its Work.

        `eager`: run inline when the group is idle even for an async op; such a job may
        return a `Handoff` to finish in the worker thread, ahead of anything queued since.
        """
        ledger = self._ledger
        with self._lock:
            if self._stopped:
                raise GroupDestroyed(
                    f"{op} was called on process group '{self.name}' after it was destroyed."
                )
            inline = (eager or not async_op) and not self._busy and not self._queue
            if inline:
                self._busy = True
                rec = ledger.open(op, desc, nbytes, timeout, p2p)
            else:
                rec = ledger.record(op, desc, nbytes, timeout, p2p)
                work = OpWork(rec, self._describe, self.waiters)
                self._queue.append((rec, job, arrays, work))
                self._start_worker()
                self._lock.notify_all()
        if inline:
            # The synchronous fast path, all in this frame (a call costs a tenth of the whole
            # overhead of a small all_reduce): no Work object exists until the op has finished.
            handoff = None
            try:
                try:
                    result = self._runner(rec, job, arrays)
                except BaseException as exc:
                    ledger.finish(rec, exc)
                    raise
                if isinstance(result, Handoff):
                    handoff = OpWork(rec, self._describe, self.waiters)
                    return handoff
                ledger.finish(rec)
                return DoneWork(rec, result)
            finally:
                with self._lock:
                    self._busy = False
                    if handoff is not None:
                        # Still running: first in line, before whatever was queued meanwhile.
                        self._queue.appendleft((rec, result.job, arrays, handoff))
                        self._handed.add(id(handoff))
                        self._start_worker()
                    if self._queue:
                        self._lock.notify_all()
        if not async_op:
            work.wait()
        return work

    def _start_worker(self) -> None:
        """Start the worker thread on first use (under the lock)."""
        if self._worker is None:
            self._worker = threading.Thread(
                target=self._loop, name=f"shoal-pg-{self.name}-worker", daemon=True
            )
            self._worker.start()

    def _run_queued(self, rec: OpRecord, job: Job, arrays: Any, work: OpWork) -> None:
        # The ledger's record is what the watchdog, the dump and the progress other ranks read.
        ledger = self._ledger
        with self._lock:
            handed = id(work) in self._handed
            self._handed.discard(id(work))
        if not handed:  # a handed-off job started inline and is running already
            ledger.start(rec)
        try:
            result = self._runner(rec, job, arrays)
        except BaseException as exc:  # noqa: BLE001 - the caller's Work raises it, in its thread
            ledger.finish(rec, exc)
            work.finish(None, exc)
            return
        ledger.finish(rec)
        work.finish(result, None)

    def _loop(self) -> None:
        poll_only_while(self.waiters.any)
        while True:
            with self._lock:
                while (self._busy or not self._queue) and not self._stopped:
                    self._lock.wait()
                if self._stopped and not self._queue:
                    return
                rec, job, arrays, work = self._queue.popleft()
                self._busy = True
            try:
                self._run_queued(rec, job, arrays, work)
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
        for rec, _job, _arrays, work in queued:
            self._ledger.finish(rec, error)
            work.finish(None, error)
