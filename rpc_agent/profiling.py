"""RPC events on both sides, as torch's RPC profiling: while the caller profiles, the call goes
out wrapped, the callee records what the function runs (its ops included) on that thread, and
the events ride back with the result into the caller's trace, attributed to the callee.

Timestamps cross as wall-clock nanoseconds; on different hosts they are as far apart as the
hosts' clocks (`shoal trace merge` aligns whole ranks, not these shipped events).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from shoal.core.profiler import instrument, state
from shoal.core.profiler.events import EPOCH_OFFSET_NS, Event, Recorder, now_ns
from shoal.rpc_agent import _current
from shoal.rpc_agent.agent import qualified_name
from shoal.rpc_agent.functions import is_async_execution
from shoal.rpc_agent.futures import Future

_local_lock = threading.Lock()


class ProfiledResult:
    """What a profiled call returns: the value and the callee's events (wall-clock ns)."""

    __slots__ = ("value", "events", "worker")

    def __init__(self, value: Any, events: list, worker: str) -> None:
        self.value = value
        self.events = events
        self.worker = worker


class ProfiledCall:
    """`func` run under a recorder of the serving thread's own."""

    def __init__(self, func: Callable, fname: str, caller: str) -> None:
        self.func = func
        self.fname = fname
        self.caller = caller

    def __call__(self, *args: Any, **kwargs: Any) -> ProfiledResult:
        rec = Recorder()
        worker = _current.get().info.name
        with _local_lock:
            state.local_users += 1
        instrument.install()
        state.local.recorder = rec
        t0 = now_ns()
        try:
            value = self.func(*args, **kwargs)
        finally:
            t1 = now_ns()
            state.local.recorder = None
            instrument.uninstall()
            with _local_lock:
                state.local_users -= 1
        rec.close()
        rec.add(Event(f"rpc_remote#{self.fname}({self.caller} -> {worker})", "rpc_remote", t0,
                      t1 - t0, threading.get_ident()))
        shipped = [(ev.name, ev.cat, ev.start + EPOCH_OFFSET_NS, ev.dur, ev.flow)
                   for ev in rec.events]
        return ProfiledResult(value, shipped, worker)


def _unwrap(rec: Recorder, result: Any, caller_event: Event, callee: str) -> Any:
    if not isinstance(result, ProfiledResult):
        return result
    tid = -abs(hash(("rpc callee", callee)))  # one lane per callee in the caller's trace
    rec.thread_names[tid] = f"remote {callee}"
    for name, cat, wall_start, dur, _flow in result.events:
        rec.add(Event(name, "rpc_remote" if cat == "rpc_remote" else cat,
                      wall_start - EPOCH_OFFSET_NS, dur, tid,
                      {"node": callee, "rpc": caller_event.name}))
    return result.value


def _names(to: Any, func: Callable) -> tuple[str, str, str]:
    agent = _current.get()
    return agent.info.name, agent.worker_info(to).name, qualified_name(func)


def wanted(func: Callable) -> Optional[Recorder]:
    """The recorder a call from this thread goes to, or None (also for @async_execution
    functions, whose Future the wrapper could not return)."""
    rec = state.recorder if not state.local_users else state.current()
    if rec is None or is_async_execution(func):
        return None
    return rec


def profiled_sync(rec: Recorder, to: Any, func: Callable, args: Optional[tuple],
                  kwargs: Optional[dict], timeout: Any) -> Any:
    """rpc_sync with a caller event naming both workers and the callee's events shipped back."""
    caller, callee, fname = _names(to, func)
    t0 = now_ns()
    ev = Event(f"rpc_sync#{fname}({caller} -> {callee})", "rpc", t0, 0, threading.get_ident(),
               {"caller": caller, "callee": callee, "function": fname})
    try:
        result = _current.get().call_sync(to, ProfiledCall(func, fname, caller), args, kwargs,
                                          timeout)
    finally:
        ev.dur = now_ns() - t0
        rec.add(ev)
    return _unwrap(rec, result, ev, callee)


def profiled_async(rec: Recorder, to: Any, func: Callable, args: Optional[tuple],
                   kwargs: Optional[dict], timeout: Any) -> Future:
    """rpc_async likewise; the caller's event ends when the reply arrives."""
    caller, callee, fname = _names(to, func)
    t0 = now_ns()
    ev = Event(f"rpc_async#{fname}({caller} -> {callee})", "rpc", t0, 0, threading.get_ident(),
               {"caller": caller, "callee": callee, "function": fname})
    inner = _current.get().call(to, ProfiledCall(func, fname, caller), args, kwargs, timeout,
                                "async")
    outer: Future = Future(f"the async call of {fname} on worker {callee!r}")

    def done(f: Future) -> None:
        ev.dur = now_ns() - t0
        rec.add(ev)
        exc = f.exception()
        if exc is not None:
            outer.set_exception(exc)
        else:
            outer.set_result(_unwrap(rec, f.value(), ev, callee))

    inner.add_done_callback(done)
    return outer
