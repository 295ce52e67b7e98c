"""all_to_all of the tcp backend on one host (ranks as threads, real sockets and memfds): small
blocks ride inline with the size tables in one round trip, large ones through shared memory,
both kinds in one call; blocks that disagree fail every rank naming the pair."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.constants import SMALL_MAX_BYTES
from shoal.collectives.store.hash import HashStore
from shoal.collectives.types import CollectiveMismatch
from tests.support.threaded_ranks import form_groups, run_all

SMALL = 1000  # float32 elements, inline
LARGE = SMALL_MAX_BYTES // 4 + 3  # float32 elements, through shared memory


def make_groups(world: int):
    store = HashStore()
    return form_groups(world, lambda r: ProcessGroupTCP(store, r, world, timeout=10.0))


def _block(src: int, dst: int, n: int) -> np.ndarray:
    return np.arange(n, dtype=np.float32) + 1000 * src + dst


def _size(src: int, dst: int, mixed: bool) -> int:
    # Mixed: the pairs (src + dst) odd exchange large blocks, the rest small ones, and no two
    # pairs share a size (each direction differs), so a misrouted block shows.
    if not mixed:
        return SMALL + src + 3 * dst
    return (LARGE if (src + dst) % 2 else SMALL) + src + 3 * dst


@pytest.mark.parametrize("world,mixed", [(2, False), (3, True), (4, True), (4, False)])
def test_blocks_of_every_size_reach_their_rank(world, mixed):
    pgs = make_groups(world)
    try:
        assert all(pg.uses_shared_memory for pg in pgs)

        def fn(pg, r):
            got = []
            for _ in range(3):  # the rings and tables are reused call after call
                ins = [_block(r, q, _size(r, q, mixed)) for q in range(world)]
                outs = [np.zeros(_size(q, r, mixed), np.float32) for q in range(world)]
                pg.all_to_all(outs, ins)
                got.append(outs)
            return got

        results = run_all(pgs, fn, timeout=60)
        for r, calls in enumerate(results):
            assert not isinstance(calls, BaseException), f"rank {r} raised {calls!r}"
            for outs in calls:
                for q in range(world):
                    np.testing.assert_array_equal(outs[q], _block(q, r, _size(q, r, mixed)))
    finally:
        for pg in pgs:
            pg.shutdown()


@pytest.mark.parametrize("extra", [7, LARGE], ids=["small", "small-vs-large"])
def test_small_blocks_that_disagree_fail_every_rank_naming_both(extra):
    pgs = make_groups(3)
    try:
        def fn(pg, r):
            ins = [np.ones(SMALL + (extra if (r, b) == (2, 0) else 0), np.float32)
                   for b in range(3)]
            outs = [np.zeros(SMALL, np.float32) for _ in range(3)]
            pg.all_to_all(outs, ins)

        results = run_all(pgs, fn, timeout=60)
        for out in results:
            assert isinstance(out, CollectiveMismatch), out
            assert "rank 2's all_to_all input_list[0]" in str(out), out
            assert "rank 0's output_list[2]" in str(out), out
    finally:
        for pg in pgs:
            pg.shutdown()
