"""A group's worker thread polls its receives only while some thread waits for the group's
operations (`algorithms.poll_only_while`, `executor.Waiters`): an operation issued
asynchronously, whose caller computes meanwhile, sleeps in the kernel for a late peer instead
of spinning on the core that peer or the caller needs (fully_shard's prefetches)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from shoal.collectives.backends.ledger import OpLedger
from shoal.collectives.backends.tcp import algorithms
from shoal.collectives.backends.tcp.executor import InOrderExecutor
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.store.hash import HashStore
from tests.support.threaded_ranks import form_groups, run_all

# Long enough that a receive which polls for it burns CPU we can see even on a loaded machine.
WINDOW_US = 100_000
LATE_S = 0.15  # how late the peer arrives: past the whole window


@pytest.fixture
def pair(monkeypatch):
    monkeypatch.setenv("SHOAL_SPIN_US", str(WINDOW_US))
    store = HashStore()
    pgs = form_groups(2, lambda r: ProcessGroupTCP(store, r, 2, timeout=10.0))
    yield pgs
    for pg in pgs:
        pg.shutdown()


def _late_peer(pg, rank, rank0_body):
    """Rank 1 joins a 4 KiB all_reduce LATE_S late; rank 0 runs `rank0_body(pg, x)`."""
    x = np.full(1024, float(rank + 1), dtype=np.float32)
    if rank == 1:
        time.sleep(LATE_S)
        pg.all_reduce(x)
        return x
    return rank0_body(pg, x)


def _cpu_of_sync_call(allowed: bool):
    def body(pg, x):
        algorithms.poll_only_while(lambda: allowed)
        try:
            t0 = time.thread_time()
            pg.all_reduce(x)  # idle group, synchronous: runs in this thread
            return time.thread_time() - t0, x
        finally:
            algorithms.poll_only_while(None)
    return body


def test_a_thread_whose_gate_is_shut_does_not_poll(pair):
    shut = run_all(pair, lambda pg, r: _late_peer(pg, r, _cpu_of_sync_call(False)))
    opened = run_all(pair, lambda pg, r: _late_peer(pg, r, _cpu_of_sync_call(True)))
    (shut_cpu, shut_x), (open_cpu, open_x) = shut[0], opened[0]
    assert np.all(shut_x == 3.0) and np.all(open_x == 3.0) and np.all(shut[1] == 3.0)
    # Shut: the receive sleeps in the kernel; a 4 KiB all_reduce costs well under a
    # millisecond of CPU, and 10 ms leaves room for a slow, loaded machine.
    assert shut_cpu < 0.010
    # Open: it polls for the 100 ms window before sleeping. A spinning thread gets at least
    # a quarter of a core even with four runnable threads per core of a 2-core machine.
    assert open_cpu > 0.020


def _async_then_compute(pg, x):
    work = pg.all_reduce(x, async_op=True)
    t0 = time.process_time()
    time.sleep(LATE_S + 0.05)  # "computing" (sleeping): nobody waits for the all_reduce yet
    cpu = time.process_time() - t0
    work.wait(5)
    return cpu, x


def test_an_async_op_nobody_waits_for_sleeps_for_its_late_peer(pair):
    (cpu, x), other = run_all(pair, lambda pg, r: _late_peer(pg, r, _async_then_compute))
    assert np.all(x == 3.0) and np.all(other == 3.0)
    # The whole process's CPU while rank 0's worker waits for rank 1: rank 1's own
    # all_reduce (well under 1 ms) and the services' threads, not a 100 ms poll window.
    assert cpu < 0.015


def _executor():
    def runner(rec, job, arrays):
        return job(rec, arrays)

    return InOrderExecutor("t", OpLedger(), runner, lambda rec: f"op #{rec.seq}")


def test_a_thread_blocked_in_wait_lets_the_worker_poll():
    ex = _executor()
    release = threading.Event()
    seen = []

    def job(rec, arrays):
        release.wait(5)
        seen.append(algorithms._GATE.allows())  # the worker's gate, read in the worker
        return []

    alone = ex.submit("op", "op", 0, 5.0, True, False, job, None)
    release.set()
    deadline = time.monotonic() + 5
    while not alone.is_completed() and time.monotonic() < deadline:  # without wait()
        time.sleep(0.001)
    assert alone.is_completed() and seen == [False]

    release.clear()
    work = ex.submit("op", "op", 0, 5.0, True, False, job, None)
    waiter = threading.Thread(target=work.wait, args=(5,))
    waiter.start()
    deadline = time.monotonic() + 5
    while ex.waiters.count == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    release.set()
    waiter.join(5)
    assert seen == [False, True]
    assert ex.waiters.count == 0  # the wait ended and was counted out
    ex.stop(RuntimeError("done"))
