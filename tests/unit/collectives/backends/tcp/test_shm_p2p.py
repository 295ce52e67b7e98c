"""The point-to-point rings' bookkeeping (`shm_p2p.ShmMail`) on two ranks' views of the same
regions: placement, freeing in order when messages are taken out of order, the fallback when
a ring is full, and descriptors that name bytes they may not. The whole path between ranks is
in tests/multiproc/test_tcp_p2p_shm.py."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.collectives.backends.tcp import shm
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
