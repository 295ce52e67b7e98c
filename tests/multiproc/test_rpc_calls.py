"""rpc_sync, rpc_async and Futures across three spawned workers: results, arrays and Tensors,
nested calls, async_execution chains, remote exceptions, timeouts, a dead stream, metrics."""

from __future__ import annotations

import operator
import threading
import time

import numpy as np
import pytest

from shoal.rpc_agent.functions import async_execution
from tests.support.rpc_workers import RpcWorkers, expect_error

WORLD = 3


@pytest.fixture(scope="module", params=["direct", "public"])
def workers(request):
    """Every test runs over both ways a dialed stream can drive gRPC
    (rpc_agent/transport/direct.py): grpcio's Cython layer, the default, and its public API,
    the fallback."""
    env = {"SHOAL_RPC_GRPC": request.param}
    with RpcWorkers(WORLD, num_worker_threads=4, env=env) as pool:
        yield pool
        pool.shutdown()


# ----------------------------------------------------------------------------- remote side

def echo(x):
    return x


def describe_array(a):
    return a.dtype.str, a.shape, bool(a.flags.writeable), float(a.sum())


def add_kw(a, b=0, *, scale=1):
    return (a + b) * scale


def whoami():
    from shoal import rpc_agent

    return rpc_agent.get_worker_info().name


def nested(path):
    """Call along `path` (worker names); each hop appends its own name."""
    from shoal import rpc_agent

    me = rpc_agent.get_worker_info().name
    if not path:
        return [me]
    return [me] + rpc_agent.rpc_sync(path[0], nested, (path[1:],))


class CustomError(Exception):
    """A user exception type the caller can rebuild."""


def raise_value_error(n):
    raise ValueError(f"bad input {n}")


def raise_custom():
    raise CustomError("custom failure on purpose")


class _Unpicklable(Exception):
    def __init__(self, message, handle):
        super().__init__(message)
        self.handle = handle


def raise_unpicklable():
    raise _Unpicklable("cannot travel", threading.Lock())


def slow(seconds, value=None):
    time.sleep(seconds)
    return value


_gate = threading.Event()


def open_gate():
    _gate.set()
    return True


def reset_gate():
    _gate.clear()


def wait_gate(timeout):
    return _gate.wait(timeout)


# async_execution: each call returns at once with a Future another worker completes.
@async_execution
def async_chain(hops, value):
    from shoal import rpc_agent

    if not hops:
        fut = rpc_agent.Future()
        fut.set_result(value + 1)
        return fut
    return rpc_agent.rpc_async(hops[0], async_chain, (hops[1:], value + 1)).then(
        lambda f: f.value() * 10
    )


@async_execution
def async_wait_gate(timeout):
    """Frees its thread at once; completes when the gate opens (polled by a timer thread)."""
    from shoal import rpc_agent

    fut = rpc_agent.Future()

    def waiter():
        fut.set_result(_gate.wait(timeout))

    threading.Thread(target=waiter, daemon=True).start()
    return fut


@async_execution
def async_returns_int():
    return 5


# ----------------------------------------------------------------------------- caller side

def call_sync(to, fn, args=(), kwargs=None, timeout=None):
    from shoal import rpc_agent

    return rpc_agent.rpc_sync(to, fn, args, kwargs, timeout=timeout)


