"""A DDP training loop with no profiler code: `shoal run --profile DIR` makes it write traces.

--sleep-rank R makes rank R compute 50 ms more per step (matmuls outside the model, whose
gradients need no all_reduce): the straggler a trace summary and TensorBoard's Distributed view
must name."""

import argparse
import sys
import time

import numpy as np

import shoal.collectives as dist
from shoal import core
from shoal.core import nn


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sleep-rank", type=int, default=-1)
    args = parser.parse_args()
    dist.init_process_group("tcp", init_method="env://")
    rank = dist.get_rank()
    core.manual_seed(0)
    model = dist.DistributedDataParallel(
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    opt = core.optim.SGD(model.parameters(), lr=0.01)
    rng = np.random.default_rng(rank)
    extra = core.ones(128, 128)
    for _ in range(args.steps):
        x = core.tensor(rng.standard_normal((16, 32)).astype(np.float32))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if rank == args.sleep_rank:
            busy_until = time.perf_counter() + 0.05
            while time.perf_counter() < busy_until:
                core.matmul(extra, extra)
        opt.step()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
