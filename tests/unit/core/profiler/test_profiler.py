"""core.profiler: event counts, schedule (against torch's), tables, Chrome trace format, memory."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
import threading
import time

import numpy as np
import pytest

from shoal import core
from shoal.core import profiler as P
from shoal.core.ops.unary import tanh as imported_tanh


def _counts(prof: P.profile) -> dict:
    return {a.key: a.count for a in prof.key_averages()}


def test_counts_equal_the_calls_of_a_scripted_sequence() -> None:
    a = core.randn(3, 4, requires_grad=True)
    b = core.randn(4, 2, requires_grad=True)
    with P.profile() as prof:
        for _ in range(3):
            c = a + a
        d = c.matmul(b)
        e = core.matmul(c, b)
        loss = (d.relu() * e).sum()
        loss.backward()
    counts = _counts(prof)
    assert counts["add"] == 3
    assert counts["matmul"] == 2
    assert counts["relu"] == 1 and counts["mul"] == 1 and counts["sum"] == 1
    # one backward event per node the pass ran: sum, mul, relu, two matmuls, the last add
    backward = {k: v for k, v in counts.items() if k.endswith("Backward")}
    assert sum(backward.values()) == 6, backward
    # off again: nothing left wrapped, and calls outside the block are not recorded
    assert getattr(core.Tensor.__add__, "__wrapped__", None) is None
    _ = a + a
    assert _counts(prof)["add"] == 3


def test_ops_a_user_module_imported_by_name_are_recorded_too() -> None:
    with P.profile() as prof:
        imported_tanh(core.ones(3))
    assert _counts(prof)["tanh"] == 1
    assert imported_tanh.__module__ == "shoal.core.ops.unary"
    assert not hasattr(imported_tanh, "__wrapped__")  # put back afterwards


def test_forward_events_link_to_their_backward_events() -> None:
    x = core.randn(5, requires_grad=True)
    with P.profile() as prof:
        (x * x).sum().backward()
    evs = [fe.ev for fe in prof.events()]
    mul = next(e for e in evs if e.name == "mul")
    mul_bwd = [e for e in evs if e.cat == "backward" and e.flow == mul.flow]
    assert mul.flow and len(mul_bwd) == 1 and mul_bwd[0].start >= mul.end


def test_cuda_activity_without_a_gpu_still_times_forward_and_backward_on_the_cpu(
        caplog) -> None:
    from shoal.core.profiler import cuda

    if cuda.available():
        pytest.skip("a GPU is here: tests/gpu/test_profiler_cuda.py checks its CUDA times")
    x = core.randn(5, requires_grad=True)
    with caplog.at_level("WARNING", logger="shoal.core.profiler.profile"):
        with P.profile(activities=[P.ProfilerActivity.CPU, P.ProfilerActivity.CUDA]) as prof:
            (x * x).sum().backward()
    assert "no CUDA device through cupy here; profiling the CPU only" in caplog.text
    evs = [fe.ev for fe in prof.events()]
    mul = next(e for e in evs if e.name == "mul")
    backward = [e for e in evs if e.cat == "backward"]
    assert [e.flow for e in backward if e.flow == mul.flow] == [mul.flow]
    assert all(e.cuda == 0 for e in evs) and not [e for e in evs if e.cat == "kernel"]


@pytest.mark.parametrize("wait,warmup,active,repeat,skip_first", [
    (1, 1, 2, 0, 0), (0, 0, 1, 0, 0), (2, 1, 3, 2, 1), (1, 0, 1, 3, 5), (0, 2, 2, 1, 0),
    (3, 0, 2, 0, 2),
])
def test_schedule_matches_torch(wait: int, warmup: int, active: int, repeat: int,
                                skip_first: int) -> None:
    tp = pytest.importorskip("torch.profiler")
    ours = P.schedule(wait=wait, warmup=warmup, active=active, repeat=repeat,
                      skip_first=skip_first)
    theirs = tp.schedule(wait=wait, warmup=warmup, active=active, repeat=repeat,
                         skip_first=skip_first)
    assert [ours(s).name for s in range(40)] == [theirs(s).name for s in range(40)]


def test_profile_records_exactly_the_steps_torchs_schedule_records() -> None:
    tp = pytest.importorskip("torch.profiler")
    kw = dict(wait=1, warmup=1, active=2, repeat=2, skip_first=1)
    windows: list[list[int]] = []

    def ready(prof: P.profile) -> None:
        names = [fe.name for fe in prof.events() if fe.name.startswith("work")]
        windows.append(sorted(int(n[4:]) for n in names))

    x = core.ones(2)
    with P.profile(schedule=P.schedule(**kw), on_trace_ready=ready) as prof:
        for step in range(12):
            with P.record_function(f"work{step}"):
                _ = x + x
            prof.step()
    theirs = tp.schedule(**kw)
    recorded = [s for s in range(12) if theirs(s).name.startswith("RECORD")]
    assert [s for w in windows for s in w] == recorded
    saves = [s for s in range(12) if theirs(s).name == "RECORD_AND_SAVE"]
    assert [w[-1] for w in windows] == saves


def test_bad_schedule_values_and_sort_keys_name_the_allowed_ones() -> None:
    with pytest.raises(P.ProfilerError, match=r"active=0 is not allowed.*active >= 1"):
        P.schedule(wait=0, warmup=0, active=0)
    with pytest.raises(P.ProfilerError, match=r"wait=-1 is not allowed"):
        P.schedule(wait=-1, warmup=0, active=1)
    with P.profile() as prof:
        _ = core.ones(2) + 1
    with pytest.raises(P.ProfilerError, match=r"unknown sort_by 'self_cpu'; allowed: cpu_time, "):
        prof.key_averages().table(sort_by="self_cpu")
    with pytest.raises(P.ProfilerError, match=r"unknown activity 'gpu'"):
        P.profile(activities=["gpu"])
    with pytest.raises(P.ProfilerError, match="schedule returned 'x' for step 0"):
        with P.profile(schedule=lambda s: "x"):
            pass


def test_table_has_torchs_columns_and_sorts() -> None:
    with P.profile(profile_memory=True, record_shapes=True) as prof:
        a = core.ones(64, 64) * 0.01
        for _ in range(4):
            a = a @ a
        _ = a.exp()
    table = prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=3)
    header = table.splitlines()[1]
    for col in ("Name", "Self CPU %", "Self CPU", "CPU total %", "CPU total", "CPU time avg",
                "CPU Mem", "Self CPU Mem", "# of Calls", "Input Shapes"):
        assert col in header
    assert len(table.splitlines()) == 3 + 3 + 2  # header block, 3 rows, rule and total
    assert "[[64, 64], [64, 64]]" in table
    avgs = sorted(prof.key_averages(), key=lambda r: r.self_cpu_time_total, reverse=True)
    assert table.splitlines()[3].startswith(avgs[0].key)


def _site_a(x):
    return x * 2


def _site_b(x):
    return x * 2


def test_group_by_stack_n_splits_an_op_by_its_call_site() -> None:
    x = core.ones(3)
    with P.profile(with_stack=True) as prof:
        _site_a(x)
        _site_b(x)
        _site_b(x)
    muls = [r for r in prof.key_averages(group_by_stack_n=1) if r.key == "mul"]
    assert sorted((r.count, r.stack[0].split(": ")[-1]) for r in muls) == [
        (1, "_site_a"), (2, "_site_b")]
    assert [r.count for r in prof.key_averages() if r.key == "mul"] == [3]
    assert "Source Location" in prof.key_averages(group_by_stack_n=1).table()


def test_record_function_as_decorator_and_nested_self_time() -> None:
    @P.record_function("outer")
    def outer() -> None:
        with P.record_function("inner"):
            _ = core.ones(100, 100).sum()

    with P.profile() as prof:
        outer()
    avg = {a.key: a for a in prof.key_averages()}
    assert avg["outer"].count == 1 and avg["inner"].count == 1
    assert avg["outer"].self_cpu_time_total == pytest.approx(
        avg["outer"].cpu_time_total - avg["inner"].cpu_time_total)
    assert avg["inner"].cpu_time_total >= avg["sum"].cpu_time_total


def test_memory_totals_equal_the_bytes_allocated() -> None:
    with P.profile(profile_memory=True) as prof:
        a = core.ones(100, 100)  # 40000 bytes
        b = a + a  # 40000 more
        c = b.reshape(10000)  # a view: nothing new
        d = c.sum()  # 4 bytes
        del b, c  # the view kept b's storage; dropping both frees the tensor objects
        keep = (a, d)
    avg = {r.key: r for r in prof.key_averages()}
    assert avg["ones"].self_cpu_memory_usage == 40000
    assert avg["reshape"].cpu_memory_usage == 0
    allocated = sum(max(fe.ev.mem, 0) for fe in prof.events())
    assert allocated == 40000 + 40000 + 4
    mem_events = prof.events().recorder.mem_events  # allocations (+) and frees (-)
    assert sum(m.mem for m in mem_events if m.mem > 0) == allocated
    freed = -sum(m.mem for m in mem_events if m.mem < 0)
    assert freed == 40000  # b (the view c was never counted)
    assert prof.events().peak_memory() == 80004
    assert keep


def test_after_a_backward_pass_only_the_gradient_stays_allocated() -> None:
    import gc

    x = core.ones(100, requires_grad=True)
    with P.profile(profile_memory=True) as prof:
        y = x * 2
        z = (y * y).sum()
        z.backward()
        del y, z  # the activations and the backward's temporaries die with the graph
        gc.collect()
    evs = prof.events()
    allocated = sum(fe.ev.mem for fe in evs if fe.ev.mem > 0)
    freed = sum(m.mem for m in evs.recorder.mem_events if m.mem < 0)
    assert allocated + freed == x.grad.array.nbytes == 400
    # the memory events hold the same allocations, each with its address, freed at that address
    allocs = {m.args["Addr"]: m.mem for m in evs.recorder.mem_events if m.mem > 0}
    assert sum(allocs.values()) == allocated
    assert all(allocs[m.args["Addr"]] == -m.mem for m in evs.recorder.mem_events if m.mem < 0)
    assert allocated == 400 + 400 + 4 + 800 + 400  # two muls, sum; y*y's and x*2's backward
    assert evs.peak_memory() > 800


def _check_trace_format(doc: dict) -> None:
    assert isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    starts, finishes = {}, {}
    for ev in doc["traceEvents"]:
        assert {"ph", "name", "pid", "tid"} <= ev.keys(), ev
        if ev["ph"] == "M":
            continue
        assert isinstance(ev["ts"], float | int)
        if ev["ph"] == "X":
            assert ev["dur"] >= 0 and "cat" in ev
        elif ev["ph"] == "s":
            starts[ev["id"]] = ev
        elif ev["ph"] == "f":
            assert ev["bp"] == "e"
            finishes[ev["id"]] = ev
    assert starts and starts.keys() == finishes.keys()
    for fid, s in starts.items():
        assert finishes[fid]["ts"] >= s["ts"]


def test_exported_trace_satisfies_the_chrome_format(tmp_path) -> None:
    m = core.nn.Sequential(core.nn.Linear(8, 8), core.nn.ReLU(), core.nn.Linear(8, 1))
    opt = core.optim.SGD(m.parameters(), lr=0.1)
    with P.profile(profile_memory=True, with_stack=True) as prof:
        m(core.randn(4, 8)).sum().backward()
        opt.step()
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    doc = json.loads(path.read_text())
    _check_trace_format(doc)
    names = {e["name"] for e in doc["traceEvents"]}
    assert {"linear", "relu", "Optimizer.step#SGD.step", "[memory]", "Memory"} <= names
    stacks = [e["args"].get("Call stack", "") for e in doc["traceEvents"] if e["ph"] == "X"]
    assert any("test_profiler.py" in s for s in stacks)


_TORCH_NAME = re.compile(r"^(?P<worker>.+)\.(?P<ns>\d+)\.pt\.trace\.json(?P<gz>\.gz)?$")


def _torch_handlers_file_name(directory, **kwargs) -> str:
    """The file torch's own tensorboard_trace_handler names for one window."""
    import torch.profiler

    made = []

    class _Exported:  # all torch's handler asks of a profile
        def export_chrome_trace(self, path, use_python_export=False):
            made.append(path)

    torch.profiler.tensorboard_trace_handler(directory, **kwargs)(_Exported())
    return os.path.basename(made[0])


