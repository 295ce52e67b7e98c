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
from tests.support.ranks import EVENTS, RankFailed, Ranks, run_ranks


def _big(rank, world):
    # 6 MB: far over a pipe's 64 KiB buffer, so the parent must read while the rank writes.
    return np.full(6 << 20, rank, np.uint8)


def _dies_halfway(rank, world):
    if rank == 1:
        def half_then_die(pipe, report):
            import pickle
            payload = pickle.dumps(report)
            os.write(pipe.fileno(), ranks_mod._LENGTH.pack(len(payload)) + payload[:1000])
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
