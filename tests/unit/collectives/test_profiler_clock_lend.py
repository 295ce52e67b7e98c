"""The default group lends its store to the job profiler's clock (collectives/profiler_clock.py):
keys under the group's own prefix, taken back when the group goes."""

from __future__ import annotations

from shoal.collectives import profiler_clock
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.store.hash import HashStore
from shoal.core.profiler import clock


def test_a_group_lends_its_store_under_its_own_prefix_and_takes_it_back():
    saved = clock.lent_store()
    store = HashStore()
    pg = ProcessGroupTCP(store, 0, 1, timeout=10)
    try:
        profiler_clock.lend_store(pg)
        lent = clock.lent_store()
        assert lent is not None and lent.store is store
        assert (lent.rank, lent.world_size) == (0, 1)
        assert lent.prefix == f"{pg.store_prefix}/profiler/clock"
        # one rank is its own reference: the estimate runs through the lent store at once
        assert clock.window_offset((2, 4)) == {"offset_us": 0.0, "error_us": 0.0,
                                               "reference_rank": 0, "method": "reference"}
        profiler_clock.take_back_store(pg)
        assert clock.lent_store() is None
    finally:
        pg.shutdown()
        if saved is not None:
            clock.use_store(saved.store, saved.rank, saved.world_size, saved.prefix)
