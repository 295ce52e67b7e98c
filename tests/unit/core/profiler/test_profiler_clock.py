"""Clock offsets from store round trips (core/profiler/clock.py): ranks as threads over a real
TCPStore, on one clock or on clocks skewed by a known amount."""

from __future__ import annotations

import threading
from typing import Callable, Optional

import pytest

from shoal.collectives.store.tcp import TCPStore
from shoal.core.profiler import ProfilerError, clock


def _estimates(world: int, clocks: Optional[dict[int, Callable[[], int]]] = None,
               rounds: int = 5) -> dict[int, dict]:
    """Each rank's estimate, every rank a thread with its own client of one TCPStore."""
    results: dict[int, dict] = {}
    errors: list[BaseException] = []
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=10) as master:

        def rank(r: int) -> None:
            try:
                with TCPStore("127.0.0.1", master.port, timeout=10) as client:
                    own = (clocks or {}).get(r, clock.trace_clock_ns)
                    results[r] = clock.estimate(client, r, world, "clk/test", rounds=rounds,
                                                timeout=10, clock=own)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert not errors, errors
    return results


def test_offsets_on_one_host_are_zero_within_the_stated_error():
    results = _estimates(3)
    assert results[0] == {"offset_us": 0.0, "error_us": 0.0, "reference_rank": 0,
                          "method": "reference"}
    for r in (1, 2):
        est = results[r]
        assert est["error_us"] > 0 and est["method"] == "store round trips (5, shortest kept)"
        # one process, one clock: the true offset is 0, inside the estimate's error bound
        assert abs(est["offset_us"]) <= est["error_us"] + 1.0, est


def test_skewed_clocks_are_measured_within_the_stated_error():
    # rank 0's clock runs 250 ms ahead of the traces' clock, rank 1's 100 ms behind it,
    # rank 2's 3 s ahead: rank 0 minus rank r is +350 ms and -2.75 s
    skews = {0: 250_000_000, 1: -100_000_000, 2: 3_000_000_000}
    clocks = {r: (lambda s=s: clock.trace_clock_ns() + s) for r, s in skews.items()}
    results = _estimates(3, clocks)
    for r in (1, 2):
        est = results[r]
        true_us = (skews[0] - skews[r]) / 1e3
        assert abs(est["offset_us"] - true_us) <= est["error_us"] + 1.0, (r, est, true_us)
    assert results[1]["offset_us"] > 0 > results[2]["offset_us"]  # the sign: rank 0 minus r


def test_the_estimate_reads_the_clock_traces_are_exported_on():
    """Without a clock given, estimate() measures the traces' own clock, and that clock is the
    monotonic one plus the export's epoch offset (not time.time_ns, which NTP may step); the
    skew tests above show estimate() measures whatever clock it is given."""
    import inspect

    from shoal.core.profiler import events

    assert inspect.signature(clock.estimate).parameters["clock"].default is clock.trace_clock_ns
    before = events.now_ns() + events.EPOCH_OFFSET_NS
    t = clock.trace_clock_ns()
    assert before <= t <= events.now_ns() + events.EPOCH_OFFSET_NS


def test_bad_rank_or_rounds_say_which():
    with pytest.raises(ProfilerError, match=r"rank 2 is not in 0\.\.1 \(world size 2\)"):
        clock.estimate(None, 2, 2, "p")
    with pytest.raises(ProfilerError, match="rounds must be at least 1, got 0"):
        clock.estimate(None, 1, 2, "p", rounds=0)
    with pytest.raises(ProfilerError, match=r"rank -1 is not in 0\.\.3"):
        clock.use_store(object(), -1, 4, "p")


@pytest.fixture
def nothing_lent():
    """No store lent during the test (one lent by an earlier test's group comes back after)."""
    saved = clock.lent_store()
    if saved is not None:
        clock.forget_store(saved.store)
    yield
    if saved is not None:
        clock.use_store(saved.store, saved.rank, saved.world_size, saved.prefix)


def test_a_lent_store_gives_each_window_its_own_keys_and_can_be_taken_back(nothing_lent):
    assert clock.window_offset((3, 5))["method"].startswith("none")
    results: dict[int, dict] = {}
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=10) as master, \
            TCPStore("127.0.0.1", master.port, timeout=10) as peer:
        # rank 1 answers from a thread over its own client; this thread lends rank 0's store
        clock.use_store(master, 0, 2, "job/1")
        try:
            for window in ((3, 5), (9, 11)):
                t = threading.Thread(target=lambda w=window: results.__setitem__(
                    w, clock.estimate(peer, 1, 2, f"job/1/{w[0]}-{w[1]}", timeout=10)))
                t.start()
                assert clock.window_offset(window)["method"] == "reference"
                t.join(30)
                assert results[window]["error_us"] > 0
            assert master.get("job/1/9-11/ping/1/0", timeout=1)  # the second window's keys
            clock.forget_store(object())  # another store: the lent one stays
            assert clock.lent_store() is not None and clock.lent_store().store is master
        finally:
            clock.forget_store(master)
    assert clock.lent_store() is None
