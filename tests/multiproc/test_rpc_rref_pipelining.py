"""remote() then to_here() in one message each way, on two spawned workers: the caller's two
frames leave together, the owner answers the fetch that came with its remote() from the thread
that computed the value, and a remote() that nothing follows still leaves on its own."""

from __future__ import annotations

import time

import pytest

from tests.support.rpc_workers import RpcWorkers

WORLD = 2


@pytest.fixture(scope="module")
def workers():
    with RpcWorkers(WORLD) as pool:
        yield pool
        pool.shutdown()


_ran_at: dict[str, float] = {}


def make_value(n):
    return b"v" * n


def slow_value(seconds, value):
    time.sleep(seconds)
    return value


def note_time(key):
    """Runs on the owner: when it ran (CLOCK_MONOTONIC, shared by the host's processes)."""
    _ran_at[key] = time.monotonic()
    return key


def ran_at(key):
    return _ran_at.get(key)


def stream_counts():
    """(frames, messages) this worker has sent on its stream to the other one."""
    from shoal.rpc_agent import _current

    agent = _current.get()
    stream = agent._streams[1 - agent.info.id]
    return stream.frames_sent, stream.messages_sent


def remote_then_to_here(n):
    """n remote() + to_here() pairs from w0 to w1; the values and w0's frame and message counts."""
    from shoal import rpc_agent

    frames0, messages0 = stream_counts()
    values = []
    for i in range(n):
        rref = rpc_agent.remote("w1", make_value, (i % 50,))
        values.append(rref.to_here(timeout=10))
        del rref
    frames, messages = stream_counts()
    return values, frames - frames0, messages - messages0


def test_remote_and_its_to_here_leave_together_and_are_answered_together(workers):
    n = 200
    before = workers.run(1, stream_counts)
    values, frames, messages = workers.run(0, remote_then_to_here, n)
    after = workers.run(1, stream_counts)
    assert values == [b"v" * (i % 50) for i in range(n)]
    # Each pair sends two frames (the deletes of dropped RRefs add a few, gathered per 2 ms).
    # One message per frame, as before, would make messages == frames; the pair leaves in one
    # message unless the OS stops the caller between remote() and to_here() for longer than
    # the GIL's 5 ms switch interval, so on any machine well under 0.8 of the frames do.
    assert frames >= 2 * n
    assert messages < frames * 0.8, (frames, messages)
    # The owner's two answers (the fetch's value, then the remote()'s confirmation) likewise.
    owner_frames, owner_messages = after[0] - before[0], after[1] - before[1]
    assert owner_frames >= 2 * n
    assert owner_messages < owner_frames * 0.8, (owner_frames, owner_messages)


def remote_then_busy(key, busy_s):
    """remote() and then Python work that never blocks (it holds the GIL), as a caller that
    computes before its to_here(); returns when the remote() began and the value."""
    from shoal import rpc_agent

    start = time.monotonic()
    rref = rpc_agent.remote("w1", note_time, (key,))
    end = start + busy_s
    while time.monotonic() < end:
        pass
    return start, rref.to_here(timeout=10)


def test_a_remote_that_nothing_follows_leaves_while_its_caller_computes(workers):
    start, value = workers.run(0, remote_then_busy, "busy", 0.5)
    assert value == "busy"
    ran = workers.run(1, ran_at, "busy")
    # The frame waits for the stream's writer thread, which gets the GIL from a caller that
    # never blocks after the 5 ms switch interval: the function runs within milliseconds, not
    # after the 0.5 s of work. 0.25 s leaves room for a loaded 2-core machine's scheduling.
    assert 0 <= ran - start < 0.25, ran - start


def to_here_of_slow_and_failing():
    """The fetch that comes with its remote() waits for a value still being computed, and
    carries the remote function's exception."""
    from shoal import rpc_agent

    slow = rpc_agent.remote("w1", slow_value, (0.3, "late"))
    value = slow.to_here(timeout=10)
    created = slow._get_future().wait(10)
    failing = rpc_agent.remote("w1", slow_value, ("not a number", None))
    try:
        failing.to_here(timeout=10)
        error = None
    except TypeError as exc:
        error = type(exc).__name__
    try:
        failing._get_future().wait(10)
        creation_error = None
    except TypeError as exc:
        creation_error = type(exc).__name__
    return value, created, error, creation_error, slow.confirmed_by_owner()


def test_to_here_sent_with_its_remote_waits_for_the_value_and_its_error(workers):
    assert workers.run(0, to_here_of_slow_and_failing) == (
        "late", None, "TypeError", "TypeError", True)
