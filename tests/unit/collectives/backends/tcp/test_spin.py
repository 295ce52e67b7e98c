"""How a small receive waits (`spin.SpinPolicy`): a bounded poll of a real socket, then the
caller blocks; polling pauses after a run of late answers and comes back by itself; the
decision rests on the group and the receives, never on the machine's load average."""

from __future__ import annotations

import ast
import inspect
import socket
import time

import pytest

from shoal.collectives.backends.tcp import group as tcp_group
from shoal.collectives.backends.tcp import spin
from shoal.collectives.backends.tcp.spin import SpinPolicy


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_a_waiting_message_is_taken_by_the_poll(pair):
    a, b = pair
    a.sendall(b"x" * 100)
    view = memoryview(bytearray(100))
    assert SpinPolicy(50e-6).poll(b, view, 100) == 100
    assert bytes(view) == b"x" * 100


def test_an_empty_socket_is_polled_for_the_window_only(pair):
    _, b = pair
    policy = SpinPolicy(2e-3)
    t = time.perf_counter()
    assert policy.poll(b, memoryview(bytearray(8)), 8) == 0
    took = time.perf_counter() - t
    # At least the window (the poll ran it out); the upper bound allows a descheduled thread
    # on a loaded 2-core machine: the poll itself is bounded by its deadline check.
    assert 2e-3 <= took < 0.5


def test_a_closed_peer_reads_as_minus_one(pair):
    a, b = pair
    a.close()
    assert SpinPolicy(50e-6).poll(b, memoryview(bytearray(8)), 8) == -1


def test_no_window_never_touches_the_socket(pair):
    a, b = pair
    a.sendall(b"y")
    assert SpinPolicy(0.0).poll(b, memoryview(bytearray(1)), 1) == 0
    assert b.recv(1) == b"y"  # still there for the blocking receive


def test_late_answers_pause_polling_then_it_resumes(pair):
    a, b = pair
    policy = SpinPolicy(10e-6)
    view = memoryview(bytearray(1))
    for _ in range(spin.MISSES_TO_PAUSE):
        assert policy.poll(b, view, 1) == 0
    assert policy.pausing
    a.sendall(b"z")
    # While paused the byte is left for the blocking receive, for PAUSE_RECEIVES receives.
    for _ in range(spin.PAUSE_RECEIVES):
        assert policy.poll(b, view, 1) == 0
    assert not policy.pausing
    assert policy.poll(b, view, 1) == 1


def test_hits_keep_polling_on(pair):
    a, b = pair
    policy = SpinPolicy(10e-6)
    view = memoryview(bytearray(1))
    for i in range(200):
        if i % 4 == 0:  # one late answer in four: hits outnumber misses
            assert policy.poll(b, view, 1) == 0
        else:
            a.sendall(b"h")
            assert policy.poll(b, view, 1) == 1
        assert not policy.pausing


def test_the_window_follows_the_cores_and_the_setting(monkeypatch):
    monkeypatch.delenv("SHOAL_SPIN_US", raising=False)
    assert SpinPolicy.for_group(1, 50e-6).window_s == 50e-6
    # More ranks than this process has cores: the peer may need this core, so no poll.
    assert SpinPolicy.for_group(100_000, 50e-6).window_s == 0.0
    monkeypatch.setenv("SHOAL_SPIN_US", "120")
    assert SpinPolicy.for_group(100_000, 50e-6).window_s == pytest.approx(120e-6)
    child = SpinPolicy.for_group(1, 50e-6).child()
    assert child.window_s == pytest.approx(120e-6) and not child.pausing


def test_the_group_does_not_consult_the_load_average():
    # The spin decision once followed os.getloadavg(), so a 4 KiB all_reduce ran 4x slower
    # for a minute after any other work; no module on the decision's path may read it.
    for module in (tcp_group, spin):
        tree = ast.parse(inspect.getsource(module))
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert "getloadavg" not in names, module.__name__


def test_a_pause_ends_before_a_peer_could_pause_again():
    # A paused rank answers late, so its peers miss; were the pause as long as the run of
    # misses that starts one, two ranks could take turns pausing and never poll together.
    assert spin.PAUSE_RECEIVES < spin.MISSES_TO_PAUSE
