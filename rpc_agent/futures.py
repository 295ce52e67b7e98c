"""`Future`: the result of `rpc_async`, thread-safe, with torch.futures' methods.

Completion wakes waiters through a lock that is held while pending, which costs far less than
a Condition per call; callbacks run in the thread that completes the future (the agent makes
sure that is never its network thread when callbacks are attached).

A callback added on a thread that profiles an RPC for its caller (a thread-local recorder, see
rpc_agent/profiling.py) runs under that recorder on whichever thread completes the future, so
the ops of an @async_execution function's continuation reach the caller's trace too.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Generic, Iterable, List, Optional, TypeVar

from shoal.core.profiler import state as _profiler
from shoal.core.timeouts import to_seconds
from shoal.rpc_agent._threads import before_blocking
from shoal.rpc_agent.types import RpcError, RpcTimeout, TimeoutArg

logger = logging.getLogger(__name__)

T = TypeVar("T")
_PENDING = object()
# One lock for every future's state change: held for a few bytecodes, never while waiting.
_state_lock = threading.Lock()


class Future(Generic[T]):
    """A value that arrives later: `wait`, `value`, `done`, `then`, `add_done_callback`."""

    __slots__ = ("_done_lock", "_result", "_exception", "_callbacks", "description", "__weakref__")

    def __init__(self, description: str = "a future"):
        self._done_lock = threading.Lock()
        self._done_lock.acquire()
        self._result: Any = _PENDING
        self._exception: Optional[BaseException] = None
        self._callbacks: Optional[list] = None
        self.description = description

    # -- state

    def done(self) -> bool:
        """True once a result or an exception is set."""
        return self._result is not _PENDING

    def has_callbacks(self) -> bool:
        """True if completing this future would run callbacks (the agent routes those off its
        network thread)."""
        return bool(self._callbacks)

    def wait(self, timeout: TimeoutArg = None) -> T:
        """Block until done and return the value, or raise the exception.

        Raises:
            RpcTimeout: still pending after `timeout` seconds (the future stays usable).
        """
        if self._result is _PENDING:
            seconds = to_seconds(timeout)
            before_blocking()
            if not self._done_lock.acquire(timeout=-1 if seconds is None else seconds):
                raise RpcTimeout(
                    f"Waited {seconds:g}s for {self.description}; it is still pending."
                )
            self._done_lock.release()
        return self.value()

    def wait_done(self, seconds: Optional[float]) -> bool:
        """Block until done or `seconds` passed (None: no limit); True if done."""
        if self._result is _PENDING:
            before_blocking()
            if not self._done_lock.acquire(timeout=-1 if seconds is None else seconds):
                return False
            self._done_lock.release()
        return True

    def value(self) -> T:
        """The value of a done future (raising its exception, if it failed).

        Raises:
            RpcError: the future is not done yet.
        """
        result = self._result
        if result is _PENDING:
            raise RpcError(f"value() called on {self.description}, which is not done yet; "
                           "use wait() to block for it.")
        if self._exception is not None:
            raise self._exception
        return result

    def exception(self) -> Optional[BaseException]:
        """The exception of a done future, or None."""
        return self._exception

    # -- completion

    def set_result(self, result: T) -> None:
        """Complete with `result`.

        Raises:
            RpcError: the future was already completed.
        """
        if not self._complete(result, None):
            raise RpcError(f"set_result on {self.description}, which is already completed.")

    def set_exception(self, exception: BaseException) -> None:
        """Complete with `exception`, which `wait` and `value` raise.

        Raises:
            RpcError: the future was already completed.
        """
        if not isinstance(exception, BaseException):
            raise TypeError(f"set_exception needs an exception, got {exception!r}.")
        if not self._complete(None, exception):
            raise RpcError(f"set_exception on {self.description}, which is already completed.")

    def _complete(self, result: Any, exception: Optional[BaseException]) -> bool:
        """Set the outcome once; False if it was already set (a timeout racing a reply)."""
        with _state_lock:
            if self._result is not _PENDING:
                return False
            self._exception = exception
            self._result = result
            callbacks, self._callbacks = self._callbacks, None
        self._done_lock.release()
        if callbacks:
            for callback in callbacks:
                self._run_callback(callback)
        return True

    def _run_callback(self, callback: Callable) -> None:
        try:
            callback(self)
        except Exception:  # a user callback must not break completion of the others
            logger.exception("A done-callback of %s raised; ignoring it.", self.description)

    # -- chaining

    def add_done_callback(self, callback: Callable[["Future[T]"], Any]) -> None:
        """Run `callback(self)` once done (at once, in this thread, if already done)."""
        if _profiler.local_users:  # the one check unprofiled code pays
            callback = _following_this_threads_recorder(callback)
        with _state_lock:
            if self._result is _PENDING:
                if self._callbacks is None:
                    self._callbacks = [callback]
                else:
                    self._callbacks.append(callback)
                return
        self._run_callback(callback)

    def then(self, callback: Callable[["Future[T]"], Any]) -> "Future":
        """A new Future completed with `callback(self)`'s return value (or its exception)."""
        child: Future = Future(f"then() of {self.description}")

        def run(fut: Future) -> None:
            try:
                child.set_result(callback(fut))
            except BaseException as exc:  # noqa: BLE001  (the child carries it to its waiter)
                child.set_exception(exc)

        self.add_done_callback(run)
        return child

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._exception else "done")
        return f"<Future {state}: {self.description}>"


def _following_this_threads_recorder(callback: Callable) -> Callable:
    """`callback`, run under this thread's own profiling recorder wherever it runs (as is when
    this thread has none, or once that recorder's window closed: the reply is gone)."""
    rec = getattr(_profiler.local, "recorder", None)
    if rec is None:
        return callback

    def under_recorder(fut: "Future") -> Any:
        if rec.closed:
            return callback(fut)
        previous = _profiler.push_local(rec)
        try:
            return callback(fut)
        finally:
            _profiler.pop_local(previous)

    return under_recorder


def collect_all(futures: Iterable[Future]) -> Future:
    """A Future completed, once every input is done, with the list of the input futures."""
    futures = list(futures)
    combined: Future[List[Future]] = Future(f"collect_all of {len(futures)} futures")
    if not futures:
        combined.set_result([])
        return combined
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            combined.set_result(futures)

    for fut in futures:
        fut.add_done_callback(one_done)
    return combined


def wait_all(futures: Iterable[Future], timeout: TimeoutArg = None) -> list:
    """Wait for every future and return their values; raises the first failure in list order."""
    futures = list(futures)
    collect_all(futures).wait(timeout)
    return [fut.value() for fut in futures]
