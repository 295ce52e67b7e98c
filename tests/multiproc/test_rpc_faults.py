"""Faults with real processes: a callee SIGKILLed mid-call, shutdown with calls in flight, a
shutdown that times out naming the missing worker, the default timeout."""

from __future__ import annotations

import os
import time

import pytest

from tests.support.rpc_workers import RpcWorkers


def slow(seconds, value=None):
    time.sleep(seconds)
    return value


def slow_with_marker(path, seconds):
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(seconds)
    return "finished"


def call_and_report(to, fn, args, timeout=None):
    from shoal import rpc_agent

    try:
        value = rpc_agent.rpc_sync(to, fn, args, timeout=timeout)
        return "ok", value, time.monotonic()
    except rpc_agent.RpcError as exc:
        return type(exc).__name__, str(exc), time.monotonic()


@pytest.mark.parametrize("layer", ["direct", "public"])
def test_a_killed_callee_fails_the_call_within_seconds_naming_it(tmp_path, layer):
    """Over both ways the stream can drive gRPC (rpc_agent/transport/direct.py)."""
    marker = str(tmp_path / "started")
    with RpcWorkers(2, env={"SHOAL_RPC_GRPC": layer}) as workers:
        task = workers.submit(0, call_and_report, "w1", slow_with_marker, (marker, 60))
        deadline = time.monotonic() + 30
        while not os.path.exists(marker):
            assert time.monotonic() < deadline, "w1 never started the call"
            time.sleep(0.02)
        killed_at = time.monotonic()
        workers.kill(1)
        kind, message, ended_at = workers.result(task, timeout=30)
        assert kind == "RpcPeerLost", message
        assert message.startswith("The sync call of test_rpc_faults.slow_with_marker on worker "
                                  "'w1' (id 1) failed: the RPC stream to it died"), message
        assert ended_at - killed_at < 5
        # The next call tries to reconnect, and fails quickly, naming the dead worker.
        kind, message, _ = workers.run(0, call_and_report, "w1", slow, (0, None), 10)
        assert kind == "RpcPeerLost"
        assert "'w1' (id 1)" in message
        workers.run(0, _shutdown_now)


def _shutdown_now():
    from shoal import rpc_agent

    rpc_agent.shutdown(graceful=False)


def call_then_shutdown():
    from shoal import rpc_agent

    t = time.monotonic()
    fut = rpc_agent.rpc_async("w1", slow, (1.0, "done in flight"))
    nested = rpc_agent.rpc_async("w2", call_and_report, ("w1", slow, (0.8, "nested")))
    rpc_agent.shutdown(timeout=30)
    return fut.value(), nested.value()[:2], time.monotonic() - t


def test_shutdown_waits_for_calls_in_flight_on_every_worker():
    from shoal import rpc_agent

    with RpcWorkers(3) as workers:
        caller = workers.submit(0, call_then_shutdown)
        others = [workers.submit(r, rpc_agent.shutdown, timeout=30) for r in (1, 2)]
        value, nested, elapsed = workers.result(caller)
        for task in others:
            workers.result(task)
        assert value == "done in flight"
        assert nested == ("ok", "nested")
        assert elapsed >= 0.9


def shutdown_with_timeout(seconds):
    from shoal import rpc_agent

    t = time.monotonic()
    try:
        rpc_agent.shutdown(timeout=seconds)
    except rpc_agent.RpcTimeout as exc:
        return str(exc), time.monotonic() - t
    return None, time.monotonic() - t


def test_shutdown_timeout_names_the_workers_still_pending():
    with RpcWorkers(3) as workers:
        tasks = [workers.submit(r, shutdown_with_timeout, 2.0) for r in (0, 1)]
        for rank, task in zip((0, 1), tasks):
            message, elapsed = workers.result(task, timeout=30)
            assert message == (
                f"RPC shutdown of worker 'w{rank}' timed out after 2s waiting for every worker "
                "to finish its outstanding work: 'w2' (id 2) never reached shutdown."
            )
            assert elapsed < 10
        workers.run(2, _shutdown_now)


def own_work_pending():
    from shoal import rpc_agent

    fut = rpc_agent.rpc_async("w1", slow, (5, None))
    result = shutdown_with_timeout(0.5)
    return result[0], fut.done()


def test_shutdown_timeout_names_its_own_pending_calls():
    with RpcWorkers(2) as workers:
        message, done = workers.run(0, own_work_pending)
        assert message == (
            "RPC shutdown of worker 'w0' timed out after 0.5s with its own work outstanding: "
            "1 call(s) still pending (test_rpc_faults.slow on 'w1')."
        )
        assert done is True  # the agent stopped; the call failed rather than hang
        workers.run(1, _shutdown_now)


def test_the_default_timeout_comes_from_the_options():
    with RpcWorkers(2, rpc_timeout=1) as workers:
        kind, message, _ = workers.run(0, call_and_report, "w1", slow, (2.5,))
        assert kind == "RpcTimeout"
        assert message == ("The sync call of test_rpc_faults.slow on worker 'w1' (id 1) timed "
                           "out after 1s.")
        # 0 lifts the limit for one call.
        assert workers.run(0, call_and_report, "w1", slow, (1.5, "slow but fine"), 0)[:2] == (
            "ok", "slow but fine")
        workers.shutdown()