def check_values():
    from shoal import rpc_agent
    from shoal.core.tensor import Tensor

    out = {}
    out["add"] = rpc_agent.rpc_sync("w1", operator.add, (2, 3))
    out["kwargs"] = rpc_agent.rpc_sync("w2", add_kw, (1,), {"b": 2, "scale": 3})
    out["by_rank"] = rpc_agent.rpc_sync(1, whoami)
    out["by_info"] = rpc_agent.rpc_sync(rpc_agent.get_worker_info("w2"), whoami)
    out["self"] = rpc_agent.rpc_sync("w0", whoami)
    small = np.arange(12, dtype=np.int16).reshape(3, 4)
    big = np.random.default_rng(0).standard_normal((600, 700)).astype(np.float32)  # 1.6 MiB
    strided = big[::2, ::3]
    for key, arr in (("small", small), ("big", big), ("strided", strided)):
        back = rpc_agent.rpc_sync("w1", echo, (arr,))
        assert back.dtype == arr.dtype and back.shape == arr.shape, key
        np.testing.assert_array_equal(back, arr)
        out[key] = rpc_agent.rpc_sync("w1", describe_array, (arr,))
        assert back.flags.writeable, key
    # A pickle larger than the threshold (no out-of-band buffer) also goes over the data channel.
    payload = list(range(40_000))
    out["big_pickle"] = rpc_agent.rpc_sync("w2", echo, (payload,)) == payload
    tensor = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3), requires_grad=True)
    back = rpc_agent.rpc_sync("w1", echo, (tensor,))
    out["tensor"] = (type(back).__name__, back.requires_grad, back.array.tolist())
    bulk = Tensor(np.ones((512, 512), dtype=np.float64))  # 2 MiB over the data channel
    out["tensor_big"] = float(rpc_agent.rpc_sync("w2", echo, (bulk,)).array.sum())
    return out


