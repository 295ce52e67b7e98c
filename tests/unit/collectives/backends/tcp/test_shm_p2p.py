"""The point-to-point rings' bookkeeping (`shm_p2p.ShmMail`) on two ranks' views of the same
regions: placement, freeing in order when messages are taken out of order, the fallback when
a ring is full, and descriptors that name bytes they may not. The whole path between ranks is
in tests/multiproc/test_tcp_p2p_shm.py."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.collectives.backends.tcp import shm, shm_p2p
from shoal.collectives.backends.tcp.shm_p2p import BadDescriptor, ShmMail

RING = 8192  # a small ring, so that filling it is cheap


def _pair():
    """(sender's mail, receiver's mail): ranks 0 and 1 over the same two regions."""
    size, slot = 2, 4096
    nbytes = shm.BUFFERS * slot + 4096 + size * RING
    regions = [np.zeros(nbytes, np.uint8) for _ in range(size)]
    views = []
    for rank in range(size):
        slots = shm.SharedSlots(rank, regions, [], slot)
        slots.p2p_ring = RING  # the layout follows it: counters first, then the rings
        views.append(ShmMail(slots))
    return views


def _msg(n: int, value: int) -> np.ndarray:
    return np.full(n, value, np.uint8)


def test_a_message_arrives_and_frees_its_bytes():
    sender, receiver = _pair()
    desc = sender.post(1, _msg(1000, 7))
    assert receiver.length(desc) == 1000
    out = np.zeros(1000, np.uint8)
    receiver.take(0, desc, out)
    assert (out == 7).all()
    assert int(receiver.slots.counters(1)[0]) == 1000


def test_an_empty_ring_starts_over_at_its_start():
    sender, receiver = _pair()
    for value in range(5):  # 5 x 3000 bytes would run past a ring of 8192 without the restart
        desc = sender.post(1, _msg(3000, value))
        assert desc is not None
        out = np.zeros(3000, np.uint8)
        receiver.take(0, desc, out)
        assert (out == value).all()
    assert (receiver.slots.ring(0, 1)[:3000] == 4).all()


def test_messages_taken_out_of_order_free_the_ring_in_order():
    sender, receiver = _pair()
    first = sender.post(1, _msg(3000, 1))
    second = sender.post(1, _msg(3000, 2))
    assert sender.post(1, _msg(3000, 3)) is None  # 9000 > 8192: over the sockets instead
    out = np.zeros(3000, np.uint8)
    receiver.take(0, second, out)
    assert (out == 2).all()
    assert int(receiver.slots.counters(1)[0]) == 0  # the first still holds its bytes
    assert sender.post(1, _msg(3000, 3)) is None
    receiver.take(0, first, None)  # dropped (a mismatch): its bytes are freed all the same
    assert int(receiver.slots.counters(1)[0]) == 6000
    assert sender.post(1, _msg(3000, 3)) is not None


def test_a_message_wraps_to_the_start_when_the_end_is_too_short():
    sender, receiver = _pair()
    a = sender.post(1, _msg(5000, 1))
    b = sender.post(1, _msg(1000, 2))  # 5000..6000
    receiver.take(0, a, np.zeros(5000, np.uint8))
    c = sender.post(1, _msg(4000, 3))  # 6000 + 4000 > 8192: starts at 0, after the freed a
    assert c is not None
    out = np.zeros(4000, np.uint8)
    receiver.take(0, b, np.zeros(1000, np.uint8))
    receiver.take(0, c, out)
    assert (out == 3).all()


def test_after_the_ring_drained_a_second_message_fits_beside_the_first():
    # A receiver one message behind, after a moment with nothing pending: the ring's restart
    # at its start once counted the whole rest of the ring as taken, so the next message
    # (and, in a stream, about a third of them) went over the sockets.
    sender, receiver = _pair()
    receiver.take(0, sender.post(1, _msg(3000, 1)), np.zeros(3000, np.uint8))
    first = sender.post(1, _msg(3000, 2))  # nothing pending: at the start
    second = sender.post(1, _msg(3000, 3))
    assert second is not None
    for desc, value in ((first, 2), (second, 3)):
        out = np.zeros(3000, np.uint8)
        receiver.take(0, desc, out)
        assert (out == value).all()


def test_a_stream_one_message_behind_reuses_the_first_pages():
    sender, receiver = _pair()
    starts, behind = [], None
    for value in range(8):
        desc = sender.post(1, _msg(2000, value))
        starts.append(int.from_bytes(desc[8:16], "little"))
        if behind is not None:
            receiver.take(0, behind, np.zeros(2000, np.uint8))
        behind = desc
    assert starts == [0, 2000] * 4  # two slots in turn, not a walk through the whole ring


def test_a_message_takes_the_gap_a_freed_one_left_between_two_that_wait():
    sender, receiver = _pair()
    a = sender.post(1, _msg(3000, 1))  # 0..3000
    b = sender.post(1, _msg(3000, 2))  # 3000..6000
    receiver.take(0, a, np.zeros(3000, np.uint8))
    c = sender.post(1, _msg(2000, 3))  # the lowest free bytes: 0..2000
    receiver.take(0, b, np.zeros(3000, np.uint8))
    d = sender.post(1, _msg(1000, 4))  # 2000..3000, below nothing that waits
    e = sender.post(1, _msg(5000, 5))  # 3000..8000, between d and the ring's end
    assert [int.from_bytes(x[8:16], "little") for x in (c, d, e)] == [0, 2000, 3000]
    assert sender.post(1, _msg(200, 6)) is None  # 192 bytes are left
    for desc, n, value in ((c, 2000, 3), (d, 1000, 4), (e, 5000, 5)):
        out = np.zeros(n, np.uint8)
        receiver.take(0, desc, out)
        assert (out == value).all()


def test_a_sender_far_ahead_of_its_receiver_sends_the_rest_by_the_sockets():
    sender, receiver = _pair()
    descs = [sender.post(1, _msg(64, i)) for i in range(shm_p2p.MAX_PENDING)]
    assert all(d is not None for d in descs)
    assert sender.post(1, _msg(64, 0)) is None  # space is left, but too many wait
    receiver.take(0, descs[0], np.zeros(64, np.uint8))
    assert sender.post(1, _msg(64, 0)) is not None


def test_a_message_larger_than_the_ring_is_refused():
    sender, _ = _pair()
    assert sender.post(1, _msg(RING + 1, 0)) is None


def test_descriptors_naming_other_bytes_are_refused():
    sender, receiver = _pair()
    desc = sender.post(1, _msg(100, 1))
    receiver.take(0, desc, np.zeros(100, np.uint8))
    with pytest.raises(BadDescriptor, match="message 0"):
        receiver.take(0, desc, None)  # taken already
    forged = bytearray(desc)
    forged[8:16] = (RING - 10).to_bytes(8, "little")  # start near the end: runs past the ring
    forged[0:8] = (5).to_bytes(8, "little")
    with pytest.raises(BadDescriptor, match="of a ring of 8192"):
        receiver.take(0, bytes(forged), None)
    with pytest.raises(BadDescriptor, match="descriptor of 3 bytes"):
        receiver.take(0, b"abc", None)
