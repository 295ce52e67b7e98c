"""DistributedDataParallel combined with distributed autograd (PyTorch 1.6's DDP + RPC).

    shoal run --nproc-per-node 3 examples/ddp_rpc.py --steps 10 --out /tmp/ddp_rpc

Ranks 0 and 1 are trainers, rank 2 ("ps") is a parameter server that owns an nn.Embedding
behind an RRef. Each trainer looks up its batch's embeddings over RPC and runs a dense layer
wrapped in DistributedDataParallel (a process group of the two trainers). One
`dist_autograd.backward` per trainer drives both: DDP all-reduces the dense gradients (which
live in the context, as in torch), and the embedding's gradients reach the parameter server.
A DistributedOptimizer then steps the embedding where it lives and the dense layer on each
trainer. A trainer barrier after each step keeps the next lookups after both updates, so the
run is deterministic: in float64 its parameters equal `train_single_process(N)` to 1e-10.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import shoal.collectives as dist
import shoal.metrics as sm
from shoal import core
from shoal import rpc_agent as rpc
from shoal.core import nn
from shoal.core.nn import functional as F
from shoal.examples.model_parallel import _report, init_parameters
from shoal.rpc_agent import dist_autograd
from shoal.examples.model_parallel import TrainersDone
from shoal.rpc_agent.optim import DistributedOptimizer

NUM_EMBEDDINGS, D_EMB, D_OUT, BATCH, LR = 20, 8, 4, 6, 0.05
TRAINERS = (0, 1)
PS = "ps"


class EmbeddingTable(nn.Module):
    """The parameter server's embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(NUM_EMBEDDINGS, D_EMB, dtype=core.float64)
        init_parameters(self, 3)

    def forward(self, indices):
        return self.embedding(indices)

    def parameter_rrefs(self) -> list:
        return [rpc.RRef(p) for p in self.parameters()]


class Dense(nn.Module):
    """The trainers' replicated layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D_EMB, D_OUT, dtype=core.float64)
        init_parameters(self, 4)

    def forward(self, x):
        return self.fc(x).tanh()


_TABLE: dict = {}


def table_rref() -> rpc.RRef:
    """Called on the parameter server: an RRef to its embedding table."""
    return rpc.RRef(_TABLE["table"])


def batch(step: int, trainer: int) -> tuple:
    rng = np.random.default_rng(2000 + 97 * step + trainer)
    indices = rng.integers(0, NUM_EMBEDDINGS, size=BATCH)
    targets = rng.standard_normal((BATCH, D_OUT)) * 0.5
    return core.Tensor(indices), core.Tensor(targets)


def train(rank: int, steps: int, trainers, out_dir: str | None) -> None:
    table = rpc.rpc_sync(PS, table_rref)
    model = dist.DistributedDataParallel(Dense(), process_group=trainers)
    rrefs = table.rpc_sync().parameter_rrefs() + [rpc.RRef(p) for p in model.parameters()]
    opt = DistributedOptimizer(core.optim.SGD, rrefs, lr=LR)
    for step in range(steps):
        indices, targets = batch(step, rank)
        # Step time, samples and loss per trainer (shoal.metrics), for the dashboard.
        with sm.step(step + 1, samples=len(indices)) as record, \
                dist_autograd.context() as cid:
            loss = F.mse_loss(model(table.rpc_sync().forward(indices)), targets)
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
            record.loss = float(loss.item())
        dist.barrier(group=trainers)
        print(f"trainer {rank} step {step} loss {loss.item():.6f}", flush=True)
    _report({f"dense.{k}": p.array for k, p in model.module.named_parameters()}, out_dir)


def train_single_process(steps: int) -> dict:
    """The same steps in one process: dense gradients averaged over the trainers (DDP), the
    embedding stepped once per trainer (the parameter server gets each trainer's step)."""
    table, dense = EmbeddingTable(), Dense()
    dense_opt = core.optim.SGD(dense.parameters(), lr=LR)
    table_opt = core.optim.SGD(table.parameters(), lr=LR)
    for step in range(steps):
        dense_grads, table_grads = [], []
        for trainer in TRAINERS:
            indices, targets = batch(step, trainer)
            dense_opt.zero_grad()
            table_opt.zero_grad()
            F.mse_loss(dense(table(indices)), targets).backward()
            dense_grads.append([p.grad.array.copy() for p in dense.parameters()])
            table_grads.append([p.grad.array.copy() for p in table.parameters()])
        for i, p in enumerate(dense.parameters()):
            p.grad = core.Tensor(sum(g[i] for g in dense_grads) / len(TRAINERS))
        dense_opt.step()
        for grads in table_grads:
            for p, g in zip(table.parameters(), grads):
                p.grad = core.Tensor(g)
            table_opt.step()
    out = {f"dense.{k}": p.array for k, p in dense.named_parameters()}
    out.update({f"table.{k}": p.array for k, p in table.named_parameters()})
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None, help="directory for the final parameters")
    args = parser.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 3:
        raise SystemExit(f"ddp_rpc.py runs as 3 processes (2 trainers, 1 server), not {world}.")
    dist.init_process_group("tcp", init_method="env://")
    trainers = dist.new_group(list(TRAINERS))
    if rank == 2:
        _TABLE["table"] = EmbeddingTable()
        TrainersDone.expected = len(TRAINERS)
    rpc.init_rpc(PS if rank == 2 else f"trainer{rank}", rank=rank, world_size=world)
    if rank in TRAINERS:
        train(rank, args.steps, trainers, args.out)
        print(f"live dist_autograd contexts: trainer{rank} "
              f"{dist_autograd.live_context_count()}", flush=True)
        rpc.rpc_sync(PS, TrainersDone.trainer_done)
    else:
        TrainersDone.wait_and_report(PS)
    rpc.shutdown()
    if rank == 2:
        _report({f"table.{k}": p.array for k, p in _TABLE["table"].named_parameters()},
                args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
