"""ProfilerActivity.CUDA: ops and backward nodes on cupy arrays get GPU times from CUDA events
(GPU machines)."""

from __future__ import annotations

import json

from shoal import core
from shoal.core import profiler as P


def test_ops_on_the_gpu_get_cuda_times_and_kernel_events(tmp_path):
    a = core.randn(512, 512, device="cuda")
    with P.profile(activities=[P.ProfilerActivity.CPU, P.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            b = a @ a
        _ = b.sum()
    avg = {r.key: r for r in prof.key_averages()}
    assert avg["matmul"].count == 3 and avg["matmul"].cuda_time_total > 0
    assert avg["sum"].cuda_time_total > 0
    table = prof.key_averages().table(sort_by="cuda_time_total")
    assert "CUDA total" in table and table.splitlines()[3].startswith("matmul")
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    doc = json.loads(path.read_text())
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    assert [k["name"] for k in kernels].count("matmul") == 3
    # Kineto's GPU lanes: pid = device, tid = stream, named; each kernel's correlation id
    # links it to a cudaLaunchKernel on the launching op's thread and to an ac2g flow
    device = a.array.device.id
    assert {(k["pid"], k["args"]["device"]) for k in kernels} == {(device, device)}
    assert all(k["tid"] == k["args"]["stream"] for k in kernels)
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
             if e.get("name") == "thread_name"}
    assert all(lanes[(k["pid"], k["tid"])] == f"stream {k['tid']}" for k in kernels)
    launches = {e["args"]["correlation"]: e for e in doc["traceEvents"]
                if e.get("cat") == "cuda_runtime"}
    for k in kernels:
        launch = launches[k["args"]["correlation"]]
        assert launch["args"]["External id"] == k["args"]["External id"]
    flows = [e for e in doc["traceEvents"] if e.get("cat") == "ac2g"]
    assert len(flows) == 2 * len(kernels)
    assert doc["deviceProperties"][device]["totalGlobalMem"] > 0


def test_backward_nodes_on_the_gpu_get_cuda_times_and_kernel_events(tmp_path):
    a = core.randn(512, 512, device="cuda", requires_grad=True)
    with P.profile(activities=[P.ProfilerActivity.CPU, P.ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            (a @ a).sum().backward()
    evs = [fe.ev for fe in prof.events()]
    backward = [e for e in evs if e.cat == "backward"]
    matmul_bwd = [e for e in backward if e.name == "MmBackward"]
    assert len(matmul_bwd) == 2 and all(e.cuda > 0 for e in matmul_bwd), backward
    # each backward node still links to its forward op
    flows = {e.flow for e in evs if e.name == "matmul"}
    assert {e.flow for e in matmul_bwd} == flows
    kernels = [e.name for e in evs if e.cat == "kernel"]
    assert kernels.count("MmBackward") == 2 and kernels.count("matmul") == 2
    avg = {r.key: r for r in prof.key_averages()}
    assert avg["MmBackward"].cuda_time_total > 0 and avg["SumBackward"].count == 2
