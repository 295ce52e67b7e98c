"""Gradient accumulation with mixed precision under DDP: the pattern people train with.

Each optimizer step accumulates `--micro-batches` micro-batches. All but the last run under
DDP's `no_sync()`, so gradients are all-reduced once per step, not once per micro-batch.
Forward passes run under `core.autocast("cpu")` (bfloat16 matmuls, float32 weights and loss),
and a `core.amp.GradScaler` scales the loss, unscales before clipping, and skips the step when
a gradient overflowed. `collectives.amp.agree_on_found_inf` makes that skip collective, so every
rank skips the same steps and the replicas stay equal.

    shoal run --nproc-per-node 2 examples/accumulate_amp.py --steps 20 --micro-batches 4

Prints one line per step from rank 0 (loss, scale, whether the step was skipped) and, from every
rank, a digest of its parameters at the end (equal on every rank).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys

import numpy as np

import shoal.metrics as sm
from shoal import core
from shoal import collectives
from shoal.collectives import DistributedDataParallel
from shoal.collectives.amp import agree_on_found_inf
from shoal.core import nn
from shoal.core.amp import GradScaler


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batches", "--micro_batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", "--micro_batch_size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overflow-at", "--overflow_at", type=int, default=None,
                        help="poison rank 0's gradients with NaN at this step (to show a "
                             "skipped step on every rank)")
    return parser.parse_args(argv)


def batch(rng: np.random.Generator, n: int):
    """A separable 3-class problem in 16 dimensions (the same on every run for a seed)."""
    x = rng.standard_normal((n, 16)).astype(np.float32)
    y = (x[:, :3].argmax(axis=1)).astype(np.int64)
    return core.tensor(x), core.tensor(y)


def digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for _, p in module.named_parameters():
        h.update(np.ascontiguousarray(p.detach().numpy()).tobytes())
    return h.hexdigest()[:16]


def main(argv=None) -> int:
    args = parse_args(argv)
    if "WORLD_SIZE" in os.environ:
        collectives.init_process_group("tcp", init_method="env://")
    else:
        collectives.init_process_group("tcp", init_method="tcp://127.0.0.1:0", rank=0,
                                       world_size=1)
    rank = collectives.get_rank()
    core.manual_seed(args.seed)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 3)))
    opt = core.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scaler = agree_on_found_inf(GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=5))
    loss_fn = nn.CrossEntropyLoss()
    rng = np.random.default_rng(1000 * args.seed + rank)  # each rank its own data

    for step in range(args.steps):
        # Step time, samples and loss per rank (shoal.metrics), for the dashboard.
        samples = args.micro_batches * args.micro_batch_size
        with sm.step(step + 1, samples=samples) as record:
            opt.zero_grad()
            total = 0.0
            for micro in range(args.micro_batches):
                x, y = batch(rng, args.micro_batch_size)
                last = micro == args.micro_batches - 1
                # no_sync: accumulate locally; the last micro-batch's backward all-reduces the sum.
                with (model.no_sync() if not last else contextlib.nullcontext()):
                    with core.autocast("cpu"):
                        loss = loss_fn(model(x), y) / args.micro_batches
                    scaler.scale(loss).backward()
                total += float(loss.item())
            if step == args.overflow_at and rank == 0:
                with core.no_grad():  # an overflow only this rank sees, after the all-reduce
                    next(model.parameters()).grad.array[0, 0] = np.nan
            scaler.unscale_(opt)  # true gradients, so clipping sees their real norm
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scale = scaler.get_scale()
            scaler.step(opt)  # skipped on every rank if any rank found inf/NaN
            scaler.update()
            record.loss = total
        skipped = scaler.get_scale() < scale
        if rank == 0:
            print(f"step {step + 1} loss {total:.4f} scale {scale:g}"
                  + (" skipped (inf/NaN on some rank)" if skipped else ""), flush=True)
    print(f"rank {rank} params {digest(model.module)}", flush=True)
    collectives.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
