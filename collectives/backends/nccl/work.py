"""`Work` of the nccl backend: a CUDA event on the group's stream; and `InFlight`, the group's
outstanding work, which the watchdog's tick finishes as their events fire.

A collective is finished, from the host's point of view, when its event has fired. `wait()`
follows torch: it makes the caller's current stream wait for the event and returns without
blocking the host, so later kernels on that stream see the result; `synchronize()` blocks the
host (polling the event, never without a bound). Work that staged host (numpy) arrays through
the device, and barriers, always block the host in `wait()`, because the caller reads the result
on the host. Whichever thread first sees the event fire finishes the work: it copies staged
results back into the caller's numpy arrays and drops the references that kept the arrays alive
while NCCL used them.

Done-callbacks of a successful collective run in a caller's thread, never in the watchdog's:
in `wait()` right after the caller's stream was ordered after the collective, or in the first
`synchronize()`, `is_completed()`, `exception()` or `result()`. GPU work a callback launches on
its thread's current stream (a DDP hook's decompression) is thus ordered after the collective.
A failure runs them at once, in the thread that failed the work.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from shoal.collectives import metrics
from shoal.collectives.api import Work
from shoal.collectives.backends.ledger import OpRecord
from shoal.collectives.types import CollectiveTimeout
from shoal.core.timeouts import TimeoutLike, to_seconds

if TYPE_CHECKING:  # pragma: no cover
    from shoal.collectives.backends.nccl.group import ProcessGroupNCCL

logger = logging.getLogger(__name__)

__all__ = ["NcclWork", "InFlight"]

# Host polling of an event: spin briefly (small collectives finish in microseconds), then sleep
# with a growing interval up to this cap.
_SPIN_S = 50e-6
_MAX_SLEEP_S = 1e-3


class NcclWork(Work):
    """The handle of one nccl collective (see the module docstring for its semantics)."""

    def __init__(self, pg: "ProcessGroupNCCL", record: OpRecord, outputs: list, host_blocking: bool):
        self._pg = pg
        self._record = record
        self._outputs = outputs
        self._host_blocking = host_blocking
        self.event: Any = None  # set once the collective is enqueued
        self._keep: list = []  # arrays NCCL reads or writes: alive until the event fired
        self._writebacks: list[tuple[np.ndarray, np.ndarray]] = []  # (caller's array, pinned)
        self._lock = threading.Lock()
        self._done = False
        self._exc: Optional[BaseException] = None
        self._callbacks: list[Callable[[Work], Any]] = []
        self.source_rank: Optional[int] = None

    @property
    def seq(self) -> int:
        """The operation's sequence number in its group."""
        return self._record.seq

    @property
    def record(self) -> OpRecord:
        """The flight-recorder entry of this operation."""
        return self._record

    @property
    def done(self) -> bool:
        """True once finished, without polling (a poll may run callbacks)."""
        return self._done

    def keep(self, obj: Any) -> None:
        """Keep `obj` (an array NCCL reads or writes) alive until the work finished."""
        self._keep.append(obj)

    def copy_back_later(self, host: np.ndarray, pinned: np.ndarray) -> None:
        """Once the work succeeded, copy `pinned` (its download target) into `host`."""
        self._writebacks.append((host, pinned))

    def __repr__(self) -> str:
        state = "failed" if self._exc else ("completed" if self._done else "pending")
        return f"NcclWork({self._record.label}, group={self._pg.name!r}, {state})"

    # ------------------------------------------------------------------ completion

    def poll(self, caller: bool = True) -> bool:
        """True once finished (successfully or not); finishes it if its event has fired.

        `caller` is False for the watchdog, whose polls leave the callbacks to a caller's thread.
        """
        if not self._done:
            event = self.event
            pg = self._pg
            if event is None or not pg.runtime.query(event):
                return False
            # After a failure, an event may fire because the abort ended NCCL's kernels.
            self.finish(pg.error_for(self._record) if pg.failed else None, run_callbacks=caller)
        elif caller and self._callbacks:
            self._run_callbacks()
        return True

    def finish(self, exc: Optional[BaseException], run_callbacks: bool = True) -> bool:
        """Finish once: write staged results back (on success), release, run callbacks."""
        with self._lock:
            if self._done:
                return False
            if exc is None:
                for host, pinned in self._writebacks:
                    np.copyto(host, pinned.reshape(host.shape))
            self._exc = exc
            self._done = True
            self._keep = []
            self._writebacks = []
        rec = self._record
        self._pg.ledger.finish(rec, exc)
        if exc is None and rec.started is not None:
            metrics.observe(rec.op, "nccl", rec.finished - rec.started, rec.nbytes)
        if run_callbacks or exc is not None:
            self._run_callbacks()
        return True

    def _run_callbacks(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb(self)
            except Exception:  # a callback's bug must not stop the others
                logger.exception("A done-callback of %s raised", self)

    # ------------------------------------------------------------------ Work API

    def wait(self, timeout: TimeoutLike = None) -> bool:
        """Order the caller's current stream after this collective (no host block), as torch
        does; host-staged work, barriers and an explicit `timeout` block the host instead.

        Raises:
            CollectiveError: it failed (the watchdog's timeout, an NCCL error, an abort).
            CollectiveTimeout: with `timeout`, it did not finish in time (it keeps running).
        """
        if self._exc is not None:
            raise self._exc
        if self._host_blocking or timeout is not None:
            return self.synchronize(timeout)
        event = self.event
        if not self._done and event is not None:
            rt = self._pg.runtime
            with rt.device_context(self._pg.device):
                rt.wait_event(rt.current_stream(), event)
        if self._exc is not None:
            raise self._exc
        if self._callbacks:
            self._run_callbacks()  # what they launch on this stream now runs after the collective
        return True

    def synchronize(self, timeout: TimeoutLike = None) -> bool:
        """Block the host until the collective finished.

        Without `timeout` the bound is the operation's own timeout plus the watchdog's time to
        abort, by which the watchdog has failed it; so this never blocks without end.

        Raises:
            CollectiveError: it failed.
            CollectiveTimeout: it did not finish within `timeout`.
        """
        seconds = to_seconds(timeout)
        budget = seconds if seconds is not None else self._record.timeout + self._pg.sync_grace_s
        start = time.monotonic()
        end = start + budget
        sleep = 0.0
        while not self.poll():
            now = time.monotonic()
            if now >= end:
                raise CollectiveTimeout(
                    f"Rank {self._pg.rank()}'s {self._record.label} of group '{self._pg.name}' "
                    f"did not complete within the {budget:g}s that synchronize() allowed; it is "
                    "still running and the group's watchdog still times it."
                )
            if now - start < _SPIN_S:
                continue
            sleep = min(_MAX_SLEEP_S, max(10e-6, sleep * 2))
            time.sleep(min(sleep, max(0.0, end - now)))
        if self._exc is not None:
            raise self._exc
        if self._callbacks:
            self._run_callbacks()
        return True

    def is_completed(self) -> bool:
        return self.poll()

    def is_success(self) -> bool:
        return self.poll() and self._exc is None

    def exception(self) -> Optional[BaseException]:
        self.poll()
        return self._exc

    def result(self) -> list:
        self.wait()
        return self._outputs

    def add_done_callback(self, fn: Callable[[Work], Any]) -> None:
        """Call `fn(work)` once finished (see the module docstring for the thread it runs in)."""
        with self._lock:
            if not self._done:
                self._callbacks.append(fn)
                return
        fn(self)


class InFlight:
    """A group's outstanding work, oldest first (they finish in order on the group's stream)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._works: collections.deque[NcclWork] = collections.deque()

    def track(self, work: NcclWork) -> None:
        """Watch `work` from now on (before it is enqueued, so a hang while enqueuing counts)."""
        with self._lock:
            self._works.append(work)

    def outstanding(self) -> list[NcclWork]:
        """Work not yet seen finished, oldest first."""
        with self._lock:
            return [w for w in self._works if not w.done]

    def find(self, record: Optional[OpRecord]) -> Optional[NcclWork]:
        """The outstanding work of `record`, if any."""
        with self._lock:
            return next((w for w in self._works if w.record is record and not w.done), None)

    def finish_fired(self) -> None:
        """Finish the work whose events fired (the watchdog's polls leave the callbacks to a
        caller's thread), and forget finished work."""
        with self._lock:
            works = list(self._works)
        finished = False
        for work in works:
            if not work.poll(caller=False):
                break  # later work cannot finish before this one on the group's stream
            finished = True
        if finished:
            with self._lock:
                while self._works and self._works[0].done:
                    self._works.popleft()
