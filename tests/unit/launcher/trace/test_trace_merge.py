"""`shoal trace merge` on synthetic rank traces: clock offsets applied with their sign, the
collective wait split from aligned times, traces of different runs refused; and `shoal run`
taking its profile directory from SHOAL_PROFILE_DIR."""

from __future__ import annotations

import json

import pytest

from shoal.launcher.flags import parse_run
from shoal.launcher.trace import cli
from shoal.launcher.trace.merge import merged
from shoal.launcher.trace.files import load
from tests.support.perfetto_rules import import_errors

SCRIPT = __file__  # any existing file will do as the training script


PIDS = {0: 4242, 1: 4242}  # two hosts: the same OS pid on both, which the merge tells apart


def _rank_trace(rank: int, offset_us: float, events: list[dict], run_id: str = "run-a",
                error_us: float = 20.0, base_ns: int = 0) -> dict:
    """A rank's window as the job profiler writes it (only the fields `shoal trace` reads)."""
    pid = PIDS[rank]
    return {
        "distributedInfo": {"rank": rank, "world_size": 2},
        "baseTimeNanoseconds": base_ns,
        "shoal": {"run_id": run_id, "rank": rank, "window": [3, 5],
                  "clock": {"offset_us": offset_us, "error_us": 0.0 if rank == 0 else error_us,
                            "reference_rank": 0, "method": "test"}},
        "traceEvents": [dict(e, pid=pid, tid=pid + 1) for e in events] + [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "x"}},
            {"ph": "M", "name": "process_labels", "pid": pid, "tid": 0,
             "args": {"labels": "CPU"}}],
    }


def _all_reduce(ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "ts": ts, "dur": dur,
            "args": {"Collective name": "allreduce", "op": "all_reduce", "group": "default",
                     "seq": 7, "p2p": False, "call": "all_reduce(uint8[4096], op=SUM)"}}


def _write(directory, docs: list[dict]) -> None:
    for doc in docs:
        rank = doc["shoal"]["rank"]
        (directory / f"rank{rank}.00000003.pt.trace.json").write_text(json.dumps(doc))


def test_each_ranks_offset_is_added_to_its_timestamps(tmp_path):
    # rank 1's clock is 500 us behind rank 0's (offset +500) and its file counts from a base
    # 1 ms later: its all_reduce, stamped 0 there, began at 1500 on rank 0's clock, 100 us
    # after rank 0's began at 1400
    op = {"ph": "X", "cat": "cpu_op", "name": "mm", "ts": 100.0, "dur": 50.0, "args": {}}
    _write(tmp_path, [_rank_trace(0, 0.0, [_all_reduce(1400.0, 300.0)]),
                      _rank_trace(1, 500.0, [op, _all_reduce(0.0, 200.0)], base_ns=1_000_000)])
    doc = merged(load(str(tmp_path)))
    r0, r1 = 4242, 4243  # rank 1's pid, taken by rank 0 already, is renumbered
    xs = {(e["pid"], e["name"]): e for e in doc["traceEvents"] if e["ph"] == "X"}
    # a quarter nanosecond on top, so that Perfetto's int(ts * 1000) reads whole nanoseconds
    assert xs[(r1, "mm")]["ts"] == pytest.approx(1600.0, abs=0.001)
    assert xs[(r1, "gloo:all_reduce")]["ts"] == pytest.approx(1500.0, abs=0.001)
    assert xs[(r0, "gloo:all_reduce")]["ts"] == pytest.approx(1400.0, abs=0.001)
    assert int(xs[(r1, "mm")]["ts"] * 1000) == 1_600_000
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e.get("name") == "process_name"}
    assert names == {r0: "rank 0", r1: "rank 1"}
    # rank 0 waited from 1400 to 1500 for rank 1; rank 1, the last, waited for nobody
    assert xs[(r0, "gloo:all_reduce")]["args"]["wait_for_peers_us"] == pytest.approx(100.0)
    assert xs[(r0, "gloo:all_reduce")]["args"]["moving_us"] == pytest.approx(200.0)
    assert xs[(r1, "gloo:all_reduce")]["args"]["wait_for_peers_us"] == 0.0
    assert doc["shoal"]["clock_error_us"] == 20.0
    assert sorted(doc["shoal"]["clocks"]) == ["0", "1"]


