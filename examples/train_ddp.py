"""Train a small MLP with DistributedDataParallel on generated data, checkpointing as it goes.

    shoal run --nproc-per-node 2 examples/train_ddp.py --steps 50 --checkpoint-every 10
    python examples/train_ddp.py --steps 20            # no launcher: a group of one

The data is a dataset of --dataset-size samples drawn from the seed, read through a DataLoader
(--data-workers worker processes) with a DistributedSampler: every epoch each sample goes to
one rank, in an order drawn from (seed, epoch). The loader's position travels in the
checkpoint, so a run that is killed and resumed from its latest checkpoint ends with exactly
the parameters of one that never stopped, and a run resumed at another world size reads the
rest of the epoch, each sample once. The last line, `final step S params_sha256 HEX`, lets
tests compare runs; --log-samples prints each rank's sample indices per step. Rank 0 saves a
checkpoint every --checkpoint-every steps into SHOAL_CHECKPOINT_DIR (or --checkpoint-dir);
every rank loads the latest one when it starts.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import numpy as np

import shoal.metrics as sm
from shoal import collectives, core
from shoal.collectives import DistributedDataParallel
from shoal.collectives.data import DistributedSampler
from shoal.core import nn
from shoal.core import settings as core_settings
from shoal.core.data import DataLoader, Dataset
from shoal.elastic.checkpoint import Checkpointer

D_IN, D_HIDDEN, D_OUT = 16, 64, 4


class MLP(nn.Module):
    """16 -> 64 -> 64 -> 4 with tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, D_HIDDEN)
        self.fc2 = nn.Linear(D_HIDDEN, D_HIDDEN)
        self.fc3 = nn.Linear(D_HIDDEN, D_OUT)

    def forward(self, x):
        return self.fc3(self.fc2(self.fc1(x).tanh()).tanh())


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="total optimizer steps")
    parser.add_argument("--checkpoint-every", "--checkpoint_every", type=int, default=10,
                        help="save a checkpoint every N steps (0: never)")
    parser.add_argument("--checkpoint-dir", "--checkpoint_dir", default=None,
                        help="where checkpoints go (default: $SHOAL_CHECKPOINT_DIR; none: off)")
    parser.add_argument("--backend", default="tcp",
                        help="process-group backend: tcp (default, CPU arrays) or nccl (each "
                             "rank's model and batches on GPU LOCAL_RANK)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", "--batch_size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--step-sleep", "--step_sleep", type=float, default=0.0,
                        help="seconds to sleep after each step (lets fault tests kill mid-run)")
    parser.add_argument("--dataset-size", "--dataset_size", type=int, default=1024,
                        help="samples in the generated dataset (one epoch)")
    parser.add_argument("--data-workers", "--data_workers", type=int, default=0,
                        help="DataLoader worker processes per rank (0: load in the rank)")
    parser.add_argument("--log-samples", "--log_samples", action="store_true",
                        help="print each rank's sample indices after every step")
    args = parser.parse_args(argv)
    if args.data_workers < 0:
        parser.error("--data-workers must not be negative")
    for name in ("steps", "batch_size", "dataset_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.checkpoint_every < 0 or args.step_sleep < 0:
        parser.error("--checkpoint-every and --step-sleep must not be negative")
    return args


def teacher(seed: int):
    """The fixed function the model learns: a random two-layer map drawn from the seed."""
    rng = np.random.default_rng([seed, 0xC0FFEE])
    w1 = rng.standard_normal((D_IN, 32)).astype(np.float32) / np.sqrt(D_IN)
    w2 = rng.standard_normal((32, D_OUT)).astype(np.float32) / np.sqrt(32)
    return lambda x: np.tanh(x @ w1) @ w2


class TeacherDataset(Dataset):
    """`size` samples (index, x, teacher(x)); x is drawn from (seed, index) alone."""

    def __init__(self, seed: int, size: int) -> None:
        rng = np.random.default_rng([seed, 0xDA7A])
        self.x = rng.standard_normal((size, D_IN)).astype(np.float32)
        self.y = teacher(seed)(self.x).astype(np.float32)

    def __getitem__(self, index: int):
        return index, self.x[index], self.y[index]

    def __len__(self) -> int:
        return len(self.x)


def epochs(loader: DataLoader, sampler: DistributedSampler, first: int):
    """(epoch, batch) from epoch `first` on, forever (set_epoch reshuffles each epoch)."""
    epoch = first
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield epoch, batch
        epoch += 1


def make_batch(seed: int, step: int, rank: int, batch_size: int, batches):
    """Rank `rank`'s batch at `step`: the next (epoch, batch) of `batches`, as Tensors.

    One call per step (the fault tests wrap it to know the step); returns (x, y, epoch,
    sample indices).
    """
    epoch, (index, x, y) = next(batches)
    return x, y, epoch, index.array.tolist()


def params_sha256(module: nn.Module) -> str:
    digest = hashlib.sha256()
    for _, p in module.named_parameters():
        digest.update(np.ascontiguousarray(on_host(p.array)).tobytes())
    return digest.hexdigest()


def make_checkpointer(directory: str | None):
    """elastic's Checkpointer (atomic saves, the newest 3 kept), or None without a directory."""
    if not directory:
        return None
    return Checkpointer(directory, keep=3)


def init_distributed(backend: str = "tcp"):
    """The process group: from the torchrun environment `shoal run` sets, else a group of one."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return collectives.init_process_group(backend, init_method="env://")
    # No launcher: a world of one (its store binds a free port itself).
    return collectives.init_process_group(
        backend, init_method="tcp://127.0.0.1:0", rank=0, world_size=1
    )


def on_host(arr):
    """A numpy copy of a parameter's array (cupy arrays come back from the GPU)."""
    return arr.get() if hasattr(arr, "get") else arr.copy()


def main(argv=None) -> int:
    args = parse_args(argv)
    group = init_distributed(args.backend)
    rank, world = group.rank(), group.size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    device = f"cuda:{local_rank}" if args.backend == "nccl" else "cpu"
    directory = args.checkpoint_dir or core_settings.CHECKPOINT_DIR.get()
    checkpointer = make_checkpointer(directory)
    restarts = core_settings.RESTART_COUNT.get()
    print(f"rank {rank} of {world} (local rank {local_rank}), restart {restarts}", flush=True)

    core.manual_seed(args.seed)
    model = MLP().to(device)
    net = DistributedDataParallel(model, process_group=group)
    opt = core.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)

    dataset = TeacherDataset(args.seed, args.dataset_size)
    sampler = DistributedSampler(dataset, seed=args.seed)  # rank and size: the default group
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.data_workers, persistent_workers=args.data_workers > 0)

    start, first_epoch = 0, 0
    loaded = checkpointer.load_latest() if checkpointer is not None else None
    if loaded is not None:
        start, state = loaded
        model.load_state_dict({k: core.Tensor(v).to(device) for k, v in state["model"].items()})
        opt.load_state_dict(state["optim"])
        if "data" in state:  # the loader's place in its epoch, valid at any world size
            loader.load_state_dict(state["data"])
            first_epoch = int(state["data"]["sampler"]["epoch"])
        if rank == 0:
            print(f"resumed from step {start} (restart {restarts})", flush=True)

    batches = epochs(loader, sampler, first_epoch)
    for step in range(start, args.steps):
        done = step + 1
        # Step time, samples and loss per rank for the dashboard (numbered as checkpoints are).
        with sm.step(done, samples=args.batch_size) as record:
            x, y, epoch, indices = make_batch(args.seed, step, rank, args.batch_size, batches)
            if device != "cpu":
                x, y = x.to(device), y.to(device)
            opt.zero_grad()
            diff = (net(x) - y) * float(1.0 / np.sqrt(y.numel()))
            loss = (diff * diff).sum()
            loss.backward()
            opt.step()
            record.loss = float(loss.item())
        if args.log_samples:
            print(f"rank {rank} step {done} epoch {epoch} samples "
                  f"{','.join(map(str, indices))}", flush=True)
        if rank == 0:
            print(f"step {done} loss {loss.item():.4f}", flush=True)
            if checkpointer is not None and args.checkpoint_every and done % args.checkpoint_every == 0:
                checkpointer.save(done, {
                    "model": {k: on_host(v.array) for k, v in model.state_dict().items()},
                    "optim": opt.state_dict(),
                    "data": loader.state_dict(),
                })
        if args.step_sleep:
            time.sleep(args.step_sleep)

    if rank == 0:
        print(f"final step {args.steps} params_sha256 {params_sha256(model)}", flush=True)
    collectives.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
