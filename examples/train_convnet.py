"""Train a small convnet on scikit-learn's bundled 8x8 digits with DDP and SyncBatchNorm.

    shoal run --nproc-per-node 2 examples/train_convnet.py      # needs the `models` extra
    python examples/train_convnet.py --epochs 2                 # no launcher: a group of one

1797 handwritten digits ship inside scikit-learn (no download); a fixed fifth is held out.
Each epoch every rank trains on its own shard of a shuffled order (core.data's DataLoader with
collectives' DistributedSampler), batch statistics are shared through SyncBatchNorm,
and rank 0 prints the training loss and the held-out accuracy (ranks evaluate half each).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import shoal.metrics as sm
from shoal import collectives, core
from shoal.collectives import DistributedDataParallel, DistributedSampler
from shoal.core import nn
from shoal.core.data import DataLoader, TensorDataset
from shoal.core.nn import functional as F


class ConvNet(nn.Module):
    """Three 3x3 conv blocks (conv, batch norm, ReLU), a max pool, global average pool, linear."""

    def __init__(self, classes: int = 10, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(2 * width, classes)

    def forward(self, x: core.Tensor) -> core.Tensor:
        """Logits (N, classes) for images (N, 1, 8, 8)."""
        return self.classifier(self.features(x))


def load_digits(held_out: float = 0.2, seed: int = 0) -> tuple:
    """(train x, train y, held-out x, held-out y): images scaled to [0, 1], shape (N, 1, 8, 8)."""
    try:
        from sklearn.datasets import load_digits as sk_digits  # noqa: PLC0415 - optional extra
    except ImportError as exc:
        raise SystemExit(
            "train_convnet needs scikit-learn for its bundled digits: pip install 'shoal[models]'"
        ) from exc
    digits = sk_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(len(x) * (1.0 - held_out))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", "--batch_size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 2 or args.width < 1:
        parser.error("--epochs and --width must be at least 1, --batch-size at least 2")
    return args


def init_distributed():
    """The process group: from the torchrun environment `shoal run` sets, else a group of one."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return collectives.init_process_group("tcp", init_method="env://")
    return collectives.init_process_group(
        "tcp", init_method="tcp://127.0.0.1:0", rank=0, world_size=1
    )


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray, group) -> float:
    """Held-out accuracy; each rank scores its share and the counts are summed."""
    rank, world = group.rank(), group.size()
    counts = np.zeros(2, dtype=np.float64)
    model.eval()
    with core.no_grad():
        mine = np.arange(rank, len(x), world)
        pred = model(core.tensor(x[mine])).numpy().argmax(axis=1)
        counts += ((pred == y[mine]).sum(), len(mine))
    model.train()
    group.all_reduce(counts)
    return counts[0] / counts[1]


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    core.retain_freed_memory()  # reuse freed activations instead of page-faulting anew
    xtr, ytr, xte, yte = load_digits(seed=args.seed)
    group = init_distributed()
    rank, world = group.rank(), group.size()
    train_set = TensorDataset(xtr, ytr)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    core.manual_seed(args.seed)
    model = collectives.SyncBatchNorm.convert_sync_batchnorm(ConvNet(width=args.width))
    net = DistributedDataParallel(model, process_group=group)
    opt = core.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)
    steps_per_epoch = len(loader)
    sched = core.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                               steps_per_epoch=steps_per_epoch)
    if rank == 0:
        print(f"ConvNet: {sum(p.numel() for p in model.parameters())} parameters; "
              f"{len(xtr)} training and {len(xte)} held-out digits; {world} rank(s) x batch "
              f"{args.batch_size}", flush=True)
    acc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = 0.0
        for i, (x, y) in enumerate(loader):
            # Step time, samples and loss per rank (shoal.metrics), for the dashboard.
            with sm.step(epoch * steps_per_epoch + i + 1, samples=len(y)) as record:
                loss = F.cross_entropy(net(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                record.loss = float(loss.item())
            total += record.loss
        acc = accuracy(model, xte, yte, group)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} | train loss {total / steps_per_epoch:.4f} | "
                  f"held-out accuracy {acc:.4f}", flush=True)
    if rank == 0:
        print(f"final held-out accuracy {acc:.4f} after {args.epochs} epochs in "
              f"{time.perf_counter() - started:.0f} s", flush=True)
    collectives.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
