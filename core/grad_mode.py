"""Grad mode: whether ops record the autograd graph, per thread (no_grad and friends)."""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable


class _GradMode(threading.local):
    # Thread-local like torch's: a backward running in an RPC thread must not see another
    # thread's no_grad block.
    enabled = True


# This thread's grad mode. Ops read `grad_mode.enabled` directly: it is on every op's path.
grad_mode = _GradMode()


def is_grad_enabled() -> bool:
    """Whether ops record the graph in this thread."""
    return grad_mode.enabled


class _GradModeContext:
    """Base of no_grad/enable_grad: a context manager and a function decorator."""

    _target = True

    def __new__(cls, fn: Callable | None = None) -> Any:
        self = super().__new__(cls)
        if fn is not None and callable(fn):  # used bare, as @no_grad
            return self(fn)
        return self

    def __enter__(self) -> None:
        self._prev = grad_mode.enabled
        grad_mode.enabled = self._target

    def __exit__(self, *exc: object) -> None:
        grad_mode.enabled = self._prev

    def __call__(self, fn: Callable) -> Callable:
        target = self._target

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            prev = grad_mode.enabled
            grad_mode.enabled = target
            try:
                return fn(*args, **kwargs)
            finally:
                grad_mode.enabled = prev

        return wrapper


class no_grad(_GradModeContext):  # noqa: N801 - torch's name
    """Context manager (or decorator) under which ops record no graph."""

    _target = False


class enable_grad(_GradModeContext):  # noqa: N801 - torch's name
    """Context manager (or decorator) that turns graph recording back on."""

    _target = True


class set_grad_enabled(_GradModeContext):  # noqa: N801 - torch's name
    """Turn graph recording on or off now; as a context manager, restore it on exit."""

    def __new__(cls, mode: bool) -> "set_grad_enabled":
        return object.__new__(cls)

    def __init__(self, mode: bool) -> None:
        self._prev = grad_mode.enabled
        self._target = bool(mode)
        grad_mode.enabled = self._target

    def __enter__(self) -> None:
        grad_mode.enabled = self._target

    def __exit__(self, *exc: object) -> None:
        grad_mode.enabled = self._prev
