"""Differentially private SGD under DDP: per-sample gradients with core.func.vmap, each clipped
to a norm bound, summed, noised, then averaged across ranks by DDP.

DP-SGD (Abadi et al., 2016) bounds each example's influence on a step: every per-sample gradient
is clipped to L2 norm `--max-grad-norm`, and Gaussian noise of standard deviation
`--noise-multiplier * --max-grad-norm` is added to their sum. The per-sample gradients come from
`vmap(grad(loss))` over the local batch, one batched computation rather than a loop. Each rank
adds its share of the noise (variance divided by the world size, so the global sum carries the
full noise once) and hands its noised sum to DDP through a surrogate loss whose gradient is that
sum: DDP's buckets then all-reduce it as they do any gradient.

    shoal run --nproc-per-node 2 examples/dp_sgd.py --steps 30

Prints, from rank 0, one line per step (loss, accuracy on its batch, the fraction of samples
that were clipped), the check of the first step's per-sample gradients against a loop over the
samples, and from every rank a digest of its parameters at the end (equal on every rank).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys

import numpy as np

from shoal import collectives, core
from shoal.collectives import DistributedDataParallel
from shoal.core import func, nn
import shoal.core.nn.functional as F


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", "--batch_size", type=int, default=32,
                        help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--max-grad-norm", "--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--noise-multiplier", "--noise_multiplier", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


class Classifier(nn.Module):
    """A small MLP; called with `grads=` it returns the surrogate loss sum(p * g), whose gradient
    with respect to each parameter p is g: how the noised gradient enters DDP's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 3))

    def forward(self, x=None, grads=None):
        if grads is None:
            return self.net(x)
        total = None
        for name, p in self.named_parameters():
            term = (p * grads[name]).sum()
            total = term if total is None else total + term
        return total


def batch(rng: np.random.Generator, n: int):
    """A 3-class problem in 16 dimensions: the class is the largest of the first three inputs."""
    x = rng.standard_normal((n, 16)).astype(np.float32)
    return core.tensor(x), core.tensor(x[:, :3].argmax(axis=1).astype(np.int64))


def per_sample_gradients(module: nn.Module, x, y) -> dict:
    """{name: (batch, *shape)}: each sample's gradient of its own loss, in one vmap."""
    params = {k: v.detach() for k, v in module.named_parameters()}

    def loss(p, xi, yi):
        return F.cross_entropy(func.functional_call(module, p, (xi[None],)), yi[None])

    return func.vmap(func.grad(loss), in_dims=(None, 0, 0))(params, x, y)


def clip_and_noise(grads: dict, max_norm: float, noise_std: float, rng, batch_size: int):
    """The clipped per-sample gradients summed, plus this rank's noise, per sample of the
    batch; and the fraction of samples whose gradient was clipped."""
    n = next(iter(grads.values())).shape[0]
    squares = sum((g.reshape(n, -1) ** 2).sum(1) for g in grads.values())
    norms = core.sqrt(squares)
    factor = core.clamp(max_norm / (norms + 1e-6), max=1.0)
    out = {}
    for name, g in grads.items():
        clipped = (g * factor.reshape(n, *([1] * (g.ndim - 1)))).sum(0)
        noise = core.tensor(rng.standard_normal(tuple(clipped.shape)).astype(np.float32))
        out[name] = (clipped + noise * noise_std) / batch_size
    clipped_fraction = float((norms > max_norm).float().mean().item())
    return out, clipped_fraction


def loop_check(module: nn.Module, x, y, grads: dict) -> float:
    """The largest difference between vmap's per-sample gradients and a loop over samples."""
    worst = 0.0
    for i in range(x.shape[0]):
        module.zero_grad()
        F.cross_entropy(module(x[i:i + 1]), y[i:i + 1]).backward()
        for name, p in module.named_parameters():
            worst = max(worst, float(np.abs(p.grad.numpy() - grads[name].numpy()[i]).max()))
    module.zero_grad()
    return worst


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
    rank, world = collectives.get_rank(), collectives.get_world_size()
    core.manual_seed(args.seed + rank)  # different inits: DDP's broadcast makes them equal
    model = DistributedDataParallel(Classifier())
    inner = model.module
    opt = core.optim.SGD(model.parameters(), lr=args.lr)
    data_rng = np.random.default_rng(1000 * args.seed + rank)  # each rank its own data
    noise_rng = np.random.default_rng(7919 * (args.seed + 1) + rank)
    # Each rank's noise has variance sigma^2 / world: the all-reduced sum has sigma^2 once.
    noise_std = args.noise_multiplier * args.max_grad_norm / math.sqrt(world)

    for step in range(args.steps):
        x, y = batch(data_rng, args.batch_size)
        grads = per_sample_gradients(inner, x, y)
        if step == 0 and rank == 0:
            print(f"per-sample check: max |vmap - loop| = {loop_check(inner, x, y, grads):.2e}",
                  flush=True)
        noised, clipped = clip_and_noise(grads, args.max_grad_norm, noise_std, noise_rng,
                                         args.batch_size)
        opt.zero_grad()
        model(grads=noised).backward()  # DDP averages the noised sums over the ranks
        opt.step()
        if rank == 0:
            with core.no_grad():
                logits = inner(x)
                loss = F.cross_entropy(logits, y).item()
                acc = float((logits.argmax(1) == y).float().mean().item())
            print(f"step {step + 1} loss {loss:.4f} acc {acc:.2f} clipped {clipped:.2f}",
                  flush=True)
    print(f"rank {rank} params {digest(inner)}", flush=True)
    collectives.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
