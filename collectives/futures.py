"""shoal's one Future, in the shape of torch.futures.Future: what `Work.get_future()` and DDP
communication hooks return (as `collectives.Future`) and, under the RPC agent's errors, what
`rpc_async` returns (`rpc_agent.Future`, a subclass that only names those errors).

Completion wakes waiters through a lock that is held while pending, which costs far less than
a Condition per call; callbacks run in the thread that completes the future (the RPC agent
makes sure that is never its network thread when callbacks are attached). A Future made from a
process group's `Work` carries a driver: the first wait() makes progress through it (the reducer
at the end of backward), unless the work's own completion callback completed it earlier;
`then()` chains a transformation (decompression, division) that runs once the parent is done.

A callback added on a thread that profiles an RPC for its caller (a thread-local recorder, see
rpc_agent/profiling.py) runs under that recorder on whichever thread completes the future, so
the ops of an @async_execution function's continuation reach the caller's trace too.
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any, Callable, Generic, Iterable, List, Optional, TypeVar

from shoal.collectives.types import CollectiveTimeout, DistError
from shoal.core.profiler import state as _profiler
from shoal.core.timeouts import TimeoutLike, to_seconds

logger = logging.getLogger(__name__)

T = TypeVar("T")
_PENDING = object()
# One lock for every future's state change: held for a few bytecodes, never while waiting.
_state_lock = threading.Lock()
_marks = threading.local()


def set_blocking_hook(hook: Optional[Callable[[], None]]) -> None:
    """Have `before_blocking` on this thread call `hook` (None clears it).

    An RPC stream reader that runs an incoming call itself sets one: when the call blocks on a
    Future (a nested RPC), reading passes to another thread first, since the reply it waits for
    may come on that very stream.
    """
    _marks.hook = hook


def before_blocking() -> None:
    """Called by `Future.wait` before it blocks: run this thread's blocking hook, if any."""
    hook = getattr(_marks, "hook", None)
    if hook is not None:
        hook()


