"""elastic.agent.noticing reads a worker's own multiprocess files: written here with
prometheus_client's own writer (MmapedDict, mmap_key), as a worker's counters write them."""

from __future__ import annotations

from prometheus_client.mmap_dict import MmapedDict, mmap_key

from shoal.elastic.agent.noticing import read_tally

PID = 4242


def _write(path, entries) -> None:
    db = MmapedDict(str(path))
    try:
        for (metric, sample, labels, doc), value in entries:
            db.write_value(mmap_key(metric, sample, list(labels), list(labels.values()), doc),
                           value, 0.0)
    finally:
        db.close()


def _errors(op: str, kind: str, value: float):
    return (("shoal_collectives_errors", "shoal_collectives_errors_total",
             {"op": op, "kind": kind}, "Collectives that failed on this rank."), value)


def _bucket(value: float):
    return (("shoal_collectives_op_duration_seconds",
             "shoal_collectives_op_duration_seconds_bucket",
             {"backend": "tcp", "le": "0.001", "op": "all_reduce"},
             "Wall time of one collective."), value)


def test_a_worker_without_files_ran_nothing_and_counted_nothing(tmp_path):
    tally = read_tally(str(tmp_path), PID)
    assert not tally.ran_collectives and tally.errors == 0


def test_series_created_at_zero_are_not_a_collective_or_a_failure(tmp_path):
    # A worker's error series exist at 0 from its import on (collectives.metrics).
    _write(tmp_path / f"counter_{PID}.db", [_errors("none", "peer_lost", 0.0),
                                            _errors("all_reduce", "timeout", 0.0)])
    _write(tmp_path / f"histogram_{PID}.db", [_bucket(0.0)])
    tally = read_tally(str(tmp_path), PID)
    assert not tally.ran_collectives and tally.errors == 0


def test_a_collective_and_a_counted_failure_of_any_op_show(tmp_path):
    _write(tmp_path / f"histogram_{PID}.db", [_bucket(3.0)])
    assert read_tally(str(tmp_path), PID).ran_collectives
    assert read_tally(str(tmp_path), PID).errors == 0
    _write(tmp_path / f"counter_{PID}.db", [_errors("none", "peer_lost", 1.0),
                                            _errors("all_reduce", "peer_lost", 1.0)])
    assert read_tally(str(tmp_path), PID).errors == 2.0
    # Another worker's files are not this one's.
    assert read_tally(str(tmp_path), PID + 1).errors == 0
