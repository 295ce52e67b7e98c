"""Large point-to-point messages written straight into the receiving array (`vm_p2p`), between
real processes of one host: batch_isend_irecv ring shifts arrive intact and use the direct
write, ordering under one tag holds across direct, ring and socket messages, a receive that
does not fit is refused without a byte written into it, and a receiver that comes late gets
its message the usual way. Each check compares with the
array the sender sent."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from shoal.collectives.backends.tcp import vm_p2p
from shoal.collectives.types import CollectiveMismatch
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.skipif(not vm_p2p.here().usable,
                                reason="process_vm_writev or /proc/self/ns/pid is unavailable")

N = vm_p2p.MIN_BYTES // 4 + 4096  # float32 elements: just above the direct path's size


def _data(rank: int, salt: int, n: int = N) -> np.ndarray:
    return np.random.default_rng(7919 * rank + salt).standard_normal(n).astype(np.float32)


def _group(rank, world, port):
    from shoal.collectives.backends.tcp.group import ProcessGroupTCP
    from shoal.collectives.store.tcp import TCPStore

    return ProcessGroupTCP(TCPStore("127.0.0.1", port, timeout=30), rank, world, timeout=30)


def _run(target, world, *args):
    from shoal.collectives.store.tcp import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size=world, is_master=True, timeout=30,
                     wait_for_workers=False)
    try:
        return run_ranks(target, world, args=(store.port, *args), timeout=120)
    finally:
        store.close()


def _p2p(is_send, arr, peer, tag=0):
    return (is_send, arr, peer, tag)  # one operation of ProcessGroupTCP.batch_p2p


def _shift(rank, world, port, rounds, direct_off=()):
    if rank in direct_off:
        os.environ["SHOAL_P2P_DIRECT"] = "0"
    group = _group(rank, world, port)
    try:
        got = []
        for i in range(rounds):
            out = np.zeros(N, np.float32)
            group.barrier()
            if i % world == rank:
                # This rank comes late: the offer it sends for is there when it sends (its
                # receiver waited for this rank's offer in vain and sent by the ring).
                time.sleep(0.2)
            works = group.batch_p2p([_p2p(True, _data(rank, i), (rank + 1) % world),
                                       _p2p(False, out, (rank - 1) % world)])
            for work in works:
                work.wait()
            got.append(out)
        group.barrier()
        if group._writer is None:
            return got, None, None
        return got, group._writer.written, len(group._offers._kept)
    finally:
        group.shutdown()


@pytest.mark.parametrize("world", [2, 3])
def test_a_ring_shift_of_large_arrays_is_written_straight_into_the_receivers(world):
    rounds = 4
    results = _run(_shift, world, rounds)
    for rank, (got, written, kept) in enumerate(results):
        for i, out in enumerate(got):
            np.testing.assert_array_equal(out, _data((rank - 1) % world, i))
        late = len(range(rank, rounds, world))
        assert written >= late, f"rank {rank} wrote {written} of its {rounds} messages directly"
        assert kept == 0  # every offered array was handed back once its message was taken


@pytest.mark.parametrize("off", [(0, 1), (1,)], ids=["both-off", "one-off"])
def test_shoal_p2p_direct_0_keeps_messages_in_the_rings_and_a_mixed_pair_agrees(off):
    rounds = 2
    results = _run(_shift, 2, rounds, off)
    for rank, (got, written, kept) in enumerate(results):
        for i, out in enumerate(got):
            np.testing.assert_array_equal(out, _data(1 - rank, i))
        if rank in off:
            assert written is None  # no writer, no offers
        else:
            # Its peer offers nothing, so it writes nothing (and its own offers go unused).
            assert written == 0 and kept == 0


def _ordered(rank, world, port):
    group = _group(rank, world, port)
    sizes = [N, 1000, N, 300000, N]  # direct, small (sockets), direct, ring, direct
    try:
        if rank == 0:
            group.barrier()
            time.sleep(0.2)  # the receiver's offers are in when this rank sends
            ops = [_p2p(True, _data(0, i, n), 1, tag=5) for i, n in enumerate(sizes)]
            for work in group.batch_p2p(ops):
                work.wait()
            group.send(_data(0, 99), 1, tag=5)  # a plain send after them, same tag
            group.barrier()
            return group._writer.written
        outs = [np.zeros(n, np.float32) for n in sizes]
        group.barrier()
        for work in group.batch_p2p([_p2p(False, o, 0, tag=5) for o in outs]):
            work.wait()
        last = np.zeros(N, np.float32)
        group.recv(last, 0, tag=5)
        group.barrier()
        return outs + [last]
    finally:
        group.shutdown()


def test_messages_under_one_tag_arrive_in_order_whichever_way_each_travels():
    written, got = _run(_ordered, 2)
    sizes = [N, 1000, N, 300000, N]
    for i, n in enumerate(sizes):
        np.testing.assert_array_equal(got[i], _data(0, i, n))
    np.testing.assert_array_equal(got[-1], _data(0, 99))
    # The batch's three large ones (the 300 KB one is the ring's); the plain send waits for no
    # offer, and goes directly only if the receive's offer happens to be in already.
    assert written in (3, 4)


def _mismatch(rank, world, port):
    group = _group(rank, world, port)
    try:
        group.barrier()
        if rank == 0:
            # The same bytes as float64: the receiver's offer names float32, so nothing is
            # written into its array and the message goes the usual way, to be refused.
            wrong = _data(0, 1).view(np.float64)
            group.batch_p2p([_p2p(True, wrong, 1)])[0].wait()
            group.batch_p2p([_p2p(True, _data(0, 2), 1)])[0].wait()
            group.barrier()
            return None
        out = np.zeros(N, np.float32)
        try:
            group.batch_p2p([_p2p(False, out, 0)])[0].wait()
            refused = None
        except CollectiveMismatch as exc:
            refused = str(exc)
        untouched = not out.any()
        group.batch_p2p([_p2p(False, out, 0)])[0].wait()
        group.barrier()
        return refused, untouched, out
    finally:
        group.shutdown()


def test_a_receive_that_does_not_fit_is_refused_with_nothing_written_into_it():
    _none, (refused, untouched, out) = _run(_mismatch, 2)
    assert refused is not None and "float64" in refused
    assert untouched
    np.testing.assert_array_equal(out, _data(0, 2))  # the group goes on


def _late(rank, world, port):
    group = _group(rank, world, port)
    try:
        got = []
        for i in range(3):
            group.barrier()
            if rank == 0:
                if i > 0:
                    time.sleep(0.2)  # now the receiver's offer is in first
                group.batch_p2p([_p2p(True, _data(0, i), 1)])[0].wait()
                continue
            if i == 0:
                time.sleep(0.3)  # the sender has long given up waiting for this offer
            out = np.zeros(N, np.float32)
            group.batch_p2p([_p2p(False, out, 0)])[0].wait()
            got.append(out)
        group.barrier()
        return got, group._writer.written, len(group._offers._kept)
    finally:
        group.shutdown()


def test_a_late_receiver_gets_its_message_the_usual_way_and_later_ones_directly():
    (_, written, _), (got, _, kept) = _run(_late, 2)
    for i, out in enumerate(got):
        np.testing.assert_array_equal(out, _data(0, i))
    assert written == 2  # not the first (its receiver was late); the next two
    assert kept == 0
