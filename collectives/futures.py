"""The collectives layer's Future, in the shape of torch.futures.Future: what `Work.get_future()`
returns and what DDP communication hooks return (as `collectives.Future`).

A hook returns a Future whose value is the reduced bucket buffer. A Future made from a
process group's `Work` is completed by whoever waits on it first (the reducer at the end of
backward), or earlier by the work's own completion callback when the backend offers one;
`then()` chains a transformation (decompression, division) that runs once the parent is done.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable, Generic, Optional, TypeVar

from shoal.collectives.types import CollectiveTimeout
from shoal.core.timeouts import TimeoutLike, to_seconds

_UNSET = object()
T = TypeVar("T")


class Future(Generic[T]):
    """A value that becomes available later; `wait()` blocks (with a timeout) until it is."""

    def __init__(self, driver: Optional[Callable[[Optional[float]], None]] = None) -> None:
        # `driver(timeout)` is called by wait() to make progress (e.g. wait on a Work); without
        # one, wait() blocks until another thread calls set_result or set_exception.
        self._driver = driver
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._result: Any = _UNSET
        self._exception: Optional[BaseException] = None
        self._callbacks: list[Callable[["Future"], None]] = []

    def done(self) -> bool:
        """True once a result or an exception is set."""
        return self._event.is_set()

    def set_result(self, result: Any) -> None:
        """Complete the future with `result` and run the callbacks chained on it."""
        self._complete(result, None)

    def set_exception(self, exc: BaseException) -> None:
        """Complete the future with an error that wait() and value() raise."""
        self._complete(_UNSET, exc)

    def _complete(self, result: Any, exc: Optional[BaseException]) -> None:
        with self._lock:
            if self._event.is_set():
                raise RuntimeError("This Future was already completed; it cannot be set twice.")
            self._result = result
            self._exception = exc
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def wait(self, timeout: TimeoutLike = None) -> Any:
        """Block until done (up to `timeout` seconds) and return the value, or raise its error."""
        seconds = to_seconds(timeout)
        if not self._event.is_set() and self._driver is not None:
            self._driver(seconds)
        if not self._event.wait(seconds):
            raise CollectiveTimeout(
                f"A communication Future was not completed within {seconds:g}s; the collective "
                "behind it never finished."
            )
        return self.value()

    def value(self) -> Any:
        """The result of a completed future (raises its exception if it failed)."""
        if not self._event.is_set():
            raise RuntimeError("Future.value() called before the future completed; call wait().")
        if self._exception is not None:
            raise self._exception
        return self._result

    def then(self, callback: Callable[["Future"], Any]) -> "Future":
        """A new Future holding `callback(self)`, computed once this one completes."""
        child = Future(driver=lambda seconds: self._drive(seconds))

        def run(parent: "Future") -> None:
            try:
                value = callback(parent)
            except BaseException as exc:  # the child reports whatever the callback raised
                child.set_exception(exc)
            else:
                child.set_result(value)

        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(run)
                return child
        run(self)
        return child

    def add_done_callback(self, callback: Callable[["Future"], None]) -> None:
        """Call `callback(self)` once done (right away if it already is)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def _drive(self, seconds: Optional[float]) -> None:
        if not self._event.is_set() and self._driver is not None:
            self._driver(seconds)
        self._event.wait(seconds)


def future_from_work(work: Any, result: Any) -> Future:
    """A Future that completes with `result` once the process-group `work` finishes.

    When the work offers `add_done_callback`, the Future completes (and runs what is chained
    on it) in the backend's thread as soon as the collective ends; otherwise the first wait()
    completes it.
    """
    fut = Future()
    claim = threading.Lock()
    claimed = []

    def finish(exc: Optional[BaseException]) -> None:
        with claim:
            if claimed:
                return
            claimed.append(True)
        if exc is None:
            fut.set_result(result)
        else:
            fut.set_exception(exc)

    def driver(seconds: Optional[float]) -> None:
        try:
            work.wait(seconds)
        except BaseException as exc:
            finish(exc)
        else:
            finish(None)

    fut._driver = driver
    add_done_callback = getattr(work, "add_done_callback", None)
    if add_done_callback is not None:
        add_done_callback(lambda w: finish(w.exception()))
    return fut


def completed_future(result: Any) -> Future:
    """A Future that is already done with `result`."""
    fut = Future()
    fut.set_result(result)
    return fut


def missing_future_methods(fut: Any) -> list[str]:
    """What a communication hook's result lacks to be used as a future ([] if nothing).

    Any future-like object is accepted (this Future, rpc_agent's, a Work's get_future(), a
    user's own class), as torch accepts any torch.futures.Future; one without wait() and
    value() would otherwise leave the bucket un-reduced without a word.
    """
    return [m + "()" for m in ("wait", "value") if not callable(getattr(fut, m, None))]

def future_value(fut: Any, waited: Any) -> Any:
    """The value of a future-like object that has been waited on (`waited`: what wait() gave)."""
    value = getattr(fut, "value", None)
    return value() if callable(value) else waited


def work_future(work: Any) -> Future:
    """`work.get_future()`: a Future completed with the work's result (its output arrays, as
    torch's is completed with its output tensors) or its error, when the work finishes."""
    fut: Future = Future()

    def finish(done: Any) -> None:
        if fut.done():
            return
        exc = done.exception()
        try:
            if exc is None:
                fut.set_result(done.result())
            else:
                fut.set_exception(exc)
        except RuntimeError:  # completed by the other path in the meantime
            pass

    def driver(seconds: Optional[float]) -> None:
        try:
            work.wait(seconds)
        except BaseException:
            if not work.is_completed():
                raise  # still running after `seconds`: the caller's timeout
        finish(work)  # a failed work's error reaches the Future through finish

    fut._driver = driver
    work.add_done_callback(finish)
    return fut


def wait_bounded(fut: Any, seconds: Optional[float]) -> Any:
    """`fut.wait(timeout=seconds)` where its wait() takes a timeout (this Future, rpc_agent's);
    a plain torch-style wait() without one is called as it is."""
    try:
        params = inspect.signature(fut.wait).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        params = {}
    takes_timeout = "timeout" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return fut.wait(timeout=seconds) if takes_timeout and seconds is not None else fut.wait()
