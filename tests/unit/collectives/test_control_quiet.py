"""A control connection after a reading receive (`ControlChannel.take_p2p_reading`) is quiet:
the service thread watches it only for its end, so a message for that receiver wakes nobody
else. These check what must still hold meanwhile: a message nobody asks for leaves the
kernel's buffer within the grace period (two ranks sending more than a socket holds to each
other do not deadlock), a waiter served by the service thread is served at once, and a peer's
death or abort is noticed as promptly as before.

Two real control channels over a Unix socket pair, as in test_control_reading_receiver."""

from __future__ import annotations

import threading
import time

from shoal.collectives.backends.tcp import wire
from shoal.collectives.backends.tcp.control import QUIET_GRACE_S
from shoal.collectives.backends.tcp.reasons import FailureReason
from tests.unit.collectives.test_control_reading_receiver import ARRIVAL_S, _close, _never, _open


def _quiet_pair():
    """(sender, receiver, failures): one message taken by a reading receive on each side, so
    both connections are quiet."""
    sender, receiver, failures, spin = _open(0.0)
    for a, b in ((sender, receiver), (receiver, sender)):
        a.send_p2p(b.rank, 0, b"fp", memoryview(b"first"))
        got = b.take_p2p_reading(a.rank, 0, _never, time.monotonic() + ARRIVAL_S, spin)
        assert got is not None and bytes(got[2]) == b"first"
    return sender, receiver, failures


def test_a_message_nobody_asks_for_is_read_within_the_grace_period():
    sender, receiver, _failures = _quiet_pair()
    try:
        sent = time.monotonic()
        sender.send_p2p(1, 9, b"fp", memoryview(b"unasked"))
        # No receive is posted: the service thread itself takes it into the mailbox once the
        # grace period is over (ARRIVAL_S covers a loaded machine; the grace is milliseconds).
        while not receiver._mail.get((0, 9)) and time.monotonic() < sent + ARRIVAL_S:
            time.sleep(QUIET_GRACE_S)
        assert receiver._mail.get((0, 9)), "the message stayed in the kernel's buffer"
        # The service thread's idle wait is 1 s; a connection going quiet must shorten it to
        # the grace period, so half a second is already a missed deadline, not a slow machine.
        assert time.monotonic() - sent < 0.5
    finally:
        _close(sender, receiver)


def test_ranks_sending_more_than_a_socket_holds_to_each_other_do_not_deadlock():
    sender, receiver, failures = _quiet_pair()
    # 64 messages of 64 KiB each way: megabytes, far beyond a Unix socket's buffer, so each
    # side's sends block until the other side's service thread drains its connection.
    block = memoryview(bytes(64 * 1024))
    done = []

    def flood(ch, peer):
        for i in range(64):
            ch.send_p2p(peer, 100 + i, b"fp", block)
        done.append(ch.rank)

    threads = [threading.Thread(target=flood, args=(ch, 1 - ch.rank), daemon=True)
               for ch in (sender, receiver)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(ARRIVAL_S)
        assert sorted(done) == [0, 1], "the two senders blocked each other"
        for ch in (sender, receiver):
            for i in range(64):
                got = ch.take_p2p(1 - ch.rank, 100 + i, _never, 0.05)
                assert got is not None and len(got[2]) == len(block)
        assert failures[0] == []
    finally:
        _close(sender, receiver)


def test_a_waiter_served_by_the_service_thread_does_not_wait_out_the_grace():
    sender, receiver, _failures = _quiet_pair()
    try:
        arrived = []

        def wait():
            got = receiver.take_p2p(0, 7, lambda: time.monotonic() > start + ARRIVAL_S, 0.05)
            arrived.append((got, time.monotonic()))

        start = time.monotonic()
        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        time.sleep(0.05)  # the waiter is in its wait (it arms the connection on entry)
        sent = time.monotonic()
        sender.send_p2p(1, 7, b"fp", memoryview(b"served"))
        waiter.join(ARRIVAL_S)
        assert arrived and arrived[0][0] is not None and bytes(arrived[0][0][2]) == b"served"
    finally:
        _close(sender, receiver)
    # Delivered by the service thread as soon as it arrived: a wake-up, well under the 50 ms
    # poll step of the waiter, let alone ARRIVAL_S; a machine that stalls a thread longer than
    # a second is broken, not slow.
    assert arrived[0][1] - sent < 1.0


def test_a_peer_that_dies_while_quiet_is_named():
    sender, receiver, (failures, got_failure) = _quiet_pair()
    try:
        sender.socks[1].close()  # no goodbye: the process died
        assert got_failure.wait(ARRIVAL_S)
        assert failures[0].kind == "peer_lost" and failures[0].culprits == (0,)
    finally:
        receiver.say_goodbye()
        receiver.close()
        sender.close()


def test_an_abort_while_quiet_reaches_the_peer_with_its_reason():
    sender, receiver, (failures, got_failure) = _quiet_pair()
    try:
        reason = FailureReason("error", "rank 0 hit a bad batch", origin=0, culprits=(0,))
        sender.send_last_message(wire.KIND_ABORT, reason.to_bytes())
        assert got_failure.wait(ARRIVAL_S)
        assert failures[0].cause == "rank 0 hit a bad batch" and failures[0].culprits == (0,)
    finally:
        _close(sender, receiver)
