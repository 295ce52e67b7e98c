"""The spawn harness itself: a rank's result arrives whole however large, and a rank that dies
before or halfway through sending it fails the wait at once, naming the rank and its exit
code, instead of leaving the parent blocked on a read (the hang CI met when a rank aborted at
exit while a queue's feeder thread was still writing half a megabyte)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from tests.support import ranks as ranks_mod
from tests.support import report_pipes
from tests.support.ranks import EVENTS, RankFailed, Ranks, run_ranks


def _big(rank, world):
    # 6 MB: far over a pipe's 64 KiB buffer, so the parent must read while the rank writes.
    return np.full(6 << 20, rank, np.uint8)


def _dies_halfway(rank, world):
    if rank == 1:
        def half_then_die(pipe, report):
            os.write(pipe.fileno(), report_pipes.frame(report)[:1008])
            os._exit(6)
        # The harness sends the report after this returns; this rank sends 1,000 bytes of it.
        ranks_mod._send_report = half_then_die
    return np.zeros(1 << 20, np.uint8)


def _exits_at_once(rank, world):
    if rank == 0:
        os._exit(3)
    return rank


def _reports_after_an_event(rank, world, events):
    if rank == 0:
        events.put("ready")
        return "done"
    time.sleep(30)


def test_a_result_over_the_pipe_buffer_arrives_whole():
    out = run_ranks(_big, 2, timeout=60)
    assert [int(a[0]) for a in out] == [0, 1] and all(a.size == 6 << 20 for a in out)


def test_a_rank_dying_halfway_through_its_result_fails_the_wait_naming_it():
    started = time.monotonic()
    with pytest.raises(RankFailed, match=r"Rank 1 exited with half its result sent \(1\d{3} bytes; exit code 6\)"):
        run_ranks(_dies_halfway, 2, timeout=60)
    assert time.monotonic() - started < 30  # not the 60 s deadline: end-of-file ends the wait


def test_a_rank_exiting_without_a_result_fails_the_wait_naming_it():
    with pytest.raises(RankFailed, match=r"Rank 0 exited without a result \(exit code 3\)"):
        run_ranks(_exits_at_once, 2, timeout=60)


def test_waiting_for_an_event_passes_over_a_killed_rank():
    with Ranks(_reports_after_an_event, 2, args=(EVENTS,)) as ranks:
        ranks.kill(1)
        ranks.join(10, ranks=[1])
        assert ranks.event(30) == "ready"
        assert ranks.results(30, ranks=[0]) == {0: ("ok", "done")}
        with pytest.raises(RankFailed, match="Rank 1 exited without a result"):
            ranks.results(5)


# -- the RPC worker pool (tests/support/rpc_workers.py) reads its replies the same way

def _exit_now(code):
    os._exit(code)


def _big_reply():
    return np.arange(3 << 20, dtype=np.uint8)


def test_a_worker_pools_task_on_a_dead_worker_fails_at_once_naming_it():
    from tests.support.rpc_workers import RpcWorkers, WorkerFailed

    with RpcWorkers(2, init=False) as pool:
        assert pool.run(0, _big_reply).size == 3 << 20  # over the pipe's buffer, whole
        task = pool.submit(1, _exit_now, 5)
        started = time.monotonic()
        with pytest.raises(WorkerFailed, match=r"worker w1 exited \(exit code 5\)"):
            pool.result(task, timeout=60)
        assert time.monotonic() - started < 30  # end-of-file, not the deadline
        assert pool.run(0, _big_reply)[-1] == (3 << 20) - 1 & 0xFF  # w0 serves on
