"""vm_p2p's parts alone: the offers a rank keeps for its peers (stale ones dropped, bounded)
and the writer's refusals (an offer that does not fit, another process's canary, a process
that is gone), each against real process_vm_readv/writev calls into this process or a child.
Whole exchanges between processes are in tests/multiproc/test_tcp_p2p_direct.py."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from shoal.collectives.backends.tcp import vm_p2p

pytestmark = pytest.mark.skipif(not vm_p2p.here().usable,
                                reason="process_vm_writev or /proc/self/ns/pid is unavailable")

FP = b"p2p(float32[4194304])"


def _offer_for(arr, number=0):
    return vm_p2p.offer(number, arr)


def test_an_offer_is_taken_once_and_passing_a_number_drops_the_stale_ones():
    box = vm_p2p.Readies(2)
    out = np.zeros(8, np.uint8)
    for number in (3, 4, 5):
        box.file(1, 7, FP, _offer_for(out, number))
    box.file(1, 8, FP, _offer_for(out, 0))  # another tag's offer is not this one's to drop
    assert box.pop(1, 7, 2) is None
    assert box.pop(1, 7, 4) == (FP, _offer_for(out, 4))
    assert box.pop(1, 7, 3) is None  # behind 4: dropped as stale when 4 was asked for
    assert box.pop(1, 7, 4) is None  # taken once
    assert box.pop(1, 7, 5) is not None
    assert box.pop(1, 8, 0) is not None
    assert box.pop(0, 7, 5) is None  # offers are per peer


def test_a_malformed_offer_is_ignored_and_a_peer_holds_a_bounded_number():
    box = vm_p2p.Readies(2)
    box.file(1, 0, FP, b"short")
    assert box.pop(1, 0, 0) is None
    out = np.zeros(8, np.uint8)
    for number in range(1000):
        box.file(1, 0, FP, _offer_for(out, number))
    assert len(box._box[1]) == vm_p2p._KEPT  # the oldest went first
    assert box.pop(1, 0, 1000 - vm_p2p._KEPT - 1) is None
    assert box.pop(1, 0, 999) is not None


def test_the_writer_copies_into_an_offered_array_of_this_process():
    dst = np.zeros(1 << 20, np.float32)
    src = np.arange(1 << 20, dtype=np.float32)
    writer = vm_p2p.Writer()
    assert writer.write(1, FP, memoryview(src).cast("B"), FP, _offer_for(dst))
    np.testing.assert_array_equal(dst, src)
    assert writer.written == 1


@pytest.mark.parametrize("why", ["fingerprint", "length", "canary", "pid namespace"])
def test_an_offer_that_does_not_fit_is_not_written(why):
    dst = np.zeros(1024, np.float32)
    src = np.ones(1024, np.float32)
    offer = bytearray(_offer_for(dst))
    fields = list(vm_p2p.READY.unpack(bytes(offer)))
    fp = FP
    if why == "fingerprint":
        fp = b"p2p(float64[512])"
    elif why == "length":
        fields[2] += 4
    elif why == "canary":
        fields[6] = bytes(16)
    else:
        fields[4] += 1
    writer = vm_p2p.Writer()
    assert not writer.write(1, FP, memoryview(src).cast("B"), fp, vm_p2p.READY.pack(*fields))
    assert not dst.any() and writer.written == 0


def test_a_process_that_is_gone_or_another_process_is_not_written():
    dst = np.zeros(1024, np.float32)
    src = np.ones(1024, np.float32)
    fields = list(vm_p2p.READY.unpack(_offer_for(dst)))
    # Another live process of this user at the same address: its canary differs (a pid reused
    # by a stranger reads back wrong before anything is written).
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        fields[3] = child.pid
        assert not vm_p2p.Writer().write(1, FP, memoryview(src).cast("B"), FP,
                                         vm_p2p.READY.pack(*fields))
    finally:
        child.kill()
        child.wait(10)
    fields[3] = child.pid  # reaped: no such process now
    writer = vm_p2p.Writer()
    assert not writer.write(1, FP, memoryview(src).cast("B"), FP, vm_p2p.READY.pack(*fields))
    assert writer.enabled(1)  # a vanished process is no refusal: the peer keeps its fast path
    assert not dst.any()
    assert os.getpid() != child.pid


def test_a_sender_waits_for_an_offer_no_longer_than_the_ring_copies_would_take():
    assert vm_p2p.wait_for(vm_p2p.MIN_BYTES) <= vm_p2p.MIN_BYTES / vm_p2p._COPY_BYTES_PER_S
    assert vm_p2p.wait_for(1 << 40) == vm_p2p._WAIT_MAX_S