def test_trace_handler_names_one_file_per_window_as_torchs_does(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "3")
    theirs = _TORCH_NAME.match(_torch_handlers_file_name(str(tmp_path / "torch")))
    x = core.ones(2)
    before = time.time_ns()
    with P.profile(schedule=P.schedule(wait=1, warmup=0, active=2, repeat=2),
                   on_trace_ready=P.tensorboard_trace_handler(str(tmp_path / "tb"))) as prof:
        for _ in range(7):
            _ = x * 2
            prof.step()
    after = time.time_ns()
    files = sorted(os.listdir(tmp_path / "tb"), key=lambda n: int(_TORCH_NAME.match(n)["ns"]))
    assert len(files) == 2
    for name in files:
        ours = _TORCH_NAME.match(name)
        # torch's worker name (<hostname>_<pid>) and a nanosecond timestamp of the window's end
        assert ours and ours["worker"] == theirs["worker"] and not ours["gz"], name
        assert before <= int(ours["ns"]) <= after
    docs = [json.loads((tmp_path / "tb" / f).read_text()) for f in files]
    assert [d["shoal"]["window"] for d in docs] == [[1, 2], [4, 5]]
    # Kineto's pids and tids: the OS's, with the rank in the process's name
    assert docs[0]["shoal"]["rank"] == 3
    assert {e["pid"] for e in docs[0]["traceEvents"]} == {os.getpid()}
    assert {e["tid"] for e in docs[0]["traceEvents"] if e["ph"] == "X"} == {
        threading.get_native_id()}
    names = {e["name"]: e["args"] for e in docs[0]["traceEvents"] if e["ph"] == "M"}
    assert names["process_name"] == {"name": "rank 3"}
    assert names["thread_name"]["name"].startswith(f"thread {threading.get_native_id()} (")
    assert docs[0]["distributedInfo"]["rank"] == 3
    steps = sorted(e["name"] for e in docs[0]["traceEvents"]
                   if e["name"].startswith("ProfilerStep"))
    assert steps == ["ProfilerStep#1", "ProfilerStep#2"]


def test_trace_handler_gzips_and_takes_a_worker_name_as_torchs_does(tmp_path) -> None:
    theirs = _TORCH_NAME.match(_torch_handlers_file_name(str(tmp_path / "torch"),
                                                         worker_name="trainer7", use_gzip=True))
    with P.profile(on_trace_ready=P.tensorboard_trace_handler(
            str(tmp_path / "tb"), worker_name="trainer7", use_gzip=True)):
        _ = core.ones(2) + 1
    (name,) = os.listdir(tmp_path / "tb")
    ours = _TORCH_NAME.match(name)
    assert ours and (ours["worker"], ours["gz"]) == (theirs["worker"], theirs["gz"]) == (
        "trainer7", ".gz")
    with gzip.open(tmp_path / "tb" / name, "rt") as f:
        doc = json.load(f)
    assert "add" in {e["name"] for e in doc["traceEvents"]}


def test_two_profilers_at_once_are_refused() -> None:
    with P.profile():
        with pytest.raises(P.ProfilerError, match="another profiler is already recording"):
            with P.profile():
                pass
    assert np.all(core.ones(2).array == 1)
    assert list(itertools.islice(iter(()), 1)) == []
