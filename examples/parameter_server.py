"""A parameter server with several trainers, batching their updates with @async_execution
(the shape of PyTorch's RPC parameter-server tutorials).

    shoal run --nproc-per-node 3 examples/parameter_server.py --steps 10 --out /tmp/ps

Rank 0 ("ps") owns the model; every other rank is a trainer. A trainer runs the model's
forward on the server over RPC inside a `dist_autograd.context()`, computes its loss and runs
`dist_autograd.backward`, which leaves the model's gradients in the server's copy of that
context. It then calls `ParameterServer.update`, an @async_execution function: the server
adds the context's gradients to the round's sum and answers with a Future, completed for all
trainers at once when the last one has reported and the averaged step is applied. No trainer
starts its next forward before the round's step, so in float64 the parameters equal
`train_single_process(N, trainers)` to 1e-10.
"""

from __future__ import annotations

import argparse
import os
import threading

import numpy as np

import shoal.metrics as sm
from shoal import core
from shoal import rpc_agent as rpc
from shoal.core import nn
from shoal.core.nn import functional as F
from shoal.examples.model_parallel import _report, init_parameters
from shoal.rpc_agent import dist_autograd
from shoal.examples.model_parallel import TrainersDone
from shoal.rpc_agent.functions import async_execution

D_IN, D_HIDDEN, D_OUT, BATCH, LR = 6, 12, 3, 8, 0.1
PS = "ps"


class Net(nn.Module):
    """6 -> 12 -> 3 with tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, D_HIDDEN, dtype=core.float64)
        self.fc2 = nn.Linear(D_HIDDEN, D_OUT, dtype=core.float64)
        init_parameters(self, 5)

    def forward(self, x):
        return self.fc2(self.fc1(x).tanh())


class ParameterServer:
    """Holds the model; applies one averaged SGD step per round of all trainers' gradients."""

    def __init__(self, num_trainers: int) -> None:
        self.model = Net()
        self.params = list(self.model.parameters())
        self.optimizer = core.optim.SGD(self.params, lr=LR)
        self.num_trainers = num_trainers
        self._lock = threading.Lock()
        self._sums: list = [None] * len(self.params)
        self._waiting: list = []

    def forward(self, x):
        """Runs in the calling trainer's distributed autograd context."""
        return self.model(x)

    @staticmethod
    @async_execution
    def update(ps_rref: rpc.RRef, context_id: int) -> rpc.Future:
        """Add this trainer's gradients; the answer comes once the round's step is applied."""
        self = ps_rref.local_value()
        grads = dist_autograd.get_gradients(context_id)
        done: rpc.Future = rpc.Future("a parameter server round")
        with self._lock:
            for i, p in enumerate(self.params):
                g = grads[p].array
                self._sums[i] = g.copy() if self._sums[i] is None else self._sums[i] + g
            self._waiting.append(done)
            if len(self._waiting) < self.num_trainers:
                return done
            for p, total in zip(self.params, self._sums):
                p.grad = core.Tensor(total / self.num_trainers)
            self.optimizer.step()
            waiting, self._waiting, self._sums = self._waiting, [], [None] * len(self.params)
        for fut in waiting:
            fut.set_result(None)
        return done


_SERVER: dict = {}


def server_rref() -> rpc.RRef:
    """Called on the server: an RRef to it."""
    return rpc.RRef(_SERVER["ps"])


def batch(step: int, trainer: int) -> tuple:
    rng = np.random.default_rng(3000 + 31 * step + trainer)
    x = rng.standard_normal((BATCH, D_IN))
    y = np.cos(x[:, :D_OUT])
    return core.Tensor(x), core.Tensor(y)


def train(rank: int, steps: int) -> None:
    ps = rpc.rpc_sync(PS, server_rref)
    for step in range(steps):
        x, y = batch(step, rank)
        # Step time, samples and loss per trainer (shoal.metrics), for the dashboard.
        with sm.step(step + 1, samples=len(x)) as record, dist_autograd.context() as cid:
            loss = F.mse_loss(ps.rpc_sync().forward(x), y)
            dist_autograd.backward(cid, [loss])
            rpc.rpc_sync(PS, ParameterServer.update, (ps, cid))
            record.loss = float(loss.item())
        print(f"trainer {rank} step {step} loss {loss.item():.6f}", flush=True)


def train_single_process(steps: int, trainers: int) -> dict:
    """The same rounds in one process: each round averages every trainer's gradients."""
    model = Net()
    params = list(model.parameters())
    opt = core.optim.SGD(params, lr=LR)
    for step in range(steps):
        sums = [np.zeros_like(p.array) for p in params]
        for trainer in range(1, trainers + 1):
            x, y = batch(step, trainer)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            for s, p in zip(sums, params):
                s += p.grad.array
        for s, p in zip(sums, params):
            p.grad = core.Tensor(s / trainers)
        opt.step()
    return {k: p.array for k, p in model.named_parameters()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None, help="directory for the final parameters")
    args = parser.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world < 2:
        raise SystemExit("parameter_server.py needs at least 2 processes (1 server, trainers).")
    if rank == 0:
        _SERVER["ps"] = ParameterServer(world - 1)
        TrainersDone.expected = world - 1
    rpc.init_rpc(PS if rank == 0 else f"trainer{rank}", rank=rank, world_size=world)
    if rank != 0:
        train(rank, args.steps)
        print(f"live dist_autograd contexts: trainer{rank} "
              f"{dist_autograd.live_context_count()}", flush=True)
        rpc.rpc_sync(PS, TrainersDone.trainer_done)
    else:
        TrainersDone.wait_and_report(PS)
    rpc.shutdown()
    if rank == 0:
        _report({k: p.array for k, p in _SERVER["ps"].model.named_parameters()}, args.out)


if __name__ == "__main__":
    main()
