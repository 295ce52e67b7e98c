"""RPC events on both sides, as torch's RPC profiling: while the caller profiles, the call goes
out wrapped, the callee records what the function runs (its ops included) on that thread, and
the events ride back with the result into the caller's trace, attributed to the callee.

When the callee profiles too (every rank under `shoal run --profile`), its own trace gets a copy
of the call's events: the callee's profiler sees the ops it ran, as torch's does.

Timestamps cross as wall-clock nanoseconds; on different hosts they are as far apart as the
hosts' clocks (`shoal trace merge` aligns whole ranks, not these shipped events).

RRef proxy calls (`rref.rpc_sync().m(...)` and the like) are profiled the same way; they reach
this module through the hook `rref.profiled_proxy_call`, which this module fills at import:
profiling imports rref (for RRef), so rref cannot import profiling back without a cycle.
An @async_execution function's continuations are covered by the Future (collectives.futures): a
callback added on the profiled serving thread runs under its recorder on whichever thread fires
it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from shoal.core.profiler import instrument, state
from shoal.core.profiler.events import EPOCH_OFFSET_NS, Event, Recorder, now_ns
from shoal.rpc_agent import _current
from shoal.rpc_agent import rref as _rref
from shoal.rpc_agent.agent import qualified_name
from shoal.rpc_agent.functions import ASYNC_ATTR, is_async_execution
from shoal.rpc_agent.futures import AnyFuture, Future
from shoal.rpc_agent.rref import RRef
from shoal.rpc_agent.profiled_result import ProfiledResult


class ProfiledCall:
    """`func` run under a recorder of the serving thread's own; its events are named `label`.

    For an @async_execution `func` the wrapper is itself @async_execution: it returns a Future
    that completes with the events once `func`'s Future does, so the callee's event covers the
    function and its continuation until the reply. The continuation's ops (Future callbacks
    added while `func` ran, on any thread) are recorded too: the Future (collectives.futures)
    runs such callbacks under this recorder, and the op wrappers stay installed until the reply."""

    def __init__(self, func: Callable, label: str, caller: str) -> None:
        self.func = func
        self.fname = label
        self.caller = caller
        # the agent names calls (frames, errors, timeouts) by the function's own name
        self.__module__ = getattr(func, "__module__", None) or "?"
        self.__qualname__ = qualified_name(func)[len(self.__module__) + 1:]
        if is_async_execution(func):
            setattr(self, ASYNC_ATTR, True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rec = _call_recorder()
        worker = _current.get().info.name
        instrument.install()
        previous = state.push_local(rec)
        t0 = now_ns()
        try:
            # The function was unpickled before the op wrappers were installed: a core op
            # (`core.add`) is the plain one, which would run unrecorded; its wrapper records it.
            value = instrument.wrapper_for(self.func)(*args, **kwargs)
        except BaseException:
            self._finish(rec, t0, now_ns(), worker)  # callbacks it added stop recording into it
            instrument.uninstall()
            raise
        finally:
            t1 = now_ns()
            state.pop_local(previous)
        if not getattr(self, ASYNC_ATTR, False):
            instrument.uninstall()
            return self._result(rec, value, t0, t1, worker)
        if not isinstance(value, AnyFuture):
            self._finish(rec, t0, t1, worker)
            instrument.uninstall()
            return value  # the agent rejects it, naming its type, as without the profiler
        shipped: Future = Future(f"the profiled reply of {self.fname}")

        def done(f: Future) -> None:
            exc = f.exception()
            try:
                if exc is None:
                    result = self._result(rec, f.value(), t0, now_ns(), worker)
                else:
                    self._finish(rec, t0, now_ns(), worker)
            finally:
                instrument.uninstall()  # held for the continuation's ops until now
            if exc is not None:
                shipped.set_exception(exc)
            else:
                shipped.set_result(result)

        value.add_done_callback(done)
        return shipped

    def _finish(self, rec: Recorder, t0: int, t1: int, worker: str) -> None:
        """Close the call's recorder, add the callee's event, and hand a copy of its events to
        this process's own profiler when it records too (as torch's callee profiler sees the
        ops it ran): the call's thread-local recorder hid them from it."""
        rec.close()
        rec.add(Event(f"rpc_remote#{self.fname}({self.caller} -> {worker})", "rpc_remote", t0,
                      t1 - t0, threading.get_ident()))
        own = state.recorder
        if own is not None and self.caller != worker:  # a call to itself ships them to `own`
            own.events.extend(rec.events)  # one call under the GIL: atomic for other threads

    def _result(self, rec: Recorder, value: Any, t0: int, t1: int,
                worker: str) -> ProfiledResult:
        self._finish(rec, t0, t1, worker)
        shipped = [(ev.name, ev.cat, ev.start + EPOCH_OFFSET_NS, ev.dur, ev.flow)
                   for ev in rec.events]
        return ProfiledResult(value, shipped, worker)


