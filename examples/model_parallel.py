"""Model parallel training with distributed autograd (PyTorch 1.4's headline feature).

    shoal run --nproc-per-node 2 examples/model_parallel.py --steps 20 --out /tmp/mp

A two-stage model is split across two workers: "worker0" runs stage 1 (Linear 8->16, tanh)
and trains; "worker1" owns stage 2 (Linear 16->4) behind an RRef. Each step runs the forward
over RPC inside a `dist_autograd.context()`, one `dist_autograd.backward` through both
workers, and a `DistributedOptimizer` step that updates each stage where it lives. Everything
is float64, so the parameters after N steps equal `train_single_process(N)` (the same model in
one process, with local autograd) to 1e-10. With --out, each worker saves the parameters it
owns to DIR/rank<R>.npz.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import threading
import time

import numpy as np

import shoal.metrics as sm
from shoal import core
from shoal import rpc_agent as rpc
from shoal.core import nn
from shoal.core.nn import functional as F
from shoal.rpc_agent import dist_autograd
from shoal.rpc_agent.optim import DistributedOptimizer

D_IN, D_HIDDEN, D_OUT, BATCH, LR = 8, 16, 4, 12, 0.1


def init_parameters(module: nn.Module, seed: int) -> nn.Module:
    """Deterministic float64 values, the same in every process."""
    rng = np.random.default_rng(seed)
    for _, p in sorted(module.named_parameters()):
        p.array = rng.standard_normal(p.shape) * 0.3
    return module


class Stage1(nn.Module):
    """Linear 8 -> 16, tanh: runs on the trainer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D_IN, D_HIDDEN, dtype=core.float64)
        init_parameters(self, 1)

    def forward(self, x):
        return self.fc(x).tanh()


class Stage2(nn.Module):
    """Linear 16 -> 4: lives on worker1, called through its RRef."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D_HIDDEN, D_OUT, dtype=core.float64)
        init_parameters(self, 2)

    def forward(self, x):
        return self.fc(x)

    def parameter_rrefs(self) -> list:
        """RRefs to this stage's parameters, for the DistributedOptimizer."""
        return [rpc.RRef(p) for p in self.parameters()]

    def state(self) -> dict:
        """The parameters' values by name."""
        return {f"stage2.{k}": p.array.copy() for k, p in self.named_parameters()}


class ModelParallel:
    """Stage 1 here, stage 2 on `worker` (created there by remote())."""

    def __init__(self, worker: str) -> None:
        self.stage1 = Stage1()
        self.stage2 = rpc.remote(worker, Stage2)

    def __call__(self, x):
        return self.stage2.rpc_sync().forward(self.stage1(x))

    def parameter_rrefs(self) -> list:
        return [rpc.RRef(p) for p in self.stage1.parameters()] + \
            self.stage2.rpc_sync().parameter_rrefs()


def batch(step: int) -> tuple:
    """The step's inputs and targets (the same in every process)."""
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((BATCH, D_IN))
    y = np.sin(x[:, :D_OUT]) + 0.1 * rng.standard_normal((BATCH, D_OUT))
    return core.Tensor(x), core.Tensor(y)


def train(steps: int, out_dir: str | None) -> None:
    """The trainer's loop (worker0)."""
    model = ModelParallel("worker1")
    opt = DistributedOptimizer(core.optim.SGD, model.parameter_rrefs(), lr=LR)
    for step in range(steps):
        x, y = batch(step)
        # Step time, samples and loss of the trainer (shoal.metrics), for the dashboard.
        with sm.step(step + 1, samples=len(x)) as record, dist_autograd.context() as cid:
            loss = F.mse_loss(model(x), y)
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
            record.loss = float(loss.item())
        print(f"step {step} loss {loss.item():.6f}", flush=True)
    params = {f"stage1.{k}": p.array for k, p in model.stage1.named_parameters()}
    params.update(model.stage2.rpc_sync().state())
    _report(params, out_dir)
    # Every context ended here when its `with` block closed, and ends on worker1 soon after.
    print(f"live dist_autograd contexts: worker0 {dist_autograd.live_context_count()}, "
          f"worker1 {rpc.rpc_sync('worker1', settled_context_count)}", flush=True)


def _report(params: dict, out_dir: str | None) -> None:
    digest = hashlib.sha256()
    for name in sorted(params):
        digest.update(np.ascontiguousarray(params[name]).tobytes())
    print(f"final params_sha256 {digest.hexdigest()}", flush=True)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        np.savez(os.path.join(out_dir, f"rank{os.environ.get('RANK', '0')}.npz"), **params)


def settled_context_count(timeout: float = 10.0) -> int:
    """This worker's live distributed autograd contexts once the releases in flight have
    landed (a context ends on the other workers asynchronously, as in torch)."""
    deadline = time.monotonic() + timeout
    while dist_autograd.live_context_count() and time.monotonic() < deadline:
        time.sleep(0.01)
    return dist_autograd.live_context_count()


class TrainersDone:
    """On a server: counts trainers that finished (they call `trainer_done` over RPC), so the
    server can check its own live contexts once nobody trains any more."""

    _count = 0
    _lock = threading.Lock()
    _all_done = threading.Event()
    expected = 0

    @classmethod
    def trainer_done(cls) -> None:
        """Called by each trainer after its last step."""
        with cls._lock:
            cls._count += 1
            if cls._count == cls.expected:
                cls._all_done.set()

    @classmethod
    def wait_and_report(cls, name: str, timeout: float = 120.0) -> None:
        """Wait for every trainer, then print this worker's live distributed contexts."""
        if not cls._all_done.wait(timeout):
            raise TimeoutError(f"{name}: only {cls._count} of {cls.expected} trainers finished.")
        print(f"live dist_autograd contexts: {name} {settled_context_count()}", flush=True)


def train_single_process(steps: int) -> dict:
    """The same model and steps in one process with local autograd: the reference."""
    stage1, stage2 = Stage1(), Stage2()
    params = list(stage1.parameters()) + list(stage2.parameters())
    opt = core.optim.SGD(params, lr=LR)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(stage2(stage1(x)), y).backward()
        opt.step()
    out = {f"stage1.{k}": p.array for k, p in stage1.named_parameters()}
    out.update(stage2.state())
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None, help="directory for the final parameters")
    args = parser.parse_args(argv)
    rank = int(os.environ["RANK"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    if rank == 0:
        train(args.steps, args.out)
    rpc.shutdown()


if __name__ == "__main__":
    main()
