"""The threaded ring's chunks over tagged TCP links (`over_sockets.TAGGED_CHUNK_MIN_BYTES`):
segments shorter than, equal to and longer than one chunk, and ragged last chunks, all reduce
to the exact sum on every rank, and each frame of them is checked.

Ranks are threads here; every link is loopback TCP, as between hosts.
"""

from __future__ import annotations

import numpy as np
import pytest

from shoal.collectives.backends.tcp import over_sockets
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.constants import THREADED_MIN_BYTES
from shoal.collectives.store.hash import HashStore
from shoal.collectives.types import ReduceOp
from tests.support.threaded_ranks import form_groups, run_all

CHUNK = over_sockets.TAGGED_CHUNK_MIN_BYTES // 4  # float32 elements in one chunk at the floor


@pytest.fixture(params=[2, 3], ids=["W2", "W3"])
def tcp_groups(request, monkeypatch):
    monkeypatch.setenv("SHOAL_LOCAL_TRANSPORT", "tcp")
    store = HashStore()
    world = request.param
    pgs = form_groups(world, lambda r: ProcessGroupTCP(store, r, world, timeout=20.0))
    yield pgs
    # Together: each rank's shutdown says goodbye to the others and waits a moment for theirs.
    run_all(pgs, lambda pg, _r: pg.shutdown())


def test_threaded_ring_chunks_reduce_exactly(tcp_groups):
    pgs = tcp_groups
    world = len(pgs)
    # Element counts past the threaded ring's threshold whose segments hold less than one chunk,
    # one chunk plus a ragged piece, and several chunks plus a ragged piece.
    sizes = [THREADED_MIN_BYTES // 4 + 1, world * (CHUNK + 1) + 1, world * 3 * CHUNK + 7]
    assert all(n * 4 >= THREADED_MIN_BYTES for n in sizes)

    def fn(pg, r):
        out = []
        for n in sizes:
            # Integers below 2**24 in float32: every sum is exact in any order.
            a = (np.arange(n, dtype=np.float32) % 1000) + r
            pg.all_reduce(a, ReduceOp.SUM)
            out.append(a)
        return out

    for got in run_all(pgs, fn, timeout=60.0):
        assert not isinstance(got, BaseException), got
        for n, a in zip(sizes, got):
            want = world * (np.arange(n, dtype=np.float32) % 1000) + sum(range(world))
            np.testing.assert_array_equal(a, want)
