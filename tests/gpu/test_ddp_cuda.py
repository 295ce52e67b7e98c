"""DistributedDataParallel on a CUDA model over the nccl backend equals DDP on the CPU over the
tcp backend, to float32 tolerance: at world size 1 in this process (several buckets, plain, with
gradient_as_bucket_view, and with the fp16 compression hook), and at world size 2 in spawned
processes against one process training on the whole batch where the machine has two GPUs."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.collectives.store.hash import HashStore

cp = pytest.importorskip("cupy")
STEPS = 4
RTOL, ATOL = 2e-5, 2e-6  # float32 on two devices: kernels may sum in different orders


def _device_count() -> int:
    try:
        return cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001
        return 0


def make_model(seed=0):
    from shoal import core
    from shoal.core import nn

    core.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 5))


def batch(step, rank, device):
    from shoal.core.tensor import Tensor

    rng = np.random.default_rng([step, rank])
    x = Tensor(rng.standard_normal((8, 12)).astype(np.float32))
    y = Tensor(rng.standard_normal((8, 5)).astype(np.float32))
    return (x.cuda(), y.cuda()) if device == "cuda" else (x, y)


def mse(out, y, scale=1.0):
    diff = out - y
    return (diff * diff).mean() * scale


def train(group, device, hook=None, steps=STEPS, rank=0, **ddp_kw):
    from shoal import core
    from shoal.collectives.ddp import comm_hooks
    from shoal.collectives.ddp.ddp import DistributedDataParallel

    model = make_model(seed=rank)  # DDP broadcasts rank 0's parameters at construction
    if device == "cuda":
        model = model.cuda()
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.002, **ddp_kw)
    if hook:
        ddp.register_comm_hook(group, getattr(comm_hooks, hook))
    opt = core.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step, rank, device)
        mse(ddp(x), y).backward()
        opt.step()
    assert len(ddp.bucket_indices) > 1  # several buckets, so several collectives per step
    return [cp.asnumpy(p.array) if device == "cuda" else np.array(p.array) for p in model.parameters()]


@pytest.mark.parametrize("variant", [{}, {"gradient_as_bucket_view": True},
                                     {"hook": "fp16_compress_hook"}],
                         ids=["plain", "bucket_view", "fp16_hook"])
def test_ddp_on_cuda_equals_ddp_on_cpu_at_world_one(variant):
    from shoal.collectives.backends.nccl.group import ProcessGroupNCCL
    from shoal.collectives.backends.tcp.group import ProcessGroupTCP

    cpu_group = ProcessGroupTCP(HashStore(), 0, 1, timeout=30)
    gpu_group = ProcessGroupNCCL(HashStore(), 0, 1, timeout=30, device=0)
    try:
        cpu = train(cpu_group, "cpu", **variant)
        gpu = train(gpu_group, "cuda", **variant)
    finally:
        cpu_group.shutdown()
        gpu_group.shutdown()
    tol = (2e-3, 2e-4) if "hook" in variant else (RTOL, ATOL)
    for i, (a, b) in enumerate(zip(cpu, gpu)):
        np.testing.assert_allclose(b, a, rtol=tol[0], atol=tol[1], err_msg=f"parameter {i}")


def _rank(rank, world, port):
    from shoal.collectives.backends.nccl.group import ProcessGroupNCCL
    from shoal.collectives.store.tcp import TCPStore

    store = TCPStore("127.0.0.1", port, is_master=False, timeout=30)
    group = ProcessGroupNCCL(store, rank, world, timeout=60, device=rank)
    try:
        with cp.cuda.Device(rank):
            return train(group, "cuda", rank=rank)
    finally:
        group.shutdown()
        store.close()


@pytest.mark.skipif(_device_count() < 2, reason="needs two GPUs (NCCL wants one device per rank)")
def test_ddp_on_two_gpus_equals_one_process_on_the_whole_batch():
    from shoal import core
    from test_nccl import run_ranks

    finals = run_ranks(_rank, 2)
    model = make_model()
    opt = core.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        for r in range(2):
            x, y = batch(step, r, "cpu")
            mse(model(x), y, 0.5).backward()
        opt.step()
    for final in finals:
        for i, (p, q) in enumerate(zip(model.parameters(), final)):
            np.testing.assert_allclose(q, np.array(p.array), rtol=RTOL, atol=ATOL,
                                       err_msg=f"parameter {i}")
