"""The distributed autograd examples under a real `shoal run`: each one's parameters after N
steps equal the same model trained in one process (float64, 1e-10), and every worker ends
with no live distributed autograd context. torch is the oracle for examples 1 and 2: the same
models (bench/dist_autograd_torch.py's twins, started from the same values) trained with
torch.distributed.autograd, torch's DistributedOptimizer and TensorPipe (and DDP over gloo for
example 2) end with the parameters shoal's run saved."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

from shoal.examples import ddp_rpc, model_parallel, parameter_server
from tests.support.shoal_run import ROOT, ShoalRun

RUN_S = 100.0
MODEL_PARALLEL_STEPS, DDP_RPC_STEPS = 6, 4
TORCH_S = 100.0


def _run(script: str, nproc: int, steps: int, out_dir) -> str:
    args = ["--nproc-per-node", str(nproc), str(ROOT / "examples" / script),
            "--steps", str(steps), "--out", str(out_dir)]
    with ShoalRun(args, name=f"shoal run {script}") as run:
        code = run.wait(RUN_S)
        output = run.output
    assert code == 0, f"{script} exited with {code}:\n{output[-4000:]}"
    return output


def _saved(out_dir) -> dict:
    params: dict = {}
    for path in sorted(out_dir.glob("rank*.npz")):
        params.update(dict(np.load(path)))
    return params


def _assert_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-10, err_msg=name)


def _live_counts(output: str) -> list[str]:
    return [line.split("live dist_autograd contexts: ", 1)[1]
            for line in output.splitlines() if "live dist_autograd contexts: " in line]


@pytest.fixture(scope="module")
def model_parallel_run(tmp_path_factory):
    """Example 1 under `shoal run`: (the parameters it saved, its output)."""
    out = tmp_path_factory.mktemp("model_parallel")
    output = _run("model_parallel.py", 2, MODEL_PARALLEL_STEPS, out)
    return _saved(out), output


@pytest.fixture(scope="module")
def ddp_rpc_run(tmp_path_factory):
    """Example 2 under `shoal run`: (the parameters it saved, its output)."""
    out = tmp_path_factory.mktemp("ddp_rpc")
    output = _run("ddp_rpc.py", 3, DDP_RPC_STEPS, out)
    return _saved(out), output


def test_model_parallel_equals_one_process(model_parallel_run):
    params, output = model_parallel_run
    _assert_equal(params, model_parallel.train_single_process(MODEL_PARALLEL_STEPS))
    assert _live_counts(output) == ["worker0 0, worker1 0"]


def test_ddp_with_rpc_equals_one_process(ddp_rpc_run):
    params, output = ddp_rpc_run
    _assert_equal(params, ddp_rpc.train_single_process(DDP_RPC_STEPS))
    # Both trainers' DDP replicas ended identical (one digest each, equal).
    digests = {line.split()[-1] for line in output.splitlines()
               if "final params_sha256" in line and "[rank 2]" not in line}
    assert len(digests) == 1, output[-3000:]
    assert sorted(_live_counts(output)) == ["ps 0", "trainer0 0", "trainer1 0"]


def test_parameter_server_equals_one_process(tmp_path):
    output = _run("parameter_server.py", 3, 4, tmp_path)
    _assert_equal(_saved(tmp_path), parameter_server.train_single_process(4, 2))
    assert sorted(_live_counts(output)) == ["ps 0", "trainer1 0", "trainer2 0"]


# ----------------------------------------------------------------------------- torch oracle

def _numpy(named) -> dict:
    return {name: t.detach().numpy().copy() for name, t in named}


def _torch_model_parallel(rank: int, steps: int, twins) -> dict:
    """Example 1 in torch (bench/dist_autograd_torch.py's loop, returning the parameters)."""
    import torch
    import torch.distributed.autograd as tdist_autograd
    import torch.distributed.rpc as trpc
    from torch.distributed.optim import DistributedOptimizer

    if rank != 0:
        return {}
    ex1 = model_parallel
    stage1 = twins.Stage1()
    stage2 = trpc.remote("w1", twins.Stage2)
    rrefs = [trpc.RRef(p) for p in stage1.parameters()] + stage2.rpc_sync().parameter_rrefs()
    opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=ex1.LR)
    for step in range(steps):
        x, y = (twins._t(a) for a in ex1.batch(step))
        with tdist_autograd.context() as cid:
            loss = torch.nn.functional.mse_loss(stage2.rpc_sync().forward(stage1(x)), y)
            tdist_autograd.backward(cid, [loss])
            opt.step(cid)
    params = _numpy((f"stage1.{k}", p) for k, p in stage1.named_parameters())
    params.update(_numpy((f"stage2.{k}", t) for k, t in stage2.rpc_sync().state_dict().items()))
    return params


