"""torch `Work` handles over shoal's: `wait`, `is_completed`, `exception` and a torch Future that
DDP comm hooks chain with `then`.

A shoal Work finishes on the group's worker thread (or inline, for a synchronous call); its
done-callback first runs the op's epilogue (copying a coalesced buffer back, for instance) and
then completes the torch Future, so a `then` callback always sees the final tensors.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

__all__ = ["BridgeWork", "timeout_seconds", "refuse_blocking_in_callback", "in_callback_of"]

# Set while a Future's callbacks run on a group's worker thread: that thread runs the group's
# operations one at a time, so a callback that waited for another of them would wait forever.
_completing = threading.local()


def in_callback_of(group: Any) -> bool:
    """True while a Future callback of `group` runs in this thread (on its worker thread)."""
    return getattr(_completing, "group", None) is group


def refuse_blocking_in_callback(group: Any, what: str) -> None:
    """Raise instead of hanging when a Future callback of `group` would block on `group`."""
    if getattr(_completing, "group", None) is group:
        raise RuntimeError(
            f"{what} would wait for process group '{group.name}' inside a callback of one of "
            "its own Futures, which runs on the group's only worker thread: it would wait "
            "forever. Start it with async_op=True and chain its Future (fut.then(...)) instead."
        )


def timeout_seconds(timeout: Any) -> Optional[float]:
    """torch's wait timeout (a timedelta, zero or negative meaning "none") in seconds."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return seconds if seconds > 0 else None


class BridgeWork(dist.Work):
    """The torch handle of one shoal operation; `result()` and the Future hold torch tensors.

    Args:
        works: the shoal Works this op runs as (usually one; coalesced calls may submit several).
        result: what torch's Work holds for this op (the output tensors).
        epilogue: run once after every shoal Work succeeded, before anyone sees the result.
        source_rank: a callable giving the sender of a recv from any source.
        error: the error of an op that already ran and failed (`works` then empty): wait()
            raises it and the Future holds it, as for an op that failed on the worker thread.
    """

    def __init__(self, works: list, result: list, epilogue: Optional[Callable[[], None]] = None,
                 source_rank: Optional[Callable[[], int]] = None, group: Any = None,
                 error: Optional[BaseException] = None):
        super().__init__()
        self._group = group
        self._works = works
        self._result = result
        self._epilogue = epilogue
        self._source = source_rank
        self._lock = threading.Lock()
        self._finished = error is not None
        self._error: Optional[BaseException] = error
        self._future: Optional[torch.futures.Future] = None
        self._after: Optional[torch.futures.Future] = None  # what wait() also waits for

    def wait_also_for(self, future: torch.futures.Future) -> None:
        """Make `wait()` return only once `future` completed too (a profiler span ending on
        this op's Future, so that leaving the profiler right after wait() still records it)."""
        self._after = future

    def _finish(self) -> Optional[BaseException]:
        # Idempotent: the waiting thread and the completion callback may both get here.
        with self._lock:
            if self._finished:
                return self._error
            self._finished = True
            try:
                for work in self._works:
                    work.wait()
                if self._epilogue is not None:
                    self._epilogue()
            except BaseException as exc:  # noqa: BLE001 - kept, raised by wait() and the Future
                self._error = exc
            return self._error

    def wait(self, timeout: Any = None) -> bool:
        """Block until the op finished (or `timeout` passed); raises the op's error."""
        seconds = timeout_seconds(timeout)
        if self._group is not None and not self.is_completed():
            refuse_blocking_in_callback(self._group, "Work.wait()")
        for work in self._works:
            work.wait(seconds)
        error = self._finish()
        if error is not None:
            raise error
        if self._after is not None:
            self._after.wait()
        return True

    def is_completed(self) -> bool:
        """True once every part of the op finished."""
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        """True once the op finished without an error."""
        return self.is_completed() and self.exception() is None

    def exception(self) -> Optional[BaseException]:
        """The op's error, or None (while running too)."""
        for work in self._works:
            exc = work.exception()
            if exc is not None:
                return exc
        return self._error

    def result(self) -> list:
        """The output tensors, after waiting."""
        self.wait()
        return self._result

    def source_rank(self) -> int:
        """For a recv from any source: the group rank the message came from."""
        if self._source is None:
            raise ValueError("source_rank() is only defined for a recv from any source.")
        self.wait()
        return self._source()

    def _source_rank(self) -> int:
        return self.source_rank()

    def synchronize(self) -> None:
        """On the host, the same as wait()."""
        self.wait()

    def get_future(self) -> torch.futures.Future:
        """A torch Future completed with `result()` (or the error) when the op finishes; its
        error reads in Python as a RuntimeError quoting shoal's, as gloo's do."""
        with self._lock:
            if self._future is not None:
                return self._future
            future = torch.futures.Future()
            self._future = future.then(_value_or_error)
        pending = [len(self._works)]
        count_lock = threading.Lock()

        def one_done(_work) -> None:
            with count_lock:
                pending[0] -= 1
                last = pending[0] == 0
            if not last:
                return
            error = self._finish()
            _completing.group = self._group
            try:
                if error is None:
                    future.set_result(self._result)  # runs the `then` callbacks, here
                else:
                    future.set_exception(error)
            finally:
                _completing.group = None

        if not self._works:
            pending[0] = 1
            one_done(None)
        for work in self._works:
            work.add_done_callback(one_done)
        return self._future


def _value_or_error(future: torch.futures.Future) -> Any:
    """The value of `future`, or its error raised. torch's Python `set_exception` stores the
    exception as the Future's *value* (only Python's wait() re-raises it), so C++ readers such
    as DDP's reducer took it for the tensors and crashed; raised in a `then` callback, it
    completes the chained Future with an error that every reader sees."""
    return future.value()
