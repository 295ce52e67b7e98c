"""`async_execution`: functions that answer an RPC later, through a Future they return."""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

ASYNC_ATTR = "_shoal_async_execution"


def async_execution(fn: F) -> F:
    """Mark `fn` as returning a Future: the callee's thread is freed at once and the reply is
    sent when the Future completes (as torch.distributed.rpc.functions.async_execution).

    The function object itself is marked and returned, so it still pickles by reference and a
    local call still returns the Future.
    """
    setattr(fn, ASYNC_ATTR, True)
    return fn


def is_async_execution(fn) -> bool:
    """True for functions (and bound methods of functions) marked with `async_execution`."""
    return bool(getattr(fn, ASYNC_ATTR, False))
