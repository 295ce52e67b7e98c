"""The exported trace in Kineto's conventions, checked against torch.profiler's own export of the
same kind of step, and against the rules Perfetto's importer enforces."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

from shoal import core
from shoal.collectives import profiler_clock
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.store.hash import HashStore
from shoal.core import nn
from shoal.core import profiler as P
from shoal.core.profiler import cuda
from shoal.core.profiler.chrome import trace_dict
from shoal.core.profiler.events import Event, Recorder
from tests.support.perfetto_rules import import_errors, overlapping_slices, flow_errors

MEMORY_ARGS = {"Total Reserved", "Total Allocated", "Bytes", "Device Id", "Device Type", "Addr"}


def _shoal_trace(tmp_path) -> dict:
    core.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = core.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with P.profile(schedule=P.schedule(wait=0, warmup=0, active=2, repeat=1),
                   profile_memory=True, record_shapes=True) as prof:
        for _ in range(2):
            with P.record_function("forward"):
                loss = model(core.randn(4, 8)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            prof.step()
    path = tmp_path / "shoal.pt.trace.json"
    prof.export_chrome_trace(str(path))
    return json.loads(path.read_text())


def _torch_trace(tmp_path) -> dict:
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with torch.profiler.profile(schedule=torch.profiler.schedule(wait=0, warmup=0, active=2,
                                                                  repeat=1),
                                profile_memory=True, record_shapes=True) as prof:
        for _ in range(2):
            loss = model(torch.randn(4, 8)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            prof.step()
    path = tmp_path / "torch.pt.trace.json"
    prof.export_chrome_trace(str(path))
    return json.loads(path.read_text())


def _inside(inner: dict, outer: dict) -> bool:
    return (outer["ts"] <= inner["ts"]
            and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"])


def test_a_training_step_exports_as_torch_exports_it(tmp_path) -> None:
    ours, theirs = _shoal_trace(tmp_path), _torch_trace(tmp_path)
    evs = ours["traceEvents"]
    xs = [e for e in evs if e["ph"] == "X"]
    # the document's own keys torch's plugin reads are all there
    for key in ("schemaVersion", "deviceProperties", "baseTimeNanoseconds", "displayTimeUnit",
                "traceEvents"):
        assert key in theirs and key in ours, key
    assert ours["distributedInfo"]["world_size"] == 1  # torch's has one with a process group
    # one ProfilerStep#N user annotation per step, as torch's
    def steps(doc):
        return sorted((e["cat"], e["name"].split("#")[0]) for e in doc["traceEvents"]
                      if e["ph"] == "X" and e["name"].startswith("ProfilerStep#"))
    assert steps(ours) == steps(theirs) == [("user_annotation", "ProfilerStep")] * 2
    # ops and backward nodes are cpu_ops; each node sits inside its evaluate_function, as torch's
    assert {e["cat"] for e in xs} <= {"cpu_op", "user_annotation"}
    outer = [e for e in xs if e["name"].startswith("autograd::engine::evaluate_function: ")]
    assert outer and all(e["cat"] == "cpu_op" for e in outer)
    for e in outer:
        node = e["name"].split(": ", 1)[1]
        assert any(i["name"] == node and i["tid"] == e["tid"] and _inside(i, e) for i in xs)
    assert any(e["name"].startswith("autograd::engine::evaluate_function: ")
               for e in theirs["traceEvents"] if e.get("cat") == "cpu_op")
    # the optimizer's work is an op inside torch's Optimizer.step annotation
    (step,) = [e for e in xs if e["name"] == "Optimizer.step#SGD.step"][:1]
    assert step["cat"] == "user_annotation"
    assert any(e["name"] == "_fused_sgd_" and e["cat"] == "cpu_op" and _inside(e, step)
               for e in xs)
    # forward -> backward flows pair up, in torch's category
    assert {e["cat"] for e in evs if e["ph"] in ("s", "f")} == {"fwdbwd"}
    # [memory] instants with torch's arguments, Total Allocated the running sum of Bytes
    mem = [e for e in evs if e["name"] == "[memory]"]
    torch_mem = [e for e in theirs["traceEvents"] if e["name"] == "[memory]"]
    assert mem and torch_mem
    assert MEMORY_ARGS <= set(torch_mem[0]["args"]) and MEMORY_ARGS <= set(mem[0]["args"])
    assert {(e["ph"], e["cat"], e["s"]) for e in mem} == {
        (e["ph"], e["cat"], e["s"]) for e in torch_mem}
    total = 0
    for e in mem:
        total += e["args"]["Bytes"]
        assert e["args"]["Total Allocated"] == total
        assert (e["args"]["Device Type"], e["args"]["Device Id"]) == (0, -1)  # the CPU
    # the OS's pid and thread id, and thread names in Kineto's shape
    assert {e["pid"] for e in xs} == {os.getpid()}
    assert {e["tid"] for e in xs} == {threading.get_native_id()}
    meta = {(e["name"], e["tid"]): e["args"] for e in evs if e["ph"] == "M"}
    assert meta[("thread_name", threading.get_native_id())]["name"] == (
        f"thread {threading.get_native_id()} (MainThread)")
    assert import_errors(ours) == []


def test_times_are_whole_nanoseconds_from_the_base_as_perfetto_reads_them(tmp_path) -> None:
    rec = Recorder()
    ident = threading.get_ident()
    # a parent and a child that ends on its parent's last nanosecond
    rec.add(Event("outer", "cpu_op", 1_000_000_007, 999_999, ident))
    rec.add(Event("inner", "cpu_op", 1_000_500_003, 500_003, ident))
    doc = trace_dict(rec)
    base = doc["baseTimeNanoseconds"]
    assert base % 1_000_000_000 == 0
    xs = {e["name"]: e for e in doc["traceEvents"] if e["ph"] == "X"}
    from shoal.core.profiler.events import EPOCH_OFFSET_NS
    for name, (start, dur) in {"outer": (1_000_000_007, 999_999),
                               "inner": (1_000_500_003, 500_003)}.items():
        # Perfetto's int(ts * 1000): exactly the recorded nanosecond
        assert int(xs[name]["ts"] * 1000) == start + EPOCH_OFFSET_NS - base
        assert int(xs[name]["dur"] * 1000) == dur
    assert overlapping_slices(doc["traceEvents"]) == []


def test_collectives_carry_torchs_collective_arguments_and_shoals(tmp_path) -> None:
    pg = ProcessGroupTCP(HashStore(), 0, 1, timeout=10)
    profiler_clock.lend_store(pg)
    try:
        with P.profile() as prof:
            pg.all_reduce(np.ones((3, 4), np.float32))
        doc = trace_dict(prof.events().recorder)
    finally:
        profiler_clock.take_back_store(pg)
        pg.shutdown()
    (coll,) = [e for e in doc["traceEvents"] if e["name"].startswith("gloo:")]
    assert coll["name"] == "gloo:all_reduce" and coll["cat"] == "user_annotation"
    args = coll["args"]
    assert {k: args[k] for k in ("Collective name", "In msg nelems", "Out msg nelems",
                                 "Group size", "dtype", "In split size", "Out split size",
                                 "Process Group Name", "Process Group Description",
                                 "Process Group Ranks", "Input Dims", "Input type")} == {
        "Collective name": "allreduce", "In msg nelems": 12, "Out msg nelems": 12,
        "Group size": 1, "dtype": "Float", "In split size": "[]", "Out split size": "[]",
        "Process Group Name": "default", "Process Group Description": "default_pg",
        "Process Group Ranks": "[0]", "Input Dims": [[3, 4]], "Input type": ["float"]}
    # shoal's own arguments stay beside torch's
    assert args["seq"] == 1 and args["bytes"] == 48 and args["backend"] == "tcp"
    assert args["call"] == "all_reduce(float32[3, 4], op=SUM)"
    assert isinstance(args["External id"], int)
    assert doc["distributedInfo"] == {
        "backend": "tcp", "rank": 0, "world_size": 1, "pg_count": 1,
        "pg_config": [{"pg_name": "default", "pg_desc": "default_pg",
                       "backend_config": "cpu:tcp,cuda:tcp", "pg_size": 1, "ranks": [0]}]}


def test_ddp_buckets_are_async_ranges_that_may_overlap() -> None:
    rec = Recorder()
    ident = threading.get_ident()
    rec.add(Event("backward", "cpu_op", 1000, 10_000, ident))
    # two buckets in flight at once, overlapping each other and the backward
    rec.add(Event("DDP bucket 0 all_reduce", "ddp", 2000, 6000, ident, {"bucket": 0}))
    rec.add(Event("DDP bucket 1 all_reduce", "ddp", 5000, 8000, ident, {"bucket": 1}))
    doc = trace_dict(rec)
    evs = doc["traceEvents"]
    buckets = [e for e in evs if e.get("cat") == "ddp"]
    assert sorted(e["ph"] for e in buckets) == ["b", "b", "e", "e"]
    assert len({e["id"] for e in buckets}) == 2
    assert import_errors(doc) == []
    # the same ranges as complete events on the thread are what Perfetto drops
    as_complete = [{"ph": "X", "name": e["name"], "pid": e["pid"], "tid": e["tid"], "ts": e["ts"],
                    "dur": 6.0 if "0" in e["name"] else 8.0} for e in buckets if e["ph"] == "b"]
    assert overlapping_slices([e for e in evs if e["ph"] == "X"] + as_complete)


def test_gpu_kernels_name_their_device_stream_and_launch() -> None:
    # No GPU here: the kernel event is built as resolve_window builds it from CUDA events.
    rec = Recorder(cuda=True)
    ident = threading.get_ident()
    op = Event("matmul", "cpu_op", 10_000, 5_000, ident)
    rec.add(op)
    streams: dict = {}
    rec.add(cuda.kernel_event(rec, op, 12_000, 3_000, 1, cuda.stream_id(streams, 1, 0xBEEF)))
    assert cuda.stream_id(streams, 1, 0) == 0  # the legacy default stream
    doc = trace_dict(rec)
    evs = doc["traceEvents"]
    (kernel,) = [e for e in evs if e.get("cat") == "kernel"]
    (launch,) = [e for e in evs if e.get("cat") == "cuda_runtime"]
    (cpu,) = [e for e in evs if e.get("name") == "matmul" and e.get("cat") == "cpu_op"]
    assert (kernel["pid"], kernel["tid"]) == (1, 1)  # Kineto's lane: pid = device, tid = stream
    assert kernel["args"]["device"] == 1 and kernel["args"]["stream"] == 1
    corr = kernel["args"]["correlation"]
    assert launch["args"]["correlation"] == corr and launch["name"] == "cudaLaunchKernel"
    # the launch sits inside its op on the op's thread; all three share the External id
    assert launch["tid"] == cpu["tid"] and _inside(launch, cpu)
    assert (kernel["args"]["External id"] == launch["args"]["External id"]
            == cpu["args"]["External id"])
    flows = {e["ph"]: e for e in evs if e.get("cat") == "ac2g"}
    assert flows["s"]["id"] == flows["f"]["id"] == corr
    assert (flows["f"]["pid"], flows["f"]["tid"]) == (1, 1)
    labels = {e["pid"]: e["args"]["labels"] for e in evs if e["name"] == "process_labels"}
    assert labels == {os.getpid(): "CPU", 1: "GPU 1"}
    assert import_errors(doc) == []


def test_the_perfetto_rules_catch_what_perfetto_rejects() -> None:
    crossing = [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0.0, "dur": 10.0},
                {"ph": "X", "name": "b", "pid": 1, "tid": 1, "ts": 5.0, "dur": 10.0}]
    assert overlapping_slices(crossing)
    stray = [{"ph": "s", "id": 1, "cat": "c", "pid": 1, "tid": 1, "ts": 50.0}]
    assert any("flow_no_enclosing_slice" in e for e in flow_errors(crossing + stray))