def _torch_ddp_rpc(rank: int, steps: int, twins) -> dict:
    """Example 2 in torch: trainers 0 and 1 run DDP over gloo, rank 2 owns the embedding."""
    import torch
    import torch.distributed as tdist
    import torch.distributed.autograd as tdist_autograd
    import torch.distributed.rpc as trpc
    from torch.distributed.optim import DistributedOptimizer

    ex2 = ddp_rpc
    if rank == 2:
        return {}  # the table is read after shutdown (every trainer's step has landed)
    table = trpc.rpc_sync("w2", twins.table_rref)
    model = torch.nn.parallel.DistributedDataParallel(twins.Dense())
    rrefs = table.rpc_sync().parameter_rrefs() + [trpc.RRef(p) for p in model.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=ex2.LR)
    for step in range(steps):
        indices, targets = (twins._t(a) for a in ex2.batch(step, rank))
        with tdist_autograd.context() as cid:
            loss = torch.nn.functional.mse_loss(model(table.rpc_sync().forward(indices)),
                                                targets)
            tdist_autograd.backward(cid, [loss])
            # One trainer's step at a time. torch's DistributedOptimizer steps the table's owner
            # through its TorchScript local optimizer, which takes no lock, so two trainers'
            # concurrent in-place updates of the same rows can race. One CI run of 2026-11-28
            # ended with torch's table up to 0.0036 off while shoal's run equalled the
            # one-process reference (24 reruns under load did not show it again). shoal's
            # optimizer serialises the steps, and SGD's two updates commute to the last bit
            # or so, so the order does not matter.
            for turn in range(2):
                if rank == turn:
                    opt.step(cid)
                tdist.barrier()  # the last one, as the example: the next lookups follow both
    return _numpy((f"dense.{k}", p) for k, p in model.module.named_parameters())


def _torch_worker(job: str, rank: int, world: int, steps: int, init_dir: str, results) -> None:
    import os

    os.environ.update(TP_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    try:
        import torch
        import torch.distributed as tdist
        import torch.distributed.rpc as trpc

        from bench import dist_autograd_torch as twins

        torch.set_num_threads(1)
        if job == "ddp_rpc" and rank != 2:
            tdist.init_process_group("gloo", init_method=f"file://{init_dir}/gloo", rank=rank,
                                     world_size=2)
        if job == "ddp_rpc" and rank == 2:
            twins._TABLE["table"] = twins.EmbeddingTable()
        opts = trpc.TensorPipeRpcBackendOptions(
            init_method=f"file://{init_dir}/rpc", rpc_timeout=60,
            _transports=["uv"], _channels=["basic"],
        )
        trpc.init_rpc(f"w{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
        if job == "model_parallel":
            params = _torch_model_parallel(rank, steps, twins)
        else:
            params = _torch_ddp_rpc(rank, steps, twins)
        trpc.shutdown()
        if job == "ddp_rpc":
            if rank == 2:
                params = _numpy((f"table.{k}", p)
                                for k, p in twins._TABLE["table"].named_parameters())
            else:
                tdist.destroy_process_group()
        results.put((rank, "ok", params))
    except BaseException as exc:  # noqa: BLE001  (sent to the test)
        import traceback

        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _torch_job(job: str, world: int, steps: int, init_dir) -> dict:
    """Run `job` on `world` spawned torch workers; the parameters they return, merged."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_torch_worker,
                         args=(job, r, world, steps, str(init_dir), results), daemon=True)
             for r in range(world)]
    for proc in procs:
        proc.start()
    params: dict = {}
    try:
        for _ in range(world):
            rank, status, value = results.get(timeout=TORCH_S)
            assert status == "ok", f"torch {job} rank {rank} failed: {value}"
            params.update(value)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return params


def test_torch_trains_example_1_to_the_same_parameters(model_parallel_run, tmp_path):
    pytest.importorskip("torch")
    params, _ = model_parallel_run
    _assert_equal(params, _torch_job("model_parallel", 2, MODEL_PARALLEL_STEPS, tmp_path))


def test_torch_trains_example_2_to_the_same_parameters(ddp_rpc_run, tmp_path):
    pytest.importorskip("torch")
    params, _ = ddp_rpc_run
    _assert_equal(params, _torch_job("ddp_rpc", 3, DDP_RPC_STEPS, tmp_path))
