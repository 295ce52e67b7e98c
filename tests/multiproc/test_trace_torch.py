"""`shoal trace summary` and `merge` on torch's own traces: a two-rank torch DDP job on gloo,
profiled with torch.profiler and written by torch's tensorboard_trace_handler, rank 1 computing
30 ms more per step. Skipped where torch is not installed (the test extra has it)."""

from __future__ import annotations

import json

import pytest

from shoal.launcher.trace import cli
from shoal.launcher.trace.summary import summarize
from tests.support.perfetto_rules import import_errors
from tests.support.ranks import run_ranks


def _torch_rank(rank: int, world: int, store: str, out: str) -> int:
    import time

    import torch
    import torch.distributed as td
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    td.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    extra = torch.ones(128, 128)
    with torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                out, worker_name=f"rank{rank}")) as prof:
        for _ in range(5):
            loss = model(torch.randn(16, 32)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if rank == 1:
                busy_until = time.perf_counter() + 0.03
                while time.perf_counter() < busy_until:
                    torch.mm(extra, extra)
            opt.step()
            prof.step()
    td.destroy_process_group()
    return rank


@pytest.fixture(scope="module")
def torch_traces(tmp_path_factory):
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("torch-traces")
    store = tmp_path_factory.mktemp("store") / "file"
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "KINETO_LOG_LEVEL": "5"}
    assert run_ranks(_torch_rank, 2, args=(str(store), str(out)), timeout=120, env=env) == [0, 1]
    return out


def test_summary_reads_torchs_communication_and_names_the_slow_rank(torch_traces, capsys):
    rows, call = summarize(str(torch_traces))
    assert {(r.rank, r.step) for r in rows} == {(k, s) for k in (0, 1) for s in (2, 3, 4)}
    for r in rows:
        assert r.comm > 0, r  # the gloo:all_reduce events on gloo's threads
    # rank 0 waits for rank 1's extra 30 ms in its all_reduce (matched across ranks by order),
    # on average over the steps: a loaded machine moves part of a wait into the next step
    assert sum(r.waiting for r in rows if r.rank == 0) / 3 >= 15, rows
    assert call is not None and call.straggler == 1
    assert cli.main(["summary", str(torch_traces)]) == 0
    assert "straggler: rank 1 " in capsys.readouterr().out


def test_merge_of_torchs_traces_imports_cleanly(torch_traces, tmp_path):
    out = tmp_path / "job.json"
    assert cli.main(["merge", str(torch_traces), "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    names = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    assert {"rank 0", "rank 1"} <= names
    assert import_errors(doc) == []