def test_results_arrays_and_tensors_round_trip(workers):
    out = workers.run(0, check_values)
    assert out["add"] == 5
    assert out["kwargs"] == 9
    assert out["by_rank"] == "w1" and out["by_info"] == "w2" and out["self"] == "w0"
    assert out["small"] == ("<i2", (3, 4), True, 66.0)
    assert out["big"][:3] == ("<f4", (600, 700), True)
    assert out["strided"][:2] == ("<f4", (300, 234))
    assert out["big_pickle"] is True
    assert out["tensor"] == ("Tensor", True, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
    assert out["tensor_big"] == 512 * 512


def test_nested_calls_go_through_every_hop_and_back(workers):
    assert workers.run(0, call_sync, "w1", nested, (["w2", "w0", "w1"],)) == [
        "w1", "w2", "w0", "w1"
    ]


def check_blocked_inline_call_keeps_stream_read():
    """w1's reader runs the first call (blocked on a plain Event, not a Future) itself; the
    call that opens the gate comes behind it on the same stream and must still be read."""
    from shoal import rpc_agent

    rpc_agent.rpc_sync("w1", reset_gate, timeout=30)
    start = time.monotonic()
    blocked = rpc_agent.rpc_async("w1", wait_gate, (20,), timeout=30)
    time.sleep(0.05)
    opened = rpc_agent.rpc_sync("w1", open_gate, timeout=30)
    result = blocked.wait(30)
    rpc_agent.rpc_sync("w1", reset_gate, timeout=30)
    return opened, result, time.monotonic() - start


def test_a_call_blocked_in_its_reader_does_not_stop_the_stream(workers):
    opened, result, elapsed = workers.run(0, check_blocked_inline_call_keeps_stream_read)
    assert opened is True and result is True
    assert elapsed < 10, f"the gate opened only after {elapsed:.1f}s"


def check_futures():
    from shoal import rpc_agent
    from shoal.rpc_agent import RpcError

    out = {}
    fut = rpc_agent.rpc_async("w1", slow, (0.3, "late"))
    try:
        fut.value()
        out["value_early"] = "no error"
    except RpcError as exc:
        out["value_early"] = str(exc)
    seen = []
    fut.add_done_callback(lambda f: seen.append(f.value()))
    chained = fut.then(lambda f: f.value().upper())
    out["wait"] = fut.wait(10)
    out["then"] = chained.wait(10)
    out["done"] = fut.done()
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    out["callback"] = seen
    many = [rpc_agent.rpc_async(f"w{i % 3}", operator.mul, (i, i)) for i in range(50)]
    out["wait_all"] = rpc_agent.wait_all(many, timeout=20)
    out["collect_all"] = [f.value() for f in rpc_agent.collect_all(many).wait(10)]
    failing = [rpc_agent.rpc_async("w1", operator.truediv, (1, 0)),
               rpc_agent.rpc_async("w2", echo, (1,))]
    try:
        rpc_agent.wait_all(failing, timeout=10)
        out["wait_all_error"] = None
    except ZeroDivisionError as exc:
        out["wait_all_error"] = str(exc)
    return out


def test_futures_wait_then_callbacks_and_collections(workers):
    out = workers.run(0, check_futures)
    assert "not done yet" in out["value_early"]
    assert out["wait"] == "late" and out["then"] == "LATE" and out["done"] is True
    assert out["callback"] == ["late"]
    assert out["wait_all"] == [i * i for i in range(50)]
    assert out["collect_all"] == out["wait_all"]
    assert out["wait_all_error"] == "division by zero"


def check_async_chain():
    from shoal import rpc_agent

    # w1 -> w2 -> w0: each hop adds one on the way out (5 -> 6 -> 7 -> 8 on w0) and each
    # forwarding hop multiplies by ten on the way back (w2: 80, w1: 800).
    return rpc_agent.rpc_sync("w1", async_chain, (["w2", "w0"], 5))


def check_async_frees_threads():
    """More async_execution calls than w1 has threads, all waiting on one gate: only works if
    none of them holds a thread while it waits."""
    from shoal import rpc_agent

    rpc_agent.rpc_sync("w1", reset_gate)
    futs = [rpc_agent.rpc_async("w1", async_wait_gate, (20,)) for _ in range(12)]
    time.sleep(0.2)
    assert not any(f.done() for f in futs)
    assert rpc_agent.rpc_sync("w1", open_gate, timeout=10) is True
    return [f.wait(20) for f in futs]


def test_async_execution_chains_and_frees_server_threads(workers):
    assert workers.run(0, check_async_chain) == 800
    assert workers.run(0, check_async_frees_threads) == [True] * 12
    type_name, message, _ = expect_error(workers, 0, call_sync, "w2", async_returns_int)
    assert type_name == "RpcError"
    assert "async_returns_int is marked @async_execution but returned int, not a Future" in message


def catch_remote(fn, args=()):
    from shoal import rpc_agent

    try:
        rpc_agent.rpc_sync("w1", fn, args)
    except BaseException as exc:  # noqa: BLE001
        return (type(exc).__name__, str(exc), getattr(exc, "remote_traceback", ""),
                getattr(exc, "__notes__", []), type(exc.__cause__).__name__,
                getattr(exc, "type_name", None))
    return None


def test_remote_exceptions_keep_type_message_and_traceback(workers):
    name, message, tb, notes, cause, _ = workers.run(0, catch_remote, raise_value_error, (7,))
    assert (name, message) == ("ValueError", "bad input 7")
    assert "in raise_value_error" in tb and 'raise ValueError(f"bad input {n}")' in tb
    assert notes == ["Raised on worker 'w1' while running test_rpc_calls.raise_value_error "
                     "(remote traceback above)."]
    assert cause == "RemoteTraceback"
    name, message, tb, *_ = workers.run(0, catch_remote, raise_custom)
    assert (name, message) == ("CustomError", "custom failure on purpose")
    # A type that cannot travel comes back as RemoteException with the type name and text.
    name, message, tb, _, _, type_name = workers.run(0, catch_remote, raise_unpicklable)
    assert name == "RemoteException"
    assert type_name == "test_rpc_calls._Unpicklable"
    assert message.startswith("test_rpc_calls._Unpicklable: cannot travel")
    assert "in raise_unpicklable" in tb


def timed_call(to, fn, args, timeout):
    from shoal import rpc_agent

    t = time.monotonic()
    try:
        value = rpc_agent.rpc_sync(to, fn, args, timeout=timeout)
        return "ok", value, time.monotonic() - t
    except rpc_agent.RpcError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t


def test_timeouts_fail_the_future_naming_callee_and_function(workers):
    kind, message, elapsed = workers.run(0, timed_call, "w2", slow, (5,), 0.5)
    assert kind == "RpcTimeout"
    assert message == ("The sync call of test_rpc_calls.slow on worker 'w2' (id 2) timed out "
                       "after 0.5s.")
    assert 0.4 < elapsed < 4
    # timeout=0 means no limit.
    assert workers.run(0, timed_call, "w2", slow, (0.3, "fine"), 0)[:2] == ("ok", "fine")


def check_bad_input():
    from shoal import rpc_agent

    out = {}
    try:
        rpc_agent.rpc_sync("w1", echo, (lambda: 1,))
    except rpc_agent.RpcError as exc:
        out["lambda"] = str(exc)
    try:
        rpc_agent.rpc_sync("nobody", echo, (1,))
    except rpc_agent.RpcError as exc:
        out["unknown"] = str(exc)
    try:
        rpc_agent.rpc_sync("w1", echo, (1,), timeout=-2.5)
    except ValueError as exc:
        out["negative"] = str(exc)
    # torch's UNSET_RPC_TIMEOUT (-1) means the agent's default, not an error.
    out["unset"] = rpc_agent.rpc_sync("w1", echo, (7,),
                                      timeout=rpc_agent.constants.UNSET_RPC_TIMEOUT)
    return out


def test_bad_calls_fail_clearly_before_sending(workers):
    out = workers.run(0, check_bad_input)
    assert out["lambda"].startswith(
        "The arguments of test_rpc_calls.echo for worker 'w1' cannot be pickled:")
    assert out["unknown"] == "Unknown worker 'nobody': this job has workers 'w0', 'w1', 'w2'."
    assert "timeout must be zero or more seconds, got -2.5" in out["negative"]
    assert out["unset"] == 7


def break_stream_mid_call(peer):
    """Kill this worker's live stream to `peer` with a call pending, then call again."""
    from shoal import rpc_agent
    from shoal.rpc_agent import _current

    agent = _current.get()
    fut = rpc_agent.rpc_async(peer, slow, (3, "never"))
    time.sleep(0.2)
    stream = agent._streams[rpc_agent.get_worker_info(peer).id]
    stream.fail("killed by the test")
    try:
        fut.wait(10)
        first = "no error"
    except rpc_agent.RpcPeerLost as exc:
        first = str(exc)
    return first, rpc_agent.rpc_sync(peer, whoami, timeout=10)


def test_a_dead_stream_fails_its_pending_calls_and_reconnects(workers):
    first, again = workers.run(0, break_stream_mid_call, "w1")
    assert first == ("The async call of test_rpc_calls.slow on worker 'w1' (id 1) failed: the "
                     "RPC stream to it died (killed by the test).")
    assert again == "w1"
    # The peer that accepted the stream gets a new one too, and calls both ways still work.
    assert workers.run(1, call_sync, "w0", whoami) == "w0"


def read_metrics():
    from prometheus_client import REGISTRY

    def value(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    return {
        "sync_ok": value("shoal_rpc_requests_total", kind="sync", status="ok"),
        "async_ok": value("shoal_rpc_requests_total", kind="async", status="ok"),
        "sync_timeout": value("shoal_rpc_requests_total", kind="sync", status="timeout"),
        "latency_count": value("shoal_rpc_latency_seconds_count", kind="sync"),
        "inflight": value("shoal_rpc_inflight"),
        "sent": value("shoal_rpc_bytes_total", direction="sent"),
        "received": value("shoal_rpc_bytes_total", direction="received"),
    }


def burst(n):
    from shoal import rpc_agent

    for i in range(n):
        rpc_agent.rpc_sync("w1", echo, (i,))
    rpc_agent.wait_all([rpc_agent.rpc_async("w2", echo, (i,)) for i in range(n)])


def test_metrics_count_requests_latency_inflight_and_bytes(workers):
    before = workers.run(0, read_metrics)
    workers.run(0, burst, 20)
    after = workers.run(0, read_metrics)
    assert after["sync_ok"] - before["sync_ok"] == 20
    assert after["async_ok"] - before["async_ok"] == 20
    assert after["latency_count"] - before["latency_count"] == 20
    assert after["inflight"] == 0
    assert after["sent"] > before["sent"] and after["received"] > before["received"]


def context_seen(hops):
    """The context id this call runs under, and those of the calls it makes in turn."""
    from shoal import rpc_agent

    here = rpc_agent.context.current_context_id()
    if not hops:
        return [here]
    return [here] + rpc_agent.rpc_sync(hops[0], context_seen, (hops[1:],))


def check_context_ids():
    from shoal import rpc_agent

    with rpc_agent.context.context_id(77):
        inside = rpc_agent.rpc_sync("w1", context_seen, (["w2"],))
    outside = rpc_agent.rpc_sync("w1", context_seen, ([],))
    return inside, outside


def test_the_autograd_context_id_travels_with_calls_and_nested_calls(workers):
    inside, outside = workers.run(0, check_context_ids)
    assert inside == [77, 77]
    assert outside == [None]


def dialed_stream_client():
    import os

    from shoal.rpc_agent import _current

    stream = _current.get()._streams[1]
    assert stream.outgoing
    return os.environ["SHOAL_RPC_GRPC"], type(stream.pump).__name__


def test_dialed_streams_use_the_grpc_client_the_environment_names(workers):
    choice, direct = workers.run(0, dialed_stream_client)
    assert direct == {"direct": "DirectCall", "public": "NoneType"}[choice]


def check_coalescing_and_channels(n):
    """Frames queued together leave as one gRPC message; big buffers take the data channel."""
    from shoal import rpc_agent
    from shoal.rpc_agent import _current

    agent = _current.get()
    stream = agent._streams[1]
    frames0, messages0 = stream.frames_sent, stream.messages_sent
    rpc_agent.wait_all([rpc_agent.rpc_async("w1", echo, (i,)) for i in range(n)], timeout=30)
    frames, messages = stream.frames_sent - frames0, stream.messages_sent - messages0
    transfers0 = agent._data._next_id
    rpc_agent.rpc_sync("w1", echo, (np.zeros(16 * 1024, np.float32),))  # 64 KiB: the threshold
    rpc_agent.rpc_sync("w1", echo, (np.zeros(1000, np.float32),))  # 4 KB: inline
    return frames, messages, agent._data._next_id - transfers0


def test_queued_frames_are_coalesced_and_big_buffers_use_the_data_channel(workers):
    frames, messages, transfers = workers.run(0, check_coalescing_and_channels, 400)
    assert frames == 400
    assert messages < frames * 0.8, (frames, messages)
    assert transfers == 1


def check_coalescing_on_an_accepted_stream(n):
    """Worker 1 accepted the stream from worker 0: its frames leave through gRPC's server
    callback, written directly when the stream is idle, coalesced when they come in a burst."""
    from shoal import rpc_agent
    from shoal.rpc_agent import _current

    stream = _current.get()._streams[0]
    assert not stream.outgoing
    frames0, messages0 = stream.frames_sent, stream.messages_sent
    values = rpc_agent.wait_all([rpc_agent.rpc_async("w0", echo, (i,)) for i in range(n)],
                                timeout=30)
    frames, messages = stream.frames_sent - frames0, stream.messages_sent - messages0
    one_frame, one_message = stream.frames_sent, stream.messages_sent
    single = rpc_agent.rpc_sync("w0", echo, ("alone",), timeout=30)
    one_frame, one_message = stream.frames_sent - one_frame, stream.messages_sent - one_message
    return values == list(range(n)), frames, messages, single, one_frame, one_message


def test_an_accepted_stream_coalesces_bursts_and_sends_a_lone_call(workers):
    ok, frames, messages, single, one_frame, one_message = workers.run(
        1, check_coalescing_on_an_accepted_stream, 400
    )
    assert ok
    assert frames == 400
    assert messages < frames * 0.8, (frames, messages)
    assert single == "alone" and (one_frame, one_message) == (1, 1)


def many_small_arrays(n, size):
    from shoal import rpc_agent

    arrays = [np.full(size, i % 256, dtype=np.uint8) for i in range(n)]
    back = rpc_agent.rpc_sync("w1", echo, (arrays,))
    return all(int(b[0]) == i % 256 and b.size == size for i, b in enumerate(back))


def test_many_small_buffers_do_not_overflow_one_grpc_message(workers):
    # 1200 buffers of 60 KB (each under the threshold) add up to 72 MB, above gRPC's bound.
    assert workers.run(0, many_small_arrays, 1200, 60_000) is True


def filled(value, n):
    return np.full(n, value, dtype=np.float32)


def check_received_memory_reuse(n):
    """Results the caller keeps stay intact while later transfers arrive; once dropped, their
    memory serves later transfers instead of fresh pages."""
    from shoal import rpc_agent
    from shoal.rpc_agent import _current

    from shoal.rpc_agent.transport.receive_buffers import ReceiveBuffers

    # A cache of its own, so that blocks earlier tests left do not enter the counts below.
    data = _current.get()._data
    data._receive.clear()
    cache = data._receive = ReceiveBuffers(256 << 20)
    kept = [rpc_agent.rpc_sync("w1", filled, (float(i), n)) for i in range(6)]
    views = [k[: n // 2].reshape(2, -1) for k in kept]  # views keep their block alive too
    held_while_kept = cache.held_bytes
    intact = all(float(v.min()) == float(v.max()) == float(i) for i, v in enumerate(views))
    addresses = {k.__array_interface__["data"][0] for k in kept}
    del kept, views
    again = [rpc_agent.rpc_sync("w1", filled, (9.0, n)) for _ in range(6)]
    reused = {a.__array_interface__["data"][0] for a in again} <= addresses
    return intact, len(addresses), held_while_kept, cache.held_bytes, reused, float(again[0][0])


def test_received_buffers_are_reused_only_after_the_caller_drops_them(workers):
    n = (2 << 20) // 4  # 2 MiB results, over the data channel and above the cache's minimum
    intact, distinct, held_kept, held_after, reused, value = workers.run(
        0, check_received_memory_reuse, n)
    assert intact and distinct == 6
    assert held_kept == 6 * (2 << 20)
    assert held_after == held_kept and reused and value == 9.0


def slow_filled(seconds, n):
    time.sleep(seconds)
    return np.full(n, 1.0, dtype=np.float32)


def check_late_bulk_reply_is_dropped(n):
    from shoal import rpc_agent
    from shoal.rpc_agent import _current
    from shoal.rpc_agent.types import RpcTimeout

    assembler = _current.get()._assembler
    try:
        rpc_agent.rpc_sync("w1", slow_filled, (0.5, n), timeout=0.1)
        timed_out = False
    except RpcTimeout:
        timed_out = True
    # The late reply's frame and buffer come in within about 0.5 s; afterwards nothing may be
    # left holding them.
    time.sleep(2.0)
    deadline = time.monotonic() + 8
    while (assembler._arrived or assembler._unwanted) and time.monotonic() < deadline:
        time.sleep(0.2)
    return timed_out, len(assembler._arrived), len(assembler._unwanted)


def test_a_late_bulk_reply_is_not_kept(workers):
    timed_out, arrived, unwanted = workers.run(0, check_late_bulk_reply_is_dropped, (2 << 20) // 4)
    assert timed_out and arrived == 0 and unwanted == 0