def _call_recorder() -> Recorder:
    """The recorder of one profiled call: as detailed as this process's own profiler (shapes,
    stacks) when one records, since its events go there too; memory and CUDA times stay with
    the process's own recorder (one recorder at a time watches frees and CUDA events)."""
    own = state.recorder
    if own is None:
        return Recorder()
    return Recorder(record_shapes=own.record_shapes, with_stack=own.with_stack)


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


def _names(to: Any, func: Callable, label: Optional[str]) -> tuple[str, str, str]:
    agent = _current.get()
    return agent.info.name, agent.worker_info(to).name, label or qualified_name(func)


def wanted(func: Callable) -> Optional[Recorder]:
    """The recorder a call from this thread goes to, or None."""
    return state.recorder if not state.local_users else state.current()


def profiled_sync(rec: Recorder, to: Any, func: Callable, args: Optional[tuple],
                  kwargs: Optional[dict], timeout: Any, label: Optional[str] = None) -> Any:
    """rpc_sync with a caller event naming both workers and the callee's events shipped back.
    The events name the call `label` where given (an RRef proxy's `Type.method`), else by
    `func`'s qualified name."""
    caller, callee, fname = _names(to, func, label)
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
                   kwargs: Optional[dict], timeout: Any, label: Optional[str] = None) -> Future:
    """rpc_async likewise; the caller's event ends when the reply arrives."""
    caller, callee, fname = _names(to, func, label)
    t0 = now_ns()
    ev = Event(f"rpc_async#{fname}({caller} -> {callee})", "rpc", t0, 0, threading.get_ident(),
               {"caller": caller, "callee": callee, "function": fname})
    inner = _current.get().call(to, ProfiledCall(func, fname, caller), args, kwargs, timeout,
                                "async")
    return _ending_with(inner, rec, ev, callee, f"the async call of {fname} on worker {callee!r}")


def profiled_remote(rec: Recorder, to: Any, func: Callable, args: Optional[tuple],
                    kwargs: Optional[dict], timeout: Any, label: Optional[str] = None) -> RRef:
    """remote() likewise: the owner keeps the value, its events come back with the creation
    reply, and the caller's event ends when that reply arrives (the RRef's creation future)."""
    caller, callee, fname = _names(to, func, label)
    t0 = now_ns()
    ev = Event(f"remote#{fname}({caller} -> {callee})", "rpc", t0, 0, threading.get_ident(),
               {"caller": caller, "callee": callee, "function": fname})
    rref = _current.get().remote(to, ProfiledCall(func, fname, caller), args, kwargs, timeout)
    rref.set_creation_future(_ending_with(rref.creation_future(), rec, ev, callee,
                                          f"the remote call of {fname} on worker {callee!r}"))
    return rref


def _ending_with(inner: Future, rec: Recorder, ev: Event, callee: str,
                 description: str) -> Future:
    """A Future of `inner`'s outcome, the callee's events taken out of it: the caller's event
    `ev` ends (and is recorded) when the reply arrives."""
    outer: Future = Future(description)

    def done(f: Future) -> None:
        ev.dur = now_ns() - ev.start
        rec.add(ev)
        exc = f.exception()
        if exc is not None:
            outer.set_exception(exc)
        else:
            outer.set_result(_unwrap(rec, f.value(), ev, callee))

    inner.add_done_callback(done)
    return outer


_PROXIED = {"sync": profiled_sync, "async": profiled_async, "remote": profiled_remote}


def _profiled_proxy_call(mode: str, owner: Any, invoke: Callable, call_args: tuple,
                         timeout: Any, value_type: type, method: str) -> Any:
    """An RRef proxy call (`rref.rpc_sync().method(...)`, mode 'sync', 'async' or 'remote')
    recorded as rpc_sync/rpc_async/remote are, named `<value type>.<method>`; rref.py calls it
    through its hook only while a profiler records in this process."""
    rec = wanted(invoke)
    label = f"{qualified_name(value_type)}.{method}"
    return _PROXIED[mode](rec, owner, invoke, call_args, None, timeout, label)


_rref.profiled_proxy_call = _profiled_proxy_call
