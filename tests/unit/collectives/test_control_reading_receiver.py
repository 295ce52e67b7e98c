"""A point-to-point receiver that reads its source's control connection itself while it waits
(`ControlChannel.take_p2p_reading`): it must handle every frame as the service thread does and
hand the connection back to the service thread when it stops waiting.

Two real control channels over a Unix socket pair, keyed as the mesh keys them."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from shoal.collectives.backends.tcp.control import JOIN_MAX_BYTES, ControlChannel
from shoal.collectives.backends.tcp.spin import SpinPolicy
from shoal.core.channel import pair

# Generous for a loaded 2-core machine: a message between two threads of one process arrives
# in microseconds; only a receive that never gets it runs into these.
ARRIVAL_S = 5.0


def _never() -> bool:
    return False


def _open(spin_s: float, encrypt: bool = False):
    """(sender, receiver, receiver's failures, the receiver's poll policy), rank 0 -> rank 1."""
    failures: list = []
    got_failure = threading.Event()

    def on_failure(reason):
        failures.append(reason)
        got_failure.set()

    secret, n0, n1 = os.urandom(32), os.urandom(16), os.urandom(16)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender = ControlChannel(0, 2, "t", lambda reason: None)
    receiver = ControlChannel(1, 2, "t", on_failure)
    sender.socks[1], receiver.socks[0] = a, b
    sender.links[1] = pair(secret, "control", n0, n1, server=True, encrypt=encrypt)
    receiver.links[0] = pair(secret, "control", n0, n1, server=False, encrypt=encrypt)
    for ch, peer in ((sender, 1), (receiver, 0)):
        ch.start()
        ch.watch(peer)
    return sender, receiver, (failures, got_failure), SpinPolicy(spin_s)


def _close(sender, receiver) -> None:
    for ch in (sender, receiver):
        ch.say_goodbye()
    for ch in (sender, receiver):
        ch.close()


@pytest.fixture(params=[0.0, 200e-6], ids=["blocking", "polling"])
def channels(request):
    opened = _open(request.param)
    yield opened
    _close(opened[0], opened[1])


@pytest.mark.parametrize("encrypt", [False, True], ids=["tagged", "encrypted"])
def test_every_body_size_arrives_whole_by_either_reader(encrypt):
    # Bodies up to JOIN_MAX_BYTES are tagged (or sealed) with the fingerprint joined to the
    # payload, longer ones as two parts: both sides must split alike at the boundary.
    sender, receiver, (failures, _event), spin = _open(200e-6, encrypt)
    try:
        sizes = (0, 1, 4096, JOIN_MAX_BYTES, JOIN_MAX_BYTES + 1, 3 * JOIN_MAX_BYTES + 5)
        for i, n in enumerate(sizes):
            payload = os.urandom(n)
            fp = f"p2p(uint8[{n}])".encode()
            sender.send_p2p(1, 2 * i, fp, memoryview(payload))
            sender.send_p2p(1, 2 * i + 1, fp, memoryview(payload))
            by_reader = receiver.take_p2p_reading(0, 2 * i, _never,
                                                  time.monotonic() + ARRIVAL_S, spin)
            deadline = time.monotonic() + ARRIVAL_S
            by_service = receiver.take_p2p(0, 2 * i + 1, lambda: time.monotonic() > deadline,
                                           0.05)
            for got in (by_reader, by_service):
                assert got is not None, n
                assert (got[0], got[1], bytes(got[2])) == (0, fp, payload), n
        assert failures == []
    finally:
        _close(sender, receiver)


def test_the_wanted_tag_is_taken_and_an_earlier_one_is_kept_for_its_receive(channels):
    sender, receiver, _failures, spin = channels
    sender.send_p2p(1, 1, b"fp", memoryview(b"first"))
    sender.send_p2p(1, 2, b"fp", memoryview(b"second"))
    got = receiver.take_p2p_reading(0, 2, _never, time.monotonic() + ARRIVAL_S, spin)
    assert got is not None and (got[0], bytes(got[2])) == (0, b"second")
    # The tag-1 message the receiver read on the way is in the mailbox for its own receive.
    got = receiver.take_p2p(0, 1, _never, 0.05)
    assert got is not None and bytes(got[2]) == b"first"


def test_a_receive_that_runs_out_of_time_hands_the_connection_back(channels):
    sender, receiver, _failures, spin = channels
    start = time.monotonic()
    assert receiver.take_p2p_reading(0, 3, _never, start + 0.05, spin) is None
    # It waited for its deadline (not returning at once) and no longer than a scheduler slip.
    assert 0.05 <= time.monotonic() - start < ARRIVAL_S
    # Only the service thread reads the connection now: a plain wait must still be served.
    sender.send_p2p(1, 4, b"fp", memoryview(b"later"))
    deadline = time.monotonic() + ARRIVAL_S
    got = receiver.take_p2p(0, 4, lambda: time.monotonic() > deadline, 0.05)
    assert got is not None and bytes(got[2]) == b"later"


def test_a_message_sent_while_the_receiver_waits_wakes_it(channels):
    sender, receiver, _failures, spin = channels
    timer = threading.Timer(0.02, sender.send_p2p, (1, 5, b"fp", memoryview(b"x" * 4096)))
    timer.start()
    try:
        got = receiver.take_p2p_reading(0, 5, _never, time.monotonic() + ARRIVAL_S, spin)
    finally:
        timer.join()
    assert got is not None and bytes(got[2]) == b"x" * 4096


def test_a_peer_that_dies_during_the_wait_is_named(channels):
    sender, receiver, (failures, got_failure), spin = channels
    threading.Timer(0.02, lambda: sender.socks[1].shutdown(socket.SHUT_RDWR)).start()
    start = time.monotonic()
    assert receiver.take_p2p_reading(0, 6, _never, start + ARRIVAL_S, spin) is None
    assert time.monotonic() - start < ARRIVAL_S  # noticed, not waited out
    assert got_failure.wait(ARRIVAL_S)
    assert failures[0].kind == "peer_lost" and failures[0].culprits == (0,)


def test_an_altered_frame_during_the_wait_fails_the_group_naming_the_peer(channels):
    sender, receiver, (failures, got_failure), spin = channels
    # Bytes that are no tagged frame of this connection's keys, straight onto the socket.
    threading.Timer(0.02, lambda: sender.socks[1].sendall(os.urandom(64))).start()
    assert receiver.take_p2p_reading(0, 7, _never, time.monotonic() + ARRIVAL_S, spin) is None
    assert got_failure.wait(ARRIVAL_S)
    assert failures[0].kind == "error" and "integrity" in failures[0].cause
    assert failures[0].culprits == (0,)
