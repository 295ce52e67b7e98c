"""The agent's worker threads and its one timer thread for call deadlines."""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)


class WorkerPool:
    """Threads that run incoming calls and callbacks; `submit` never blocks.

    A SimpleQueue and plain threads cost a few microseconds per task where a
    ThreadPoolExecutor also builds a concurrent.futures.Future per task.
    """

    def __init__(self, num_threads: int, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name=f"shoal-rpc-worker-{name}-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable, *args) -> None:
        """Run `fn(*args)` on a worker thread."""
        self._queue.put((fn, args))

    def _run(self) -> None:
        get = self._queue.get
        while True:
            item = get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except BaseException:
                logger.exception("An RPC worker task raised")
            # An idle thread must not keep its last task's arguments (an RRef's value) alive.
            del item, fn, args

    def stop(self, timeout: float = 2.0) -> None:
        """Let the threads finish queued tasks, then exit (threads still busy are left)."""
        for _ in self._threads:
            self._queue.put(None)
        end = time.monotonic() + timeout
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, end - time.monotonic()))


class Deadlines:
    """Fires `on_expired(key)` when a key's deadline passes, unless it was removed first.

    Keys are grouped by timeout value; within a group deadlines grow with insertion order, so
    each group is an OrderedDict whose first entry is its earliest deadline and removal is O(1).
    The thread sleeps until the earliest deadline; an `add` only wakes it when the new deadline
    is earlier than the thread's planned wake-up, which with one common timeout is almost never.
    """

    def __init__(self, on_expired: Callable[[int], None], name: str):
        self._on_expired = on_expired
        self._cond = threading.Condition(threading.Lock())
        self._groups: dict[float, collections.OrderedDict] = {}
        self._wake_at = float("inf")
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"shoal-rpc-timer-{name}",
                                        daemon=True)
        self._thread.start()

    def add(self, key: int, timeout: float) -> None:
        """Expire `key` after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            group = self._groups.get(timeout)
            if group is None:
                group = self._groups[timeout] = collections.OrderedDict()
            group[key] = deadline
            if deadline < self._wake_at:
                self._wake_at = deadline
                self._cond.notify()

    def remove(self, key: int, timeout: float) -> None:
        """Forget `key` (it completed in time)."""
        with self._cond:
            group = self._groups.get(timeout)
            if group is not None:
                group.pop(key, None)

    def stop(self) -> None:
        """End the timer thread."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(2.0)

    def _run(self) -> None:
        while True:
            expired = []
            with self._cond:
                if self._stopped:
                    return
                now = time.monotonic()
                earliest: Optional[float] = None
                for timeout, group in self._groups.items():
                    while group:
                        key, deadline = next(iter(group.items()))
                        if deadline > now:
                            break
                        group.popitem(last=False)
                        expired.append(key)
                    if group:
                        head = next(iter(group.values()))
                        earliest = head if earliest is None else min(earliest, head)
                if len(self._groups) > 16:  # many ad-hoc timeouts: forget the empty groups
                    for timeout in [t for t, g in self._groups.items() if not g]:
                        del self._groups[timeout]
                if not expired:
                    # Sleeping one smallest timeout ahead when idle means a fresh add (whose
                    # deadline is at least that far away) needs no wake-up.
                    idle = min(self._groups, default=60.0)
                    self._wake_at = earliest if earliest is not None else now + idle
                    self._cond.wait(max(0.0, self._wake_at - now))
            for key in expired:
                try:
                    self._on_expired(key)
                except Exception:
                    logger.exception("Expiring RPC %s failed", key)


class BurstWriter:
    """A stream's writer thread for bursts: started on the first `wake()`, it calls `drain()`
    once after each wake-up and exits when `drain()` returns False (the stream is over).

    A thread that sends a frame in a burst wakes it instead of writing: it gets the GIL only when
    the senders pause, so one gRPC write carries many frames.
    """

    def __init__(self, drain: Callable[[], bool], name: str):
        self._drain = drain
        self._name = name
        self._lock = threading.Lock()
        # A plain lock as a one-bit semaphore: held while the thread has nothing to do,
        # released to wake it. Several wake-ups before the thread runs are one drain, which
        # takes everything queued before it; a Semaphore's Python-level Condition cost a few
        # microseconds more at both ends of every wake-up.
        self._wake: Optional[threading.Lock] = None
        # True from a wake-up until the thread begins the drain it asked for: a frame queued
        # meanwhile leaves in that drain, so its sender need not wake the thread again.
        self._pending = False

    @property
    def started(self) -> bool:
        """True once the thread runs (it may have exited since)."""
        return self._wake is not None

    def wake(self) -> None:
        """Have the thread drain once more (starting it on first use)."""
        if self._wake is None:
            with self._lock:
                if self._wake is None:
                    wake = threading.Lock()
                    wake.acquire()
                    threading.Thread(target=self._run, args=(wake,), daemon=True,
                                     name=self._name).start()
                    self._wake = wake
        if self._pending:
            return
        self._pending = True
        self._release(self._wake)

    def wake_if_started(self) -> None:
        """Let a running thread see that the stream is over; starts none."""
        if self._wake is not None:
            self._release(self._wake)

    @staticmethod
    def _release(wake: threading.Lock) -> None:
        try:
            wake.release()
        except RuntimeError:  # released already and not yet taken: the thread drains anyway
            pass

    def _run(self, wake: threading.Lock) -> None:
        while True:
            wake.acquire()
            self._pending = False
            if not self._drain():
                return


_marks = threading.local()


def mark_io_thread() -> None:
    """Mark the calling thread as one that must never run user callbacks (io, data readers)."""
    _marks.io = True


def unmark_io_thread() -> None:
    """Undo `mark_io_thread` (a reader that runs a call itself for a while)."""
    _marks.io = False


def is_io_thread() -> bool:
    """True on threads marked by `mark_io_thread`."""
    return getattr(_marks, "io", False)

