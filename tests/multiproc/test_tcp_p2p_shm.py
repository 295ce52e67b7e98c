"""Point-to-point messages of the tcp backend through shared memory (ranks as threads, real
sockets and memfds): payloads above the small-message size ride the senders' rings, tags and
ordering hold across both paths, a full ring falls back to the sockets, a mismatch drops only
that message (and frees its ring space), and batch_isend_irecv runs as one operation with one
Work per op. The rings' bookkeeping alone is in tests/unit/collectives/backends/tcp/
test_shm_p2p.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from shoal.collectives.backends.tcp import shm
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.constants import SMALL_MAX_BYTES
from shoal.collectives.store.hash import HashStore
from shoal.collectives.types import CollectiveMismatch
from tests.support.threaded_ranks import form_groups, run_all

LARGE = SMALL_MAX_BYTES // 4 + 1001  # float32 elements: above the small-message size


def make_groups(world: int, timeout: float = 10.0):
    store = HashStore()
    return form_groups(world, lambda r: ProcessGroupTCP(store, r, world, timeout=timeout))


def _ok(results):
    for r, out in enumerate(results):
        assert not isinstance(out, BaseException), f"rank {r} raised {out!r}"
    return results


def _data(rank: int, n: int, salt: int) -> np.ndarray:
    return np.random.default_rng(1000 * rank + salt).standard_normal(n).astype(np.float32)


@pytest.fixture
def pair():
    pgs = make_groups(2)
    yield pgs
    for pg in pgs:
        pg.shutdown()


def _ring_bytes(pg) -> int:
    return shm.p2p_ring_bytes(pg.size())


def test_large_messages_keep_their_tag_order_and_mix_with_small_ones(pair):
    assert all(pg.uses_shared_memory for pg in pair)
    sizes = [LARGE, 10, LARGE * 3, 5, LARGE]

    def fn(pg, r):
        if r == 0:
            for i, n in enumerate(sizes):
                pg.send(_data(0, n, i), 1, tag=i % 2)
            return None
        # Tag 1's messages first: they overtake tag 0's, which wait in the ring meanwhile.
        got = {}
        for i in [1, 3, 0, 2, 4]:
            out = np.empty(sizes[i], np.float32)
            work = pg.recv(out, 0, tag=i % 2)
            assert work.source_rank == 0
            got[i] = out
        return got

    got = _ok(run_all(pair, fn, timeout=60))[1]
    for i, n in enumerate(sizes):
        np.testing.assert_array_equal(got[i], _data(0, n, i))


def test_a_full_ring_falls_back_to_the_sockets_and_frees_in_order(pair):
    # Three messages of more than a third of the ring each: the third cannot fit until the
    # receiver takes the first, so it goes over the control channel; all arrive intact.
    n = _ring_bytes(pair[0]) // 4 // 3 + 1024

    def fn(pg, r):
        if r == 0:
            for i in range(3):
                pg.send(_data(0, n, i), 1)
            pg.barrier()
            pg.send(_data(0, n, 9), 1)  # the ring's space is free again
            return None
        pg.barrier()
        outs = [np.empty(n, np.float32) for _ in range(4)]
        for out in outs:
            pg.recv(out, 0)
        return outs

    outs = _ok(run_all(pair, fn, timeout=60))[1]
    for i, out in zip((0, 1, 2, 9), outs):
        np.testing.assert_array_equal(out, _data(0, n, i))


def test_a_mismatched_large_message_is_dropped_and_the_next_one_arrives(pair):
    def fn(pg, r):
        if r == 0:
            pg.send(np.ones(LARGE, np.float32), 1)
            pg.send(np.full(LARGE, 2.0, np.float32), 1)
            pg.barrier()
            return None
        with pytest.raises(CollectiveMismatch, match="was dropped"):
            pg.recv(np.empty(LARGE + 1, np.float32), 0)
        out = np.empty(LARGE, np.float32)
        pg.recv(out, 0)
        pg.barrier()
        return out

    out = _ok(run_all(pair, fn, timeout=60))[1]
    assert (out == 2.0).all()


def test_recv_from_any_source_takes_a_ring_message():
    pgs = make_groups(3)
    try:
        def fn(pg, r):
            if r == 2:
                out = [np.empty(LARGE, np.float32) for _ in range(2)]
                sources = sorted(pg.recv(o, None).source_rank for o in out)
                return sources, out
            pg.send(np.full(LARGE, float(r), np.float32), 2)
            return None

        sources, out = _ok(run_all(pgs, fn, timeout=60))[2]
        assert sources == [0, 1]
        assert sorted(float(o[0]) for o in out) == [0.0, 1.0]
    finally:
        for pg in pgs:
            pg.shutdown()


@pytest.mark.parametrize("world", [2, 4])
def test_batch_isend_irecv_shifts_a_ring_as_one_operation(world):
    pgs = make_groups(world)
    try:
        def fn(pg, r):
            outs = []
            for salt, n in enumerate((1024, LARGE, 4 * LARGE)):
                x = _data(r, n, salt)
                y = np.empty_like(x)
                works = pg.batch_p2p([(True, x, (r + 1) % world, 0),
                                      (False, y, (r - 1) % world, 0)])
                assert len(works) == 2
                for w in works:
                    w.wait()
                assert works[1].source_rank == (r - 1) % world
                outs.append(y)
            return outs

        results = _ok(run_all(pgs, fn, timeout=60))
        for r, outs in enumerate(results):
            for salt, (n, y) in enumerate(zip((1024, LARGE, 4 * LARGE), outs)):
                np.testing.assert_array_equal(y, _data((r - 1) % world, n, salt))
    finally:
        for pg in pgs:
            pg.shutdown()


def test_a_batch_fails_only_the_receive_that_does_not_fit(pair):
    def fn(pg, r):
        if r == 0:
            works = pg.batch_p2p([(True, np.ones(LARGE, np.float32), 1, 0),
                                  (True, np.full(8, 3.0, np.float32), 1, 1)])
            for w in works:
                w.wait()
            return None
        small = np.empty(8, np.float32)
        works = pg.batch_p2p([(False, np.empty(LARGE - 1, np.float32), 0, 0),
                              (False, small, 0, 1)])
        with pytest.raises(CollectiveMismatch, match="was dropped"):
            works[0].wait()
        assert not works[0].is_success() and works[1].is_success()
        works[1].wait()
        return small

    small = _ok(run_all(pair, fn, timeout=60))[1]
    assert (small == 3.0).all()


def test_a_batch_names_a_bad_peer(pair):
    with pytest.raises(ValueError, match="cannot send to itself"):
        pair[0].batch_p2p([(True, np.ones(4, np.float32), 0, 0)])
    with pytest.raises(ValueError, match="peer must be a rank in 0..1"):
        pair[0].batch_p2p([(False, np.ones(4, np.float32), 5, 0)])


def test_a_batch_whose_message_is_late_returns_and_completes_in_the_worker(pair):
    # Rank 1's batch must return while its receive is pending (the worker finishes it), or
    # rank 0, which sends only once rank 1's call returned, would never send.
    returned = threading.Event()

    def fn(pg, r):
        if r == 0:
            assert returned.wait(10), "rank 1's batch_isend_irecv blocked on its late receive"
            pg.send(np.full(LARGE, 5.0, np.float32), 1)
            return None
        out = np.empty(LARGE, np.float32)
        (work,) = pg.batch_p2p([(False, out, 0, 0)])
        returned.set()
        assert work.wait(10)
        assert work.source_rank == 0
        pg.all_reduce(np.ones(4, np.float32))  # the group runs on after the handed-off batch
        return out

    def fn_all(pg, r):
        got = fn(pg, r)
        if r == 0:
            pg.all_reduce(np.ones(4, np.float32))
        return got

    out = _ok(run_all(pair, fn_all, timeout=60))[1]
    assert (out == 5.0).all()
