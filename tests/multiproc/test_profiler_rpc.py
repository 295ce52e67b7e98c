"""RPC profiling across two spawned workers: the caller's event names both workers and the
function; the callee's events (the ops the remote function ran, also in an @async_execution
function's continuation on another thread) come back attributed to it. RRef proxy calls
(`rref.rpc_sync().m(...)` and the like) are recorded the same way."""

from __future__ import annotations

import json
import os
import tempfile
import threading


from shoal.rpc_agent.functions import async_execution

from tests.support.rpc_workers import RpcWorkers


def remote_work(n):
    from shoal import core

    x = core.ones(n, n)
    return float(((x + x) * 3).sum().item())


def profile_calls():
    from shoal import rpc_agent
    from shoal.core import profiler

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
    from shoal import rpc_agent
    from shoal.core import profiler

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
    """Runs ops at once, answers ASYNC_DELAY_S later from a timer thread (no ops there)."""
    from shoal import core
    from shoal.rpc_agent import Future

    total = float((core.ones(n, n) * 2).sum().item())
    fut = Future("async_work")
    threading.Timer(ASYNC_DELAY_S, fut.set_result, (total,)).start()
    return fut


def profile_remote_and_async():
    from shoal import rpc_agent
    from shoal.core import profiler

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


def _continuation(tick):
    """Runs on the thread that completed `tick` (a timer's): ops of the callee all the same."""
    from shoal import core

    n = tick.value()
    total = float((core.ones(n, n) - core.zeros(n, n)).sum().item())
    return total, isinstance(threading.current_thread(), threading.Timer)


def _and_then(f):
    from shoal import core

    total, on_timer = f.value()
    return float(core.tensor([total]).neg().item()), on_timer


@async_execution
def async_then_work(n):
    """Runs no ops itself: they run ASYNC_DELAY_S later in Future callbacks on a timer thread
    (two chained then()s), as an @async_execution function's continuation does."""
    from shoal.rpc_agent import Future

    tick = Future("async_then_work's tick")
    threading.Timer(ASYNC_DELAY_S, tick.set_result, (n,)).start()
    return tick.then(_continuation).then(_and_then)


def profile_continuations():
    from shoal import rpc_agent
    from shoal.core import profiler

    with profiler.profile() as prof:
        a = rpc_agent.rpc_sync("w1", async_then_work, (3,))
        b = rpc_agent.rpc_async("w1", async_then_work, (4,)).wait(30)
    events = [(fe.name, fe.ev.cat, fe.ev.args) for fe in prof.events()]
    return a, b, events


def callee_left_unprofiled():
    """No thread-local recorder counted and no op wrapper left installed after the calls."""
    from shoal.core.profiler import instrument, state

    return state.local_users, instrument._users, state.recorder


class Meter:
    """A value kept by its owner; RRef proxies call its methods there."""

    def __init__(self):
        self.calls = 0

    def work(self, n):
        from shoal import core

        self.calls += 1
        x = core.ones(n, n)
        return float(((x + x) * 3).sum().item())

    @staticmethod
    @async_execution
    def later(n):
        """An @async_execution method: its ops run in a continuation on a timer thread."""
        return async_then_work(n)


def profile_proxy_calls():
    from shoal import rpc_agent
    from shoal.core import profiler

    meter = rpc_agent.remote("w1", Meter)
    meter._get_future().wait(30)
    mine = rpc_agent.RRef(Meter())
    with profiler.profile() as prof:
        a = meter.rpc_sync().work(3)
        b = meter.rpc_async().work(4).wait(30)
        made = meter.remote().work(5)
        made._get_future().wait(30)
        c = mine.rpc_sync().work(2)
        d = meter.rpc_sync().later(6)
    values = (a, b, made.to_here(30), c, d)
    events = [(fe.name, fe.ev.cat, fe.ev.args) for fe in prof.events()]
    return values, events


_OWN: list = []  # the callee's own profiler, between the two tasks below


def start_own_profiler():
    from shoal.core import profiler

    prof = profiler.profile(record_shapes=True)
    prof.start()
    _OWN.append(prof)


def stop_own_profiler():
    """The callee's own window: (name, category, input shapes or None, thread) of its events."""
    prof = _OWN.pop()
    prof.stop()
    return [(fe.name, fe.ev.cat, fe.ev.shapes, fe.ev.tid) for fe in prof.events()], \
        threading.main_thread().ident


def calls_without_profiler():
    from shoal import rpc_agent

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


def test_ops_of_an_async_functions_continuation_on_another_thread_reach_the_caller():
    with RpcWorkers(2) as pool:
        a, b, events = pool.run(0, profile_continuations)
        # (the continuation really ran on the timer thread, not the serving one)
        assert a == (-9.0, True) and b == (-16.0, True)
        on_w1 = [n for n, cat, args in events if args and args.get("node") == "w1"]
        for op in ("ones", "zeros", "sub", "sum", "tensor", "neg"):
            assert on_w1.count(op) == 2, (op, on_w1)
        fname = f"{__name__}.async_then_work"
        assert on_w1.count(f"rpc_remote#{fname}(w0 -> w1)") == 2
        assert not [n for n, cat, args in events if cat == "cpu_op" and not args]
        # the continuation's recorder is gone with the reply: nothing left on the callee
        assert pool.run(1, callee_left_unprofiled) == (0, 0, None)
        pool.shutdown()