class Future(Generic[T]):
    """A value that arrives later: `wait`, `value`, `done`, `then`, `add_done_callback`.

    `driver(seconds)`, when given, is called by a pending wait() to make progress (wait on a
    Work); without one, wait() blocks until another thread calls set_result or set_exception.
    """

    __slots__ = ("_done_lock", "_result", "_exception", "_callbacks", "_driver", "description",
                 "__weakref__")
    # What wait() raises when time runs out, and value()/set_* on misuse. A subclass names its
    # layer's errors (rpc_agent.Future: RpcTimeout and RpcError) without a method of its own.
    timeout_error: type = CollectiveTimeout
    state_error: type = DistError

    def __init__(self, description: str = "a future", *,
                 driver: Optional[Callable[[Optional[float]], None]] = None):
        self._done_lock = threading.Lock()
        self._done_lock.acquire()
        self._result: Any = _PENDING
        self._exception: Optional[BaseException] = None
        self._callbacks: Optional[list] = None
        self._driver = driver
        self.description = description

    # -- state

    def done(self) -> bool:
        """True once a result or an exception is set."""
        return self._result is not _PENDING

    def has_callbacks(self) -> bool:
        """True if completing this future would run callbacks (the RPC agent routes those off
        its network thread)."""
        return bool(self._callbacks)

    def wait(self, timeout: TimeoutLike = None) -> T:
        """Block until done and return the value, or raise the exception.

        Raises:
            timeout_error: still pending after `timeout` seconds (the future stays usable).
        """
        if self._result is _PENDING:
            seconds = to_seconds(timeout)
            if self._driver is not None:
                self._driver(seconds)
            if not self.wait_done(seconds):
                raise self.timeout_error(
                    f"Waited {seconds:g}s for {self.description}; it is still pending."
                )
        return self.value()

    def wait_done(self, seconds: Optional[float]) -> bool:
        """Block until done or `seconds` passed (None: no limit); True if done. Runs no driver."""
        if self._result is _PENDING:
            before_blocking()
            if not self._done_lock.acquire(timeout=-1 if seconds is None else seconds):
                return False
            self._done_lock.release()
        return True

    def value(self) -> T:
        """The value of a done future (raising its exception, if it failed).

        Raises:
            state_error: the future is not done yet.
        """
        result = self._result
        if result is _PENDING:
            raise self.state_error(f"value() called on {self.description}, which is not done "
                                   "yet; use wait() to block for it.")
        if self._exception is not None:
            raise self._exception
        return result

    def exception(self) -> Optional[BaseException]:
        """The exception of a done future, or None."""
        return self._exception

    # -- completion

    def set_result(self, result: T) -> None:
        """Complete with `result` and run the callbacks chained on it.

        Raises:
            state_error: the future was already completed.
        """
        if not self.try_complete(result, None):
            raise self.state_error(f"set_result on {self.description}, which is already "
                                   "completed.")

    def set_exception(self, exception: BaseException) -> None:
        """Complete with `exception`, which `wait` and `value` raise.

        Raises:
            state_error: the future was already completed.
        """
        if not isinstance(exception, BaseException):
            raise TypeError(f"set_exception needs an exception, got {exception!r}.")
        if not self.try_complete(None, exception):
            raise self.state_error(f"set_exception on {self.description}, which is already "
                                   "completed.")

    def try_complete(self, result: Any, exception: Optional[BaseException] = None) -> bool:
        """Set the outcome unless one is set already; False if it was (a timeout racing a
        reply, or a work's two ways of finishing)."""
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
        except Exception:  # a user's callback must not stop the others (it is logged)
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
        """A new Future (of this one's class) completed with `callback(self)`'s return value
        (or its exception); waiting on it drives this one, when this one has a driver."""
        child: Future = type(self)(f"then() of {self.description}",
                                   driver=None if self._driver is None else self._drive)

        def run(fut: Future) -> None:
            try:
                child.set_result(callback(fut))
            except BaseException as exc:  # noqa: BLE001  (the child carries it to its waiter)
                child.set_exception(exc)

        self.add_done_callback(run)
        return child

    def _drive(self, seconds: Optional[float]) -> None:
        if self._result is _PENDING and self._driver is not None:
            self._driver(seconds)
        self.wait_done(seconds)

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._exception else "done")
        return f"<{type(self).__name__} {state}: {self.description}>"


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
    """A Future (of the first input's class) completed, once every input is done, with the list
    of the input futures."""
    futures = list(futures)
    kind = type(futures[0]) if futures else Future
    combined: Future[List[Future]] = kind(f"collect_all of {len(futures)} futures")
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


def wait_all(futures: Iterable[Future], timeout: TimeoutLike = None) -> list:
    """Wait for every future and return their values; raises the first failure in list order."""
    futures = list(futures)
    collect_all(futures).wait(timeout)
    return [fut.value() for fut in futures]


# ----------------------------------------------------------------------------- from a Work

def future_from_work(work: Any, result: Any) -> Future:
    """A Future that completes with `result` once the process-group `work` finishes.

    When the work offers `add_done_callback`, the Future completes (and runs what is chained
    on it) in the backend's thread as soon as the collective ends; otherwise the first wait()
    completes it.
    """
    def finish(exc: Optional[BaseException]) -> None:
        fut.try_complete(result if exc is None else None, exc)

    def driver(seconds: Optional[float]) -> None:
        try:
            work.wait(seconds)
        except BaseException as exc:  # noqa: BLE001  (the Future's waiter gets it)
            finish(exc)
        else:
            finish(None)

    fut = Future("the Future of a collective", driver=driver)
    add_done_callback = getattr(work, "add_done_callback", None)
    if add_done_callback is not None:
        add_done_callback(lambda w: finish(w.exception()))
    return fut


def completed_future(result: Any) -> Future:
    """A Future that is already done with `result`."""
    fut = Future("a completed future")
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
    def finish(done: Any) -> None:
        if fut.done():
            return
        exc = done.exception()
        fut.try_complete(done.result() if exc is None else None, exc)

    def driver(seconds: Optional[float]) -> None:
        try:
            work.wait(seconds)
        except BaseException:
            if not work.is_completed():
                raise  # still running after `seconds`: the caller's timeout
        finish(work)  # a failed work's error reaches the Future through finish

    fut = Future("the Future of a collective", driver=driver)
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
