"""The machinery both backends share, without a group: the op ledger, the progress record and
the timeout diagnosis (a table), the dump's format as the agent reads it, and the registry."""

from __future__ import annotations

import json

import pytest

from shoal.collectives.backends import progress, registry
from shoal.collectives.backends.dump import write_dump
from shoal.collectives.backends.ledger import OpLedger
from shoal.collectives.backends.progress import RankProgress
from shoal.collectives.types import BackendUnavailable
from shoal.elastic.agent.hang_blame import culprits_from_dump

ALL_REDUCE = "all_reduce(float32[4], op=SUM)"


def test_ledger_numbers_collectives_and_p2p_apart_and_times_the_oldest_running():
    ledger = OpLedger()
    a = ledger.open("all_reduce", ALL_REDUCE, 16, 5.0, False)
    s = ledger.open("send", "send(float32[4], dst=1, tag=0)", 16, 5.0, True)
    b = ledger.record("barrier", "barrier()", 0, 5.0, False)
    assert (a.seq, s.seq, b.seq) == (1, 1, 2) and b.state == "queued"
    assert ledger.oldest_running() is a and ledger.progress() == (1, 0, None)  # s runs last
    ledger.finish(a)
    assert ledger.oldest_running() is s and ledger.finished_seq == 1
    ledger.finish(s, RuntimeError("boom"))
    assert s.state == "failed" and s.error == "boom" and ledger.oldest_running() is None
    ledger.start(b)
    assert ledger.progress() == (2, 1, b) and ledger.current is b
    ledger.finish(b)
    assert ledger.progress() == (2, 2, None)
    assert [r.label for r in ledger.history] == ["all_reduce #1", "send p2p#1", "barrier #2"]


def test_progress_record_round_trips_and_rejects_garbage():
    mine = RankProgress(3, 2, "all_reduce", ALL_REDUCE)
    assert progress.decode(progress.encode(mine).encode()) == mine
    assert progress.decode(b'{"started": 1, "finished": 1}') == RankProgress(1, 1)
    with pytest.raises(ValueError):
        progress.decode(b"1,1")  # the old comma-separated format is gone
    with pytest.raises(ValueError):
        progress.decode(b'{"started": 1}')


def _overdue(op="all_reduce", desc=ALL_REDUCE, seq=5, p2p=False):
    ledger = OpLedger()
    rec = None
    for _ in range(seq):
        rec = ledger.open(op, desc, 16, 1.0, p2p)
    return rec


@pytest.mark.parametrize("others, kind, clause, culprits", [
    ({1: RankProgress(4, 4), 2: RankProgress(5, 4, "all_reduce", ALL_REDUCE)},
     "timeout", "rank 1 never arrived", (1,)),
    ({1: RankProgress(4, 4), 2: RankProgress(3, 3)},
     "timeout", "ranks 1, 2 never arrived", (1, 2)),
    ({1: RankProgress(5, 4, "all_reduce", ALL_REDUCE), 2: RankProgress(5, 5)},
     "timeout", "every rank arrived but rank 1 did not finish", (1,)),
    ({1: RankProgress(5, 5), 2: RankProgress(6, 5, "barrier", "barrier()")},
     "timeout", "every other rank reports it finished; this rank stalled in it", ()),
    ({1: RankProgress(5, 4, "broadcast", "broadcast(float32[4], src=0)"), 2: RankProgress(4, 4)},
     "mismatch", "rank 1 called broadcast(float32[4], src=0) as collective #5 but this rank "
                 f"called {ALL_REDUCE}", (0, 1)),
    ({1: RankProgress(5, 4, "all_reduce", "all_reduce(float32[8], op=SUM)")},
     "mismatch", "rank 1 called all_reduce(float32[8], op=SUM) as collective #5", (0, 1)),
])
def test_diagnosis_table(others, kind, clause, culprits):
    d = progress.diagnose(_overdue(), 0, others, 2.0)
    assert d.kind == kind and d.clause.startswith(clause) and d.culprits == culprits, d


def test_diagnosis_without_progress_and_for_point_to_point():
    assert "could not be read from the store" in progress.diagnose(_overdue(), 0, None, 2.0).clause
    p2p = progress.diagnose(_overdue("recv", "recv(float32[4], src=1, tag=0)", 1, True), 0, {}, 2.0)
    assert p2p.clause == "its point-to-point peer never matched it" and p2p.culprits == ()


def test_all_to_all_blocks_may_differ_between_ranks():
    rec = _overdue("all_to_all", "all_to_all(in int64[1], int64[2]; out int64[1], int64[3])")
    theirs = RankProgress(5, 4, "all_to_all", "all_to_all(in int64[3], int64[4]; out ...)")
    d = progress.diagnose(rec, 0, {1: theirs}, 2.0)
    assert d.kind == "timeout" and "did not finish" in d.clause


class _Group:
    """The members of WatchedGroup that the dump reads."""

    backend_name = "fake"
    name = "g/1"
    global_rank = 7
    timeout = 1.0

    def __init__(self):
        self.ledger = OpLedger()

    def rank(self):
        return 0

    def size(self):
        return 3


def test_dump_is_what_the_agents_hang_blame_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_DUMP_DIR", str(tmp_path))
    group = _Group()
    rec = group.ledger.open("all_reduce", ALL_REDUCE, 16, 1.0, False)
    path = write_dump(group, "why", rec, {1: RankProgress(0, 0), 2: RankProgress(1, 0, "x", "y")})
    assert path.startswith(str(tmp_path / "shoal-collectives-g_1-rank0-pid"))
    doc = json.loads(open(path).read())
    assert doc["progress_of_ranks"] == {"1": [0, 0], "2": [1, 0]}
    assert doc["calls_of_ranks"] == {"1": "", "2": "y"}
    assert doc["global_rank"] == 7 and doc["reason"] == "why" and doc["failed_op"]["seq"] == 1
    assert culprits_from_dump(doc) == (1,)


def test_registry_names_backends_once_and_asks_each_whether_it_runs():
    assert {"gloo", "nccl", "tcp"} <= set(registry.backend_names())  # tests may register more
    assert registry.canonical_name("GLOO") == "tcp" and registry.canonical_name(None) == "tcp"
    assert registry.check_backend_availability("tcp") is None
    assert registry.backend_class("gloo") is registry.backend_class("tcp")
    reason = registry.check_backend_availability("nccl")
    if reason is not None:
        assert reason.startswith("backend 'nccl' needs a CUDA device; none was found (")
        with pytest.raises(BackendUnavailable, match="needs a CUDA device"):
            registry.backend_class("nccl")
    with pytest.raises(BackendUnavailable, match="Unknown process-group backend 'mpi'; known "
                                                 "backends: gloo, .*nccl, .*tcp"):
        registry.backend_class("mpi")
