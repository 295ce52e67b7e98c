"""RPC profiling across two spawned workers: the caller's event names both workers and the
function; the callee's events (the ops the remote function ran) come back attributed to it."""

from __future__ import annotations

import json
import os
import tempfile
import threading

from shoal.rpc_agent.functions import async_execution

from tests.support.rpc_workers import RpcWorkers


def remote_work(n):
    from shoal import core  # noqa: PLC0415

    x = core.ones(n, n)
    return float(((x + x) * 3).sum().item())


def profile_calls():
    from shoal import rpc_agent  # noqa: PLC0415
    from shoal.core import profiler  # noqa: PLC0415

    with profiler.profile() as prof:
        a = rpc_agent.rpc_sync("w1", remote_work, (4,))
        b = rpc_agent.rpc_async("w1", remote_work, (5,)).wait(30)
    path = os.path.join(tempfile.mkdtemp(), "t.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        doc = json.load(f)
    events = [(fe.name, fe.ev.cat, fe.ev.args) for fe in prof.events()]
    lanes = [e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"]
    return a, b, events, lanes


def fails(msg):
    raise ValueError(msg)


def profile_failing_calls():
    from shoal import rpc_agent  # noqa: PLC0415
    from shoal.core import profiler  # noqa: PLC0415

    seen = []
    with profiler.profile() as prof:
        for call in (lambda: rpc_agent.rpc_sync("w1", fails, ("sync boom",)),
                     lambda: rpc_agent.rpc_async("w1", fails, ("async boom",)).wait(30),
                     # (the creation's reply, which ends the caller's event, not to_here's)
                     lambda: rpc_agent.remote("w1", fails, ("remote boom",))
                     ._get_future().wait(30)):
            try:
                call()
            except ValueError as exc:
                seen.append(str(exc))
    names = [fe.name for fe in prof.events() if fe.ev.cat in ("rpc", "rpc_remote")]
    return seen, names


ASYNC_DELAY_S = 0.15


@async_execution
def async_work(n):
    """Runs ops at once, answers ASYNC_DELAY_S later from another thread (the continuation)."""
    from shoal import core  # noqa: PLC0415
    from shoal.rpc_agent import Future  # noqa: PLC0415

    total = float((core.ones(n, n) * 2).sum().item())
    fut = Future("async_work")
    threading.Timer(ASYNC_DELAY_S, fut.set_result, (total,)).start()
    return fut


def profile_remote_and_async():
    from shoal import rpc_agent  # noqa: PLC0415
    from shoal.core import profiler  # noqa: PLC0415

    with profiler.profile() as prof:
        rref = rpc_agent.remote("w1", remote_work, (3,))
        rref._get_future().wait(30)
        local = rpc_agent.remote("w0", remote_work, (2,))
        local._get_future().wait(30)
        a = rpc_agent.rpc_sync("w1", async_work, (4,))
        b = rpc_agent.rpc_async("w1", async_work, (5,)).wait(30)
        r = rpc_agent.remote("w1", async_work, (6,))
        r._get_future().wait(30)
    values = (rref.to_here(30), local.to_here(30), a, b, r.to_here(30))
    events = [(fe.name, fe.ev.cat, fe.ev.dur, fe.ev.args) for fe in prof.events()]
    return values, events


def calls_without_profiler():
    from shoal import rpc_agent  # noqa: PLC0415

    return rpc_agent.rpc_sync("w1", remote_work, (2,))


def test_rpc_events_name_both_workers_and_carry_the_callees_ops():
    with RpcWorkers(2) as pool:
        a, b, events, lanes = pool.run(0, profile_calls)
        assert (a, b) == (4 * 4 * 6.0, 5 * 5 * 6.0)
        fname = f"{__name__}.remote_work"
        callers = [(n, args) for n, cat, args in events if cat == "rpc"]
        assert [n for n, _ in callers] == [f"rpc_sync#{fname}(w0 -> w1)",
                                           f"rpc_async#{fname}(w0 -> w1)"]
        assert all(args["caller"] == "w0" and args["callee"] == "w1" for _, args in callers)
        remote = [(n, cat, args) for n, cat, args in events if args and args.get("node") == "w1"]
        names = [n for n, _, _ in remote]
        assert names.count("add") == 2 and names.count("mul") == 2 and names.count("sum") == 2
        assert names.count("ones") == 2
        assert names.count(f"rpc_remote#{fname}(w0 -> w1)") == 2
        # nothing of the callee's ran on the caller: its own ops are only the remote ones
        assert not [n for n, cat, args in events if cat == "cpu_op" and not args]
        assert "remote w1" in lanes
        # the callee is left unprofiled afterwards, and plain calls still work
        assert pool.run(0, calls_without_profiler) == 24.0
        # a remote exception reaches the caller as itself; its call is still an event
        seen, names = pool.run(0, profile_failing_calls)
        assert [s.splitlines()[0] for s in seen] == ["sync boom", "async boom",
                                                      "remote boom"], seen
        assert sum(n.startswith("rpc_sync#") for n in names) == 1
        assert sum(n.startswith("rpc_async#") for n in names) == 1
        assert sum(n.startswith("remote#") for n in names) == 1
        pool.shutdown()


def test_remote_and_async_execution_calls_are_profiled_on_both_sides():
    with RpcWorkers(2) as pool:
        values, events = pool.run(0, profile_remote_and_async)
        # the owners keep the plain values (not the profiler's wrapper)
        assert values == (3 * 3 * 6.0, 2 * 2 * 6.0, 4 * 4 * 2.0, 5 * 5 * 2.0, 6 * 6 * 2.0)
        work, later = f"{__name__}.remote_work", f"{__name__}.async_work"
        callers = [(n, args) for n, cat, _, args in events if cat == "rpc"]
        assert [n for n, _ in callers] == [
            f"remote#{work}(w0 -> w1)", f"remote#{work}(w0 -> w0)",
            f"rpc_sync#{later}(w0 -> w1)", f"rpc_async#{later}(w0 -> w1)",
            f"remote#{later}(w0 -> w1)",
        ]
        assert all(args["caller"] == "w0" and args["function"] in (work, later)
                   for _, args in callers)
        on_w1 = [(n, dur) for n, _, dur, args in events if args and args.get("node") == "w1"]
        names = [n for n, _ in on_w1]
        # remote_work(3): ones, add, mul, sum; each async_work: ones, mul, sum
        assert names.count("ones") == 4 and names.count("add") == 1
        assert names.count("mul") == 4 and names.count("sum") == 4
        assert names.count(f"rpc_remote#{work}(w0 -> w1)") == 1
        # the callee's event of an async function lasts until its Future completed
        spans = [dur for n, dur in on_w1 if n == f"rpc_remote#{later}(w0 -> w1)"]
        assert len(spans) == 3 and min(spans) >= ASYNC_DELAY_S * 1e9 * 0.9, spans
        on_w0 = [n for n, _, _, args in events if args and args.get("node") == "w0"]
        assert on_w0.count(f"rpc_remote#{work}(w0 -> w0)") == 1
        pool.shutdown()
