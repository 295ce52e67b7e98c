"""ProfilerActivity.CUDA: ops on cupy arrays get GPU times from CUDA events (GPU machines)."""

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
    lanes = [e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"]
    assert "cuda stream" in lanes
