"""`Future`: the result of `rpc_async`, which is shoal's one Future (`collectives.futures`)
raising the agent's errors; `collect_all` and `wait_all` are that module's.

The subclass adds no method and no state: it only names the errors, so that a call's future
raises `RpcTimeout` from wait() and `RpcError` on misuse, and `except RpcError` around an RPC
holds as torch's RuntimeError does. Every shoal Future (a Work's get_future() too) is a
`collectives.Future`, which is what the agent accepts from an @async_execution function.
"""

from __future__ import annotations

from typing import TypeVar

from shoal.collectives import futures as _base
from shoal.collectives.futures import collect_all, wait_all
from shoal.rpc_agent.types import RpcError, RpcTimeout

__all__ = ["AnyFuture", "Future", "collect_all", "wait_all"]

T = TypeVar("T")
# The class every shoal Future is an instance of (what @async_execution may return).
AnyFuture = _base.Future


class Future(_base.Future[T]):
    """A value that arrives later (`wait`, `value`, `done`, `then`, `add_done_callback`), with
    the RPC agent's errors: RpcTimeout when a wait runs out, RpcError on misuse."""

    __slots__ = ()
    timeout_error = RpcTimeout
    state_error = RpcError
