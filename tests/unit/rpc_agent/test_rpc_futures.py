"""Future: waits, values, callbacks, chaining and the collections, across threads."""

from __future__ import annotations

import threading
import time

import pytest

from shoal.rpc_agent import Future, RpcError, RpcTimeout, collect_all, wait_all


def _later(fut, value=None, exc=None, delay=0.05):
    def run():
        time.sleep(delay)
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)
    threading.Thread(target=run, daemon=True).start()


def test_wait_returns_the_value_set_from_another_thread():
    fut = Future("a test future")
    assert not fut.done()
    _later(fut, 42)
    assert fut.wait(5) == 42
    assert fut.done() and fut.value() == 42 and fut.exception() is None


def test_wait_raises_the_exception_and_times_out_naming_the_future():
    fut = Future("the call of f on worker 'w1'")
    with pytest.raises(RpcTimeout, match=r"Waited 0.05s for the call of f on worker 'w1'; it is "
                                         r"still pending."):
        fut.wait(0.05)
    with pytest.raises(RpcError, match="not done yet"):
        fut.value()
    fut.set_exception(KeyError("k"))
    with pytest.raises(KeyError):
        fut.wait(1)
    with pytest.raises(RpcError, match="already completed"):
        fut.set_result(1)
    with pytest.raises(TypeError):
        Future().set_exception("not an exception")


def test_callbacks_run_once_in_order_and_then_chains():
    fut = Future()
    seen = []
    fut.add_done_callback(lambda f: seen.append(("a", f.value())))
    fut.add_done_callback(lambda f: seen.append(("b", f.value())))
    doubled = fut.then(lambda f: f.value() * 2)
    failing = fut.then(lambda f: 1 / 0)
    fut.set_result(21)
    assert seen == [("a", 21), ("b", 21)]
    assert doubled.wait(1) == 42
    with pytest.raises(ZeroDivisionError):
        failing.wait(1)
    late = []
    fut.add_done_callback(lambda f: late.append(f.value()))  # already done: runs at once
    assert late == [21]


def test_a_raising_callback_does_not_stop_the_others(caplog):
    fut = Future("f")
    seen = []
    fut.add_done_callback(lambda f: 1 / 0)
    fut.add_done_callback(lambda f: seen.append(True))
    fut.set_result(None)
    assert seen == [True]
    assert "A done-callback of f raised" in caplog.text


def test_collect_all_and_wait_all():
    futs = [Future() for _ in range(5)]
    combined = collect_all(futs)
    for i, fut in enumerate(reversed(futs)):
        _later(fut, i, delay=0.01 * i)
    assert combined.wait(5) == futs
    assert wait_all(futs, timeout=5) == [4, 3, 2, 1, 0]
    assert collect_all([]).wait(1) == []
    bad = [Future(), Future()]
    bad[0].set_result(1)
    bad[1].set_exception(ValueError("second failed"))
    with pytest.raises(ValueError, match="second failed"):
        wait_all(bad, timeout=1)


def test_many_waiters_all_wake():
    fut = Future()
    results = []
    threads = [threading.Thread(target=lambda: results.append(fut.wait(5))) for _ in range(8)]
    for t in threads:
        t.start()
    fut.set_result("go")
    for t in threads:
        t.join(5)
    assert results == ["go"] * 8
