"""batch_isend_irecv on the tcp backend: what a batch's shape decides is built once and cached
(`ProcessGroupTCP.batch_p2p`), so a cached plan must never leak into a batch of another shape,
and every refusal must still come before anything is sent. Two real groups, one per thread."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.threaded_ranks import form_groups, run_all

import shoal.collectives as c
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.store.hash import HashStore
from shoal.collectives.types import CollectiveMismatch


@pytest.fixture(scope="module")
def pgs():
    store = HashStore()
    groups = form_groups(2, lambda r: ProcessGroupTCP(store, r, 2, timeout=20.0))
    yield groups
    # Together: one rank's shutdown waits for the other's goodbye.
    run_all(groups, lambda pg, r: pg.shutdown())


def _swap(pg, r, x, y, tag=0):
    works = c.batch_isend_irecv([c.P2POp(c.isend, x, 1 - r, group=pg, tag=tag),
                                 c.P2POp(c.irecv, y, 1 - r, group=pg, tag=tag)])
    for w in works:
        w.wait()
    return works


def test_batches_of_different_shapes_each_use_their_own_plan(pgs):
    def body(pg, r):
        got = []
        # Shape A, then B (another dtype, size and tag), then A again from the cache.
        for n, dtype, tag in ((16, np.float32, 0), (5, np.int64, 7), (16, np.float32, 0)):
            x = np.arange(n, dtype=dtype) + 100 * r
            y = np.zeros(n, dtype)
            works = _swap(pg, r, x, y, tag)
            got.append((y.copy(), works[1].source_rank))
        return got

    out = run_all(pgs, body)
    for r, got in enumerate(out):
        assert not isinstance(got, BaseException), got
        peer = 1 - r
        np.testing.assert_array_equal(got[0][0], np.arange(16, dtype=np.float32) + 100 * peer)
        np.testing.assert_array_equal(got[1][0], np.arange(5, dtype=np.int64) + 100 * peer)
        np.testing.assert_array_equal(got[2][0], got[0][0])
        assert [g[1] for g in got] == [peer] * 3


def test_a_receive_that_does_not_fit_fails_alone(pgs):
    def body(pg, r):
        x = np.ones(8, np.float32)
        # Rank 0 expects 4 elements where rank 1 sends 8: only rank 0's receive fails.
        y = np.zeros(4 if r == 0 else 8, np.float32)
        works = c.batch_isend_irecv([c.P2POp(c.isend, x, 1 - r, group=pg),
                                     c.P2POp(c.irecv, y, 1 - r, group=pg)])
        works[0].wait()
        try:
            works[1].wait()
        except CollectiveMismatch as exc:
            return str(exc)
        return y.copy()

    out = run_all(pgs, body)
    assert isinstance(out[0], str) and "float32[4]" in out[0] and "float32[8]" in out[0], out
    np.testing.assert_array_equal(out[1], np.ones(8, np.float32))
    # The group survived: the next batch of the same shapes goes through.
    again = run_all(pgs, lambda pg, r: _swap(pg, r, np.full(3, r, np.float32),
                                              np.zeros(3, np.float32)) and True)
    assert again == [True, True], again


@pytest.mark.parametrize("peer, tag, message", [
    (2, 0, "peer must be a rank in 0..1 of this group, got 2"),
    (-1, 0, "peer must be a rank in 0..1 of this group, got -1"),
    (True, 0, "peer must be a rank in 0..1 of this group, got True"),
    (1.0, 0, "peer must be a rank in 0..1 of this group, got 1.0"),
    (0, 0, "Rank 0 cannot send to itself"),
    (1, 2 ** 31, "tag must be a 32-bit int"),
    (1, True, "tag must be a 32-bit int"),
])
def test_a_bad_peer_or_tag_is_refused_before_anything_is_sent(pgs, peer, tag, message):
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match=message):
        pgs[0].batch_p2p([(True, x, peer, tag)])
    # Nothing went out: a fresh exchange of the same tag gets exactly the new payloads.
    out = run_all(pgs, lambda pg, r: _swap(pg, r, np.full(4, 10 + r, np.float32),
                                           y := np.zeros(4, np.float32)) and y)
    for r, y in enumerate(out):
        np.testing.assert_array_equal(y, np.full(4, 11 - r, np.float32))