def test_merge_refuses_traces_of_different_runs(tmp_path, capsys):
    _write(tmp_path, [_rank_trace(0, 0.0, [_all_reduce(1.0, 1.0)], run_id="run-a"),
                      _rank_trace(1, 0.0, [_all_reduce(1.0, 1.0)], run_id="run-b")])
    out = tmp_path / "job.json"
    assert cli.main(["merge", str(tmp_path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "come from different runs" in err
    assert "run 'run-a': rank0.00000003.pt.trace.json" in err
    assert "run 'run-b': rank1.00000003.pt.trace.json" in err
    assert not out.exists()


def test_merge_names_a_missing_rank(tmp_path, capsys):
    _write(tmp_path, [_rank_trace(0, 0.0, [_all_reduce(1.0, 1.0)])])
    assert cli.main(["merge", str(tmp_path), "-o", str(tmp_path / "job.json")]) == 2
    assert ("Rank 1 is missing from steps 3-5" in capsys.readouterr().err)


def test_shoal_run_takes_its_profile_directory_from_the_environment():
    assert parse_run([SCRIPT], {}).profile_dir is None
    assert parse_run([SCRIPT], {"SHOAL_PROFILE_DIR": "/tmp/prof"}).profile_dir == "/tmp/prof"
    # the flag, in either spelling, beats the variable
    for flag in ("--profile", "--profile-dir", "--profile_dir"):
        s = parse_run([flag, "/tmp/flag", SCRIPT], {"SHOAL_PROFILE_DIR": "/tmp/prof"})
        assert s.profile_dir == "/tmp/flag"


def test_an_empty_profile_variable_is_no_profile_and_a_blank_one_an_error(capsys):
    assert parse_run([SCRIPT], {"SHOAL_PROFILE_DIR": ""}).profile_dir is None
    with pytest.raises(SystemExit) as info:
        parse_run([SCRIPT], {"SHOAL_PROFILE_DIR": "   "})
    assert info.value.code == 2
    assert "(from SHOAL_PROFILE_DIR='   '): an empty path" in capsys.readouterr().err


def test_each_ranks_gpu_lanes_and_async_ids_stay_apart(tmp_path):
    # both ranks' GPU 0 is pid 0 in their own files, and both number their DDP buckets from 1
    def gpu_and_bucket(rank: int) -> list[dict]:
        return [
            {"ph": "X", "cat": "kernel", "name": "mm", "pid": 0, "tid": 7, "ts": 10.0,
             "dur": 5.0, "args": {"device": 0, "stream": 7, "correlation": 1}},
            {"ph": "M", "name": "process_labels", "pid": 0, "tid": 0,
             "args": {"labels": "GPU 0"}},
            {"ph": "b", "cat": "ddp", "name": "DDP bucket 0 all_reduce", "id": 1, "ts": 1.0},
            {"ph": "e", "cat": "ddp", "name": "DDP bucket 0 all_reduce", "id": 1, "ts": 9.0}]

    docs = [_rank_trace(r, 0.0, []) for r in (0, 1)]
    for rank, doc in enumerate(docs):
        cpu = PIDS[rank]
        doc["traceEvents"] += [dict(e, tid=e.get("tid", cpu), pid=e.get("pid", cpu))
                               for e in gpu_and_bucket(rank)]
    _write(tmp_path, docs)
    doc = merged(load(str(tmp_path)))
    names = {e["args"]["name"]: e["pid"] for e in doc["traceEvents"]
             if e.get("name") == "process_name"}
    assert set(names) == {"rank 0", "rank 1", "rank 0 GPU 0", "rank 1 GPU 0"}
    assert len(set(names.values())) == 4  # four processes, none merged into another
    kernels = {e["pid"] for e in doc["traceEvents"] if e.get("cat") == "kernel"}
    assert kernels == {names["rank 0 GPU 0"], names["rank 1 GPU 0"]}
    buckets = [e for e in doc["traceEvents"] if e.get("cat") == "ddp"]
    assert len({e["id"] for e in buckets}) == 2  # one per rank, begin and end sharing it
    assert import_errors(doc) == []
