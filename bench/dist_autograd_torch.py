"""The torch peers of bench/dist_autograd.py: examples 1 and 2 and the empty-context step
with torch.distributed.autograd, torch.distributed.optim and TensorPipe over TCP. Imported only
by the torch workers (module level, so that torch's RPC pickles these classes by name)."""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as tdist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as trpc
from torch.distributed.optim import DistributedOptimizer

from shoal.examples import ddp_rpc as ex2
from shoal.examples import model_parallel as ex1


def _copy_from(module: torch.nn.Module, shoal_module) -> torch.nn.Module:
    """The same initial values as shoal's module (parameters matched by name)."""
    values = {k: p.array for k, p in shoal_module.named_parameters()}
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.from_numpy(np.asarray(values[name])))
    return module


class Stage1(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(ex1.D_IN, ex1.D_HIDDEN).double()
        _copy_from(self, ex1.Stage1())

    def forward(self, x):
        return self.fc(x).tanh()


class Stage2(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(ex1.D_HIDDEN, ex1.D_OUT).double()
        _copy_from(self, ex1.Stage2())

    def forward(self, x):
        return self.fc(x)

    def parameter_rrefs(self) -> list:
        return [trpc.RRef(p) for p in self.parameters()]


class EmbeddingTable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(ex2.NUM_EMBEDDINGS, ex2.D_EMB).double()
        _copy_from(self, ex2.EmbeddingTable())

    def forward(self, indices):
        return self.embedding(indices)

    def parameter_rrefs(self) -> list:
        return [trpc.RRef(p) for p in self.parameters()]


class Dense(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(ex2.D_EMB, ex2.D_OUT).double()
        _copy_from(self, ex2.Dense())

    def forward(self, x):
        return self.fc(x).tanh()


_TABLE: dict = {}


def table_rref():
    return trpc.RRef(_TABLE["table"])


def _t(tensor) -> torch.Tensor:
    return torch.from_numpy(np.asarray(tensor.array))


def init(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    opts = trpc.TensorPipeRpcBackendOptions(
        init_method="env://", _transports=["uv"], _channels=["basic"], rpc_timeout=120,
    )
    trpc.init_rpc(f"w{rank}", rank=rank, world_size=world, rpc_backend_options=opts)


def model_parallel(rank: int, steps: int) -> list:
    """Example 1's step on worker 0: forward over RPC, backward, optimizer step."""
    init(rank, 2)
    times = []
    if rank == 0:
        stage1 = Stage1()
        stage2 = trpc.remote("w1", Stage2)
        rrefs = [trpc.RRef(p) for p in stage1.parameters()] + \
            stage2.rpc_sync().parameter_rrefs()
        opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=ex1.LR)
        for step in range(steps):
            x, y = (_t(a) for a in ex1.batch(step))
            start = time.perf_counter()
            with dist_autograd.context() as cid:
                loss = torch.nn.functional.mse_loss(stage2.rpc_sync().forward(stage1(x)), y)
                dist_autograd.backward(cid, [loss])
                opt.step(cid)
            times.append(time.perf_counter() - start)
    trpc.shutdown()
    return times


def ddp_rpc(rank: int, steps: int, store_addr: tuple) -> list:
    """Example 2's step on trainer 0 (ranks 0, 1 train with DDP on gloo; rank 2 serves)."""
    times = []
    if rank == 2:
        _TABLE["table"] = EmbeddingTable()
    else:
        store = tdist.TCPStore(store_addr[0], store_addr[1], is_master=False)
        tdist.init_process_group("gloo", store=tdist.PrefixStore("ddp", store), rank=rank,
                                 world_size=2)
    init(rank, 3)
    if rank != 2:
        table = trpc.rpc_sync("w2", table_rref)
        model = torch.nn.parallel.DistributedDataParallel(Dense())
        rrefs = table.rpc_sync().parameter_rrefs() + [trpc.RRef(p) for p in model.parameters()]
        opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=ex2.LR)
        for step in range(steps):
            indices, targets = ex2.batch(step, rank)
            indices, targets = _t(indices), _t(targets)
            start = time.perf_counter()
            with dist_autograd.context() as cid:
                out = model(table.rpc_sync().forward(indices))
                loss = torch.nn.functional.mse_loss(out, targets)
                dist_autograd.backward(cid, [loss])
                opt.step(cid)
            tdist.barrier()
            times.append(time.perf_counter() - start)
    trpc.shutdown()
    if rank != 2:
        tdist.destroy_process_group()
    return times if rank == 0 else []


def empty_context(steps: int, model: str) -> tuple:
    """(local step times, step times inside a context with no remote call) on one worker."""
    init(0, 1)
    if model == "example1":
        net = torch.nn.Sequential(Stage1(), Stage2())
        x, y = (_t(a) for a in ex1.batch(0))
    else:
        net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(),
                                  torch.nn.Linear(512, 512), torch.nn.Tanh(),
                                  torch.nn.Linear(512, 10)).double()
        rng = np.random.default_rng(0)
        x = torch.from_numpy(rng.standard_normal((64, 256)))
        y = torch.from_numpy(rng.standard_normal((64, 10)))
    local, ctx = [], []
    for _ in range(0, steps, 50):  # blocks, as bench/dist_autograd.py says why
        for _ in range(50):
            start = time.perf_counter()
            net.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(net(x), y).backward()
            local.append(time.perf_counter() - start)
        net.zero_grad(set_to_none=True)
        for _ in range(50):
            start = time.perf_counter()
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [torch.nn.functional.mse_loss(net(x), y)])
            ctx.append(time.perf_counter() - start)
    trpc.shutdown()
    return local, ctx
