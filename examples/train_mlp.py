"""Train an MLP on generated data (three interleaved spirals) to >= 95% held-out accuracy.

No downloads: the data set is drawn from a seeded generator. The spirals are not linearly
separable, so the hidden layers have to earn the accuracy. Exits non-zero below the target.

    python examples/train_mlp.py --epochs 40 --seed 0
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

import shoal.metrics as sm
from shoal import core
from shoal.core import nn
from shoal.core import optim
from shoal.core.nn import functional as F
from shoal.core.optim.lr_scheduler import CosineAnnealingLR

TARGET_ACCURACY = 0.95


def make_spirals(n_per_class: int, classes: int, rng: np.random.Generator):
    """Points on `classes` interleaved spiral arms with a little noise; returns (x, y)."""
    t = rng.uniform(0.0, 1.0, size=(classes, n_per_class))
    radius = 0.1 + 0.9 * t
    angle = 3.5 * math.pi * t + (2 * math.pi / classes) * np.arange(classes)[:, None]
    angle += rng.normal(0.0, 0.12, size=angle.shape)
    x = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=-1).reshape(-1, 2)
    y = np.repeat(np.arange(classes), n_per_class)
    return x.astype(np.float32), y.astype(np.int64)


def build_model(hidden: int, classes: int) -> nn.Module:
    """2 -> hidden -> hidden -> classes with ReLU."""
    return nn.Sequential(
        nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, classes),
    )


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    """Fraction of rows whose arg-max logit is the label."""
    model.eval()
    with core.no_grad():
        logits = model(core.tensor(x)).array
    model.train()
    return float((logits.argmax(axis=1) == y).mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", "--batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--samples", type=int, default=1000, help="points per class")
    args = parser.parse_args(argv)

    core.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    classes = 3
    x, y = make_spirals(args.samples, classes, rng)
    order = rng.permutation(len(y))
    split = int(0.8 * len(y))
    train_idx, test_idx = order[:split], order[split:]
    x_train, y_train, x_test, y_test = x[train_idx], y[train_idx], x[test_idx], y[test_idx]

    model = build_model(args.hidden, classes)
    opt = optim.Adam(model.parameters(), lr=args.lr)
    sched = CosineAnnealingLR(opt, T_max=args.epochs, eta_min=args.lr * 0.05)
    print(f"spirals: {len(y_train)} train / {len(y_test)} held-out points, {classes} classes; "
          f"model {model}")
    start = time.perf_counter()
    step = 1
    for epoch in range(1, args.epochs + 1):
        perm = rng.permutation(len(y_train))
        total, batches = 0.0, 0
        for i in range(0, len(perm), args.batch_size):
            batch = perm[i : i + args.batch_size]
            # Step time, samples and loss (shoal.metrics: rank 0 here), for the dashboard.
            with sm.step(step, samples=len(batch)) as record:
                loss = F.cross_entropy(model(core.tensor(x_train[batch])),
                                       core.tensor(y_train[batch]))
                opt.zero_grad()
                loss.backward()
                opt.step()
                record.loss = loss.item()
            total += record.loss
            batches += 1
            step += 1
        sched.step()
        if epoch == 1 or epoch % 5 == 0 or epoch == args.epochs:
            print(f"epoch {epoch:3d}  loss {total / batches:.4f}  "
                  f"held-out accuracy {accuracy(model, x_test, y_test):.4f}  "
                  f"lr {sched.get_last_lr()[0]:.5f}")
    final = accuracy(model, x_test, y_test)
    elapsed = time.perf_counter() - start
    print(f"final held-out accuracy: {final * 100:.2f}% (target {TARGET_ACCURACY * 100:.0f}%) "
          f"in {elapsed:.1f}s")
    if final < TARGET_ACCURACY:
        print(f"FAILED: held-out accuracy {final:.4f} is below {TARGET_ACCURACY}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
