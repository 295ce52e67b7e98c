"""Holding the all_reduces torch DDP starts inside backward until backward ends.

DDP all_reduces each bucket from autograd's hooks, as soon as its gradients are ready, so that
the communication overlaps the rest of backward. That overlap needs a core: the group's worker
thread runs the collective while backward's thread computes. Where a host runs as many ranks as
it has cores (or nearly), there is none to spare: the worker thread and backward take turns on
one core, each rank's collective waits for its peer's worker to be scheduled, and the hand-off
costs more than the overlap saves (measured: see docs/benchmarks.md, "The torch bridge").

So there, an async all_reduce issued while autograd evaluates a node is *parked*: it gets its
handle at once and runs later, in the caller's thread, back to back with the others, when

- backward ends (a callback queued on autograd's engine at the first parked op: it runs before
  DDP's own end-of-backward callback, which waits on the buckets in order);
- anything else is issued on the same group, or a parked op's handle is waited on: the parked
  ops run first, so every rank submits the group's operations in the order it issued them,
  whether it parks or not (ranks on other hosts may decide otherwise);
- or, should a caller block where this module cannot see it (a C++ wait on a chained Future
  inside backward), a rescue thread hands ops parked for longer than `RESCUE_AFTER_S` to the
  group's worker thread, so nothing waits forever.

Ops issued in autograd's final callbacks (no node is evaluated there; DDP's delayed all_reduce
of a static graph) or in a callback of the group's own Future are never parked: their issuer
may wait for them before the parked ops' flush could run.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Callable, Optional

import torch
from torch.autograd import Variable

from shoal.collectives.api import PendingWork
from shoal.core.timeouts import TimeoutLike, to_seconds

__all__ = ["DeferredWork", "BackwardDeferral", "RESCUE_AFTER_S", "spare_core_per_rank"]

# How long a parked op may wait for its flush before the rescue thread hands it to the group's
# worker thread; far above a step's backward (tens of ms here), so only a caller blocked where
# the flush cannot run (a C++ wait inside backward) ever meets it, and then loses at most this.
RESCUE_AFTER_S = 1.0
# How often the rescue thread looks (it sleeps otherwise; a wake-up costs a few microseconds).
_RESCUE_TICK_S = 0.25

Submit = Callable[[bool, Optional[float]], Any]


def spare_core_per_rank(local_ranks: int) -> bool:
    """True when this process may use at least two cores per rank on its host: one for the
    rank's backward, one for its group's worker thread."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return cpus >= 2 * local_ranks


def in_autograd_node() -> bool:
    """True while autograd evaluates a node of a backward (DDP's gradient hooks run there), and
    not in its final callbacks, where a caller may wait on what it issues before we could run it."""
    return torch._C._current_autograd_node() is not None  # noqa: SLF001 - torch's own query


class DeferredWork(PendingWork):
    """The shoal-side handle of a parked op; it completes once the op ran (inline or on the
    group's worker thread)."""

    __slots__ = ("_holder", "_submit", "_timeout", "parked_at")

    def __init__(self, holder: "BackwardDeferral", submit: Submit, timeout: Optional[float]):
        super().__init__()
        self._holder = holder
        self._submit = submit
        self._timeout = timeout
        self.parked_at = time.monotonic()

    def run_inline(self) -> None:
        """Run the op now in this thread; its error goes to the handle."""
        try:
            self._submit(False, self._timeout)
        except BaseException as exc:  # noqa: BLE001 - raised by wait() and the Future instead
            self.finish(None, exc)
            return
        self.finish(None, None)

    def hand_to_worker(self) -> None:
        """Submit the op to the group's worker thread; the handle completes with it."""
        try:
            work = self._submit(True, self._timeout)
        except BaseException as exc:  # noqa: BLE001 - the group refused it (destroyed)
            self.finish(None, exc)
            return
        work.add_done_callback(lambda w: self.finish(None, w.exception()))

    def wait(self, timeout: TimeoutLike = None) -> bool:
        """Run the parked ops up to this one (if not yet run), then wait for it. Given a
        timeout, they go to the group's worker thread, so that the wait ends within it: run in
        this thread, an op whose peer is late would hold it for the group's own timeout."""
        if not self._done:
            self._holder.flush(to_worker=to_seconds(timeout) is not None)
        return super().wait(timeout)

    def _timeout_message(self, seconds: float) -> str:
        return (f"An all_reduce of group '{self._holder.name}' parked in backward did not "
                f"complete within the {seconds:g}s that wait() allowed; it is still running and "
                "the group's watchdog still times it.")


class BackwardDeferral:
    """The parked ops of one group, run in the order they were issued (see the module's doc)."""

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        # Held while ops leave the queue and are submitted, so they reach the group in order.
        self._submitting = threading.RLock()
        self._pending: collections.deque[DeferredWork] = collections.deque()
        self._handing = False  # the rescue thread took parked ops and is still submitting them
        self._flush_for = -1  # the graph task whose end runs a flush already
        self._rescuer: Optional[threading.Thread] = None
        self._stopped = threading.Event()

    def park(self, submit: Submit, timeout: Optional[float]) -> DeferredWork:
        """Hold `submit(async_op, timeout)` until backward ends; its handle now."""
        work = DeferredWork(self, submit, timeout)
        task = torch._C._current_graph_task_id()  # noqa: SLF001 - torch's own query
        with self._lock:
            self._pending.append(work)
            queue_flush = self._flush_for != task
            self._flush_for = task
            if self._rescuer is None:
                self._rescuer = threading.Thread(target=self._rescue_loop, daemon=True,
                                                 name=f"shoal-torch-{self.name}-rescue")
                self._rescuer.start()
        if queue_flush:
            Variable._execution_engine.queue_callback(self.flush)  # noqa: SLF001 - torch's API
        return work

    @property
    def has_pending(self) -> bool:
        """True while parked ops wait to be submitted, or are being handed over (read without
        the lock: each read is of one attribute, and only the issuing thread parks)."""
        return bool(self._pending) or self._handing

    def flush(self, to_worker: bool = False) -> None:
        """Run every parked op now, in order, in this thread; `to_worker`: submit them to the
        group's worker thread instead (from a callback running on that thread, which cannot
        wait for itself)."""
        with self._submitting:
            while True:
                with self._lock:
                    if not self._pending:
                        return
                    work = self._pending.popleft()
                if to_worker:
                    work.hand_to_worker()
                else:
                    work.run_inline()

    def _rescue_loop(self) -> None:
        while not self._stopped.wait(_RESCUE_TICK_S):
            with self._lock:
                stale = bool(self._pending) and (
                    time.monotonic() - self._pending[0].parked_at > RESCUE_AFTER_S)
            # A flush under way holds the lock and runs them itself: leave it to it.
            if not stale or not self._submitting.acquire(blocking=False):
                continue
            try:
                with self._lock:
                    works, self._pending = list(self._pending), collections.deque()
                    # Until they are all submitted, an op issued meanwhile must wait (flush
                    # takes `_submitting`), or it could reach the group before them.
                    self._handing = True
                for work in works:
                    work.hand_to_worker()
            finally:
                self._handing = False
                self._submitting.release()

    def stop(self) -> None:
        """Hand whatever is parked to the group (which fails it if it is gone); stop rescuing."""
        self._stopped.set()
        with self._submitting:
            with self._lock:
                works, self._pending = list(self._pending), collections.deque()
            for work in works:
                work.hand_to_worker()