def test_rref_proxy_calls_are_profiled_on_both_sides():
    with RpcWorkers(2) as pool:
        values, events = pool.run(0, profile_proxy_calls)
        assert values == (3 * 3 * 6.0, 4 * 4 * 6.0, 5 * 5 * 6.0, 2 * 2 * 6.0, (-36.0, True))
        work, later = f"{__name__}.Meter.work", f"{__name__}.Meter.later"
        callers = [(n, args) for n, cat, args in events if cat == "rpc"]
        assert [n for n, _ in callers] == [
            f"rpc_sync#{work}(w0 -> w1)", f"rpc_async#{work}(w0 -> w1)",
            f"remote#{work}(w0 -> w1)", f"rpc_sync#{work}(w0 -> w0)",
            f"rpc_sync#{later}(w0 -> w1)",
        ]
        assert [(args["caller"], args["callee"]) for _, args in callers] == [
            ("w0", "w1"), ("w0", "w1"), ("w0", "w1"), ("w0", "w0"), ("w0", "w1")]
        on_w1 = [(n, args) for n, cat, args in events if args and args.get("node") == "w1"]
        names = [n for n, _ in on_w1]
        # three work(): ones, add, mul, sum each; later(): ones, zeros, sub, sum, tensor, neg
        assert names.count("add") == 3 and names.count("mul") == 3, names
        assert names.count("ones") == 4 and names.count("sum") == 4
        assert names.count("sub") == 1 and names.count("neg") == 1
        assert names.count(f"rpc_remote#{work}(w0 -> w1)") == 3
        assert names.count(f"rpc_remote#{later}(w0 -> w1)") == 1
        # each callee event points at the caller's event it belongs to
        assert {args["rpc"] for _, args in on_w1} == {n for n, _ in callers if "w0 -> w1" in n}
        on_w0 = [n for n, cat, args in events if args and args.get("node") == "w0"]
        assert on_w0.count("add") == 1 and on_w0.count(f"rpc_remote#{work}(w0 -> w0)") == 1
        assert not [n for n, cat, args in events if cat == "cpu_op" and not args]
        assert pool.run(1, callee_left_unprofiled) == (0, 0, None)
        pool.shutdown()


def test_a_callee_that_profiles_too_sees_the_ops_it_ran_for_a_profiled_caller():
    with RpcWorkers(2) as pool:
        pool.run(1, start_own_profiler)
        a, b, caller_events, _ = pool.run(0, profile_calls)
        own, main = pool.run(1, stop_own_profiler)
        assert (a, b) == (4 * 4 * 6.0, 5 * 5 * 6.0)
        fname = f"{__name__}.remote_work"
        # the caller still gets the callee's ops...
        shipped = [n for n, _, args in caller_events if args and args.get("node") == "w1"]
        assert shipped.count("add") == 2 and shipped.count("ones") == 2
        # ...and the callee's own window has them too, on its serving threads, with the
        # shapes its own profiler records
        ops = [(n, shapes, tid) for n, cat, shapes, tid in own if cat == "cpu_op"]
        names = [n for n, _, _ in ops]
        assert names.count("ones") == 2 and names.count("add") == 2
        assert names.count("mul") == 2 and names.count("sum") == 2
        assert sorted(shapes for n, shapes, _ in ops if n == "add") == [
            [[4, 4], [4, 4]], [[5, 5], [5, 5]]]
        assert all(tid != main for _, _, tid in ops)
        served = [n for n, cat, _, _ in own if cat == "rpc_remote"]
        assert served == [f"rpc_remote#{fname}(w0 -> w1)"] * 2
        assert pool.run(1, callee_left_unprofiled) == (0, 0, None)
        pool.shutdown()


def profile_core_op_calls():
    """rpc_sync/rpc_async of a core op itself inside profile(): the profiler has swapped
    `core.add` for its timing wrapper, which RPC must still send by its real name."""
    from shoal import core, rpc_agent
    from shoal.core import profiler

    with profiler.profile() as prof:
        a = rpc_agent.rpc_sync("w1", core.add, (core.ones(2, 2), 3))
        b = rpc_agent.rpc_async("w1", core.add, (core.ones(3), core.ones(3))).wait(30)
    events = [(fe.name, fe.ev.cat, fe.ev.args) for fe in prof.events()]
    return a.numpy().tolist(), b.numpy().tolist(), events


def test_a_core_op_sent_by_rpc_inside_profile_pickles_by_its_real_name():
    import torch

    with RpcWorkers(2) as pool:
        a, b, events = pool.run(0, profile_core_op_calls)
        assert a == torch.add(torch.ones(2, 2), 3).tolist()
        assert b == torch.add(torch.ones(3), torch.ones(3)).tolist()
        # torch names a call `rpc_<mode>#<function>(<caller> -> <callee>)`; shoal's function
        # part is the module-qualified name of the op (torch's is its builtin, aten::add)
        fname = "shoal.core.ops.arith.add"
        callers = [n for n, cat, _ in events if cat == "rpc"]
        assert callers == [f"rpc_sync#{fname}(w0 -> w1)", f"rpc_async#{fname}(w0 -> w1)"]
        remote = [n for n, cat, args in events if args and args.get("node") == "w1"]
        assert remote.count(f"rpc_remote#{fname}(w0 -> w1)") == 2
        # and calls made after the profiler stopped send the original function
        assert pool.run(0, calls_without_profiler) == 24.0
        pool.shutdown()


def profile_core_add_remote_ops():
    from shoal import core, rpc_agent
    from shoal.core import profiler

    with profiler.profile() as prof:
        rpc_agent.rpc_sync("w1", core.add, (core.ones(2), 1))
    return [fe.name for fe in prof.events() if fe.ev.args and fe.ev.args.get("node") == "w1"]


def test_the_callee_records_the_core_op_it_ran_for_the_caller():
    with RpcWorkers(2) as pool:
        remote = pool.run(0, profile_core_add_remote_ops)
        pool.shutdown()
    assert remote.count("add") == 1, remote
