"""`shoal trace summary` on traces in Kineto's shape, shoal's and torch's: communication from
`gloo:`/`nccl:` events on another thread, time bases, the straggler only when it is clear."""

from __future__ import annotations

import json

import pytest

from shoal.launcher.trace import cli
from shoal.launcher.trace.summary import STRAGGLER_MARGIN, summarize


def _torch_style(rank: int, compute_ms: float, comm_start_ms: float, base_ns: int) -> dict:
    """A rank's window as torch's tensorboard_trace_handler writes it: no shoal section, the
    collectives on gloo's own thread, times from the file's base."""
    pid, main, gloo = 1000 + rank, 1000 + rank, 2000 + rank
    events = []
    for step in range(3):
        t0 = step * 10_000.0
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step + 1}",
                       "pid": pid, "tid": main, "ts": t0, "dur": 10_000.0, "args": {}})
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": pid, "tid": main,
                       "ts": t0 + 100.0, "dur": compute_ms * 1000, "args": {}})
        start = t0 + comm_start_ms * 1000
        events.append({"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce",
                       "pid": pid, "tid": gloo, "ts": start, "dur": t0 + 9_900.0 - start,
                       "args": {"Process Group Name": "0"}})
    return {"schemaVersion": 1, "baseTimeNanoseconds": base_ns,
            "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 2},
            "traceEvents": events}


def _write(directory, docs: list[dict]) -> None:
    for doc in docs:
        rank = doc["distributedInfo"]["rank"]
        (directory / f"rank{rank}.17000000{rank}.pt.trace.json").write_text(json.dumps(doc))


def test_torch_traces_give_communication_from_gloo_events_and_wait_by_order(tmp_path):
    # rank 1 computes 6 ms, rank 0 2 ms; both start their all_reduce when done; rank 1's file
    # counts from a base 1 ms later, so its events sit 1 ms later than their `ts` say
    _write(tmp_path, [_torch_style(0, 2.0, 2.2, 0), _torch_style(1, 6.0, 5.2, 1_000_000)])
    rows, call = summarize(str(tmp_path))
    by = {(r.rank, r.step): r for r in rows}
    assert sorted(by) == [(k, s) for k in (0, 1) for s in (1, 2, 3)]
    for step in (1, 2, 3):
        assert by[(0, step)].comm == pytest.approx(7.7)  # 2.2 ms to 9.9 ms
        assert by[(1, step)].comm == pytest.approx(4.7)
        assert by[(0, step)].compute == pytest.approx(2.0)
        # matched by order: rank 1's all_reduce begins at 5.2 + 1 ms, 4 ms after rank 0's
        assert by[(0, step)].waiting == pytest.approx(4.0)
        assert by[(1, step)].waiting == 0.0
    assert call is not None and call.straggler == 1


def _shoal_style(rank: int, busy_ms: float) -> dict:
    events = []
    for step in range(3):
        t0 = step * 10_000.0
        events += [
            {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step + 3}",
             "pid": 7, "tid": 7, "ts": t0, "dur": 10_000.0, "args": {}},
            {"ph": "X", "cat": "cpu_op", "name": "linear", "pid": 7, "tid": 7,
             "ts": t0, "dur": busy_ms * 1000, "args": {}},
            {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 7, "tid": 7,
             "ts": t0 + busy_ms * 1000, "dur": 10_000.0 - busy_ms * 1000,
             "args": {"group": "default", "seq": step + 1, "call": "all_reduce(float32[4])"}}]
    return {"baseTimeNanoseconds": 0,
            "distributedInfo": {"backend": "tcp", "rank": rank, "world_size": 2},
            "shoal": {"run_id": "r", "rank": rank, "window": [3, 5],
                      "clock": {"offset_us": 0.0, "error_us": 1.0}},
            "traceEvents": events}


@pytest.mark.parametrize("slow_ms, named", [(5.05, False), (5.4, False), (6.0, True)])
def test_a_straggler_is_named_only_beyond_the_margin(tmp_path, capsys, slow_ms, named):
    # 10 ms steps: the margin is 5% of them, 0.5 ms over the other rank's busy 5 ms
    assert STRAGGLER_MARGIN == 0.05
    _write(tmp_path, [_shoal_style(0, 5.0), _shoal_style(1, slow_ms)])
    assert cli.main(["summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    if named:
        assert "straggler: rank 1 (busy 6.00 ms" in out, out
        assert "no clear straggler" not in out
    else:
        assert "no clear straggler: the busiest rank, 1," in out, out
        assert "more than 5% of the median step (0.50 ms)" in out
        assert "straggler: rank" not in out
