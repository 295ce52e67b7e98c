"""core.jit.fork/wait: torch's task parallelism, on a shared thread pool.

numpy (and cupy) release the GIL inside their kernels, so forked tasks that spend their time
in ops run in parallel. A task that has not started when someone waits on it runs in the
waiting thread instead (work stealing): a forked task may fork and wait on its own children
without exhausting the pool, so nesting cannot deadlock. Each task runs with the grad mode of
the thread that forked it, as torch's fork does.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable

from shoal.core.grad_mode import grad_mode

_PENDING, _RUNNING, _DONE = 0, 1, 2


class Future:
    """The result of a forked call (torch.jit.Future): wait() returns it or raises its error."""

    __slots__ = ("_fn", "_args", "_kwargs", "_grad", "_state", "_value", "_error", "_lock",
                 "_done", "_callbacks", "_after")

    def __init__(self, fn: Callable, args: tuple, kwargs: dict) -> None:
        self._fn, self._args, self._kwargs = fn, args, kwargs
        self._grad = grad_mode.enabled
        self._state = _PENDING
        self._value: Any = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._callbacks: list[Callable] = []
        self._after: Future | None = None  # then(): runs when this future finishes, not before

    def _claim(self) -> bool:
        with self._lock:
            if self._state != _PENDING:
                return False
            self._state = _RUNNING
            return True

    def _run(self) -> None:
        """Run the call here if nobody has started it yet."""
        if not self._claim():
            return
        prev = grad_mode.enabled
        grad_mode.enabled = self._grad
        try:
            self._value = self._fn(*self._args, **self._kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self._error = exc
        finally:
            grad_mode.enabled = prev
            self._fn = self._args = self._kwargs = None
            with self._lock:
                self._state = _DONE
                self._done.set()  # under the lock: then() sees _DONE only once it is set
                callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def done(self) -> bool:
        """Whether the call has finished (with a value or an error)."""
        return self._done.is_set()

    def wait(self, timeout: float | timedelta | None = None) -> Any:
        """The call's value (its exception re-raised); runs it here if it has not started.

        Raises TimeoutError when `timeout` (seconds) passes first."""
        if self._after is None:
            self._run()
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if not self._done.wait(seconds):
            raise TimeoutError(f"core.jit.wait: the forked call did not finish within "
                               f"{seconds}s.")
        if self._error is not None:
            raise self._error
        return self._value

    def value(self) -> Any:
        """The value of a finished call (wait() first)."""
        if not self.done():
            raise RuntimeError("Future.value() called before the forked call finished; "
                               "call wait() first.")
        return self.wait()

    def then(self, callback: Callable[["Future"], Any]) -> "Future":
        """A future of callback(self), run once this one finishes."""
        follow = Future(callback, (self,), {})
        follow._after = self
        with self._lock:
            if self._state != _DONE:
                self._callbacks.append(lambda _: follow._run())
                return follow
        follow._run()
        return follow


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2),
                                       thread_name_prefix="shoal-jit-fork")
        return _pool


def fork(func: Callable, *args: Any, **kwargs: Any) -> Future:
    """Start func(*args, **kwargs) on the shared pool; returns a Future at once."""
    if not callable(func):
        raise TypeError(f"fork(): expected a callable, got {type(func).__name__}")
    fut = Future(func, args, kwargs)
    _executor().submit(fut._run)  # noqa: SLF001 - the pool runs the future it was given
    return fut


def wait(future: Future, timeout: float | timedelta | None = None) -> Any:
    """The value of a forked call (torch.jit.wait); see Future.wait."""
    if not isinstance(future, Future):
        raise TypeError(f"wait(): expected a Future from core.jit.fork, got "
                        f"{type(future).__name__}")
    return future.wait(timeout)
