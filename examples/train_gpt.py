"""Train a small character-level GPT with DistributedDataParallel on Python's own documentation.

    shoal run --nproc-per-node 2 examples/train_gpt.py           # the README's main job
    python examples/train_gpt.py --steps 20                      # no launcher: a group of one

The text is the standard library's `pydoc_data/topics.py` (the `help()` topics, about 460 KB
of English documentation); its last tenth is held out. Every --log-every steps rank 0 prints
the step, samples/s, the training loss and the held-out loss in bits per character (each rank
evaluates half of the held-out windows). Every rank reports each step through `shoal.metrics`
(step time, samples, loss, last step), so the dashboard's training row fills under
`shoal run --metrics-port`. Training windows come through core.data's DataLoader
with collectives' DistributedSampler, whose state is checkpointed. Rank 0 checkpoints every --checkpoint-every steps to
--checkpoint-dir or SHOAL_CHECKPOINT_DIR; every rank resumes from the latest checkpoint when it
starts. At the end rank 0 prints a generated sample and writes a loss-curve PNG (with
matplotlib, the `models` extra; without it, one line says so). The loader resumes where the
checkpoint left it and the checkpoint carries core's random state (dropout's masks), so a
resumed run ends with the parameters of an unbroken one; with --deterministic
(core.use_deterministic_algorithms) an op with no deterministic form would raise instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import sys
import tempfile
import time
from collections import Counter
from typing import Any, Iterator, Optional

import numpy as np

import shoal.metrics as sm
from shoal import collectives, core
from shoal.collectives import DistributedDataParallel, DistributedSampler
from shoal.core import nn
from shoal.core import settings as core_settings
from shoal.core.data import DataLoader, Dataset
from shoal.core.nn import functional as F
from shoal.elastic.checkpoint import Checkpointer

LN2 = math.log(2.0)


class GPT(nn.Module):
    """Token and position embeddings, pre-norm causal transformer blocks, a tied output head."""

    def __init__(self, vocab_size: int, context: int = 64, d_model: int = 144, n_layer: int = 4,
                 n_head: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(context, d_model)
        block = nn.TransformerEncoderLayer(
            d_model, n_head, dim_feedforward=4 * d_model, dropout=dropout,
            activation=nn.GELU(approximate="tanh"),  # GPT-2's GELU; cheaper than erf
            batch_first=True, norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(block, n_layer)
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying: one Parameter, two modules
        self.apply(_gpt_init)

    def forward(self, idx: core.Tensor) -> core.Tensor:
        """Logits (B, T, vocab) for token ids (B, T)."""
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"GPT: sequence of {t} tokens exceeds the context of {self.context}.")
        x = self.tok(idx) + self.pos(core.arange(t))
        x = self.blocks(x, is_causal=True)
        return self.head(self.ln_f(x))


def _gpt_init(module: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) weights and embeddings, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, 0.0, 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.MultiheadAttention):
        nn.init.normal_(module.in_proj_weight, 0.0, 0.02)


def load_text() -> str:
    """The help() topics of the running Python, joined in a fixed (sorted) order."""
    from pydoc_data import topics  # noqa: PLC0415 - ships with CPython itself

    return "".join(topics.topics[key] for key in sorted(topics.topics))


class CharData:
    """Character ids of the text, a train/held-out split, and the unigram entropy in bits."""

    def __init__(self, text: str, held_out: float = 0.1) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        ids = np.fromiter((self.index[c] for c in text), dtype=np.int64, count=len(text))
        cut = int(len(ids) * (1.0 - held_out))
        self.train, self.held_out = ids[:cut], ids[cut:]
        counts = np.array(list(Counter(text).values()), dtype=np.float64)
        p = counts / counts.sum()
        self.unigram_bits = float(-(p * np.log2(p)).sum())

    @property
    def vocab_size(self) -> int:
        """Distinct characters in the text."""
        return len(self.chars)

    def decode(self, ids: np.ndarray) -> str:
        """Characters for ids."""
        return "".join(self.chars[int(i)] for i in ids)

    def windows(self, context: int) -> "Windows":
        """Every training window of `context` characters, as a map-style dataset."""
        return Windows(self.train, context)

    def held_out_windows(self, count: int, context: int) -> tuple:
        """`count` evenly spaced held-out windows (the same every evaluation)."""
        starts = np.linspace(0, len(self.held_out) - context - 1, count).astype(np.int64)
        chunk = self.held_out[starts[:, None] + np.arange(context + 1)]
        return chunk[:, :-1], chunk[:, 1:]


class Windows(Dataset):
    """Sample i: (characters i..i+T-1, the characters after each), T = context."""

    def __init__(self, ids: np.ndarray, context: int) -> None:
        self.ids = ids
        self.context = context

    def __len__(self) -> int:
        return len(self.ids) - self.context - 1

    def __getitem__(self, index: int) -> tuple:
        chunk = self.ids[index : index + self.context + 1]
        return chunk[:-1], chunk[1:]


def batches(loader: DataLoader, sampler: Any, epoch: int) -> Iterator:
    """The loader's batches forever, moving the sampler to the next epoch at each end."""
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=160, help="total optimizer steps")
    parser.add_argument("--batch-size", "--batch_size", type=int, default=24, help="per rank")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--d-model", "--d_model", type=int, default=144)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="dropout probability in the attention and feed-forward blocks")
    parser.add_argument("--deterministic", action="store_true",
                        help="core.use_deterministic_algorithms(True): ops with no "
                             "deterministic form raise")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", "--log_every", type=int, default=20)
    parser.add_argument("--eval-windows", "--eval_windows", type=int, default=96)
    parser.add_argument("--checkpoint-every", "--checkpoint_every", type=int, default=40,
                        help="save a checkpoint every N steps (0: never)")
    parser.add_argument("--checkpoint-dir", "--checkpoint_dir", default=None,
                        help="where checkpoints go (default: $SHOAL_CHECKPOINT_DIR; none: off)")
    parser.add_argument("--plot", default=os.path.join(tempfile.gettempdir(), "shoal_gpt_loss.png"),
                        help="where the loss-curve PNG goes")
    parser.add_argument("--sample-chars", "--sample_chars", type=int, default=200)
    parser.add_argument("--stop-after", "--stop_after", type=int, default=None,
                        help="exit after this step as if killed (tests resuming)")
    parser.add_argument("--step-sleep", "--step_sleep", type=float, default=0.0,
                        help="seconds to sleep after each step (gives tests time to kill a run)")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "context", "d_model", "layers", "heads", "log_every",
                 "eval_windows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout {args.dropout} must be at least 0 and below 1")
    if args.step_sleep < 0:
        parser.error(f"--step-sleep {args.step_sleep} must not be negative")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    return args


def init_distributed():
    """The process group: from the torchrun environment `shoal run` sets, else a group of one."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return collectives.init_process_group("tcp", init_method="env://")
    return collectives.init_process_group(
        "tcp", init_method="tcp://127.0.0.1:0", rank=0, world_size=1
    )


def held_out_bits(model: nn.Module, data: CharData, args, group) -> float:
    """Mean held-out cross entropy in bits per character; ranks split the windows."""
    x, y = data.held_out_windows(args.eval_windows, args.context)
    rank, world = group.rank(), group.size()
    totals = np.zeros(2, dtype=np.float64)
    model.eval()
    with core.no_grad():
        for lo in range(rank * 32, len(x), 32 * world):
            logits = model(core.tensor(x[lo : lo + 32]))
            loss = F.cross_entropy(logits.reshape(-1, data.vocab_size),
                                   core.tensor(y[lo : lo + 32].reshape(-1)), reduction="sum")
            totals += (float(loss.item()), y[lo : lo + 32].size)
    model.train()
    group.all_reduce(totals)
    return totals[0] / totals[1] / LN2


def generate(model: GPT, data: CharData, prompt: str, count: int, seed: int) -> str:
    """Sample `count` characters after `prompt` (temperature 0.8)."""
    rng = np.random.default_rng(seed)
    ids = [data.index[c] for c in prompt if c in data.index]
    model.eval()
    with core.no_grad():
        for _ in range(count):
            window = np.array(ids[-model.context :], dtype=np.int64)[None]
            logits = model(core.tensor(window)).numpy()[0, -1].astype(np.float64) / 0.8
            p = np.exp(logits - logits.max())
            ids.append(int(rng.choice(len(p), p=p / p.sum())))
    model.train()
    return data.decode(np.array(ids))


def params_sha256(module: nn.Module) -> str:
    digest = hashlib.sha256()
    for _, p in module.named_parameters():
        digest.update(np.ascontiguousarray(p.array).tobytes())
    return digest.hexdigest()


def write_plot(path: str, history: list, unigram: float) -> str:
    """The loss curve as a PNG, or a sentence saying why not."""
    try:
        import matplotlib  # noqa: PLC0415 - optional: the `models` extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return "no loss plot: matplotlib is not installed (pip install 'shoal[models]')"
    steps = [h[0] for h in history]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [h[1] / LN2 for h in history], label="train (bits/char)")
    ax.plot(steps, [h[2] for h in history], marker="o", label="held-out (bits/char)")
    ax.axhline(unigram, color="gray", linestyle="--", label="unigram entropy")
    ax.axhline(0.7 * unigram, color="gray", linestyle=":", label="0.7 x unigram")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per character")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"loss curve written to {path}"


@dataclasses.dataclass
class Training:
    """One rank's run: its group, data, model, optimizer and schedule, where checkpoints go,
    and the loss history (step, mean train loss, held-out bits per character)."""

    args: argparse.Namespace
    group: Any
    data: CharData
    sampler: DistributedSampler
    loader: DataLoader
    model: GPT
    net: DistributedDataParallel
    opt: Any
    sched: Any
    checkpointer: Optional[Checkpointer]
    history: list = dataclasses.field(default_factory=list)

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self.group.rank()


def build(args: argparse.Namespace, group) -> Training:
    """The data, the model wrapped in DDP, AdamW with warm-up and cosine decay, and the
    checkpointer (--checkpoint-dir, else SHOAL_CHECKPOINT_DIR, else none)."""
    data = CharData(load_text())
    train_set = data.windows(args.context)
    # torch's recipe: each rank reads its share of one shuffled order of all training windows.
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    core.use_deterministic_algorithms(args.deterministic)
    # Every rank seeds alike: the same initial weights and, since the ranks draw masks of the
    # same shapes in the same order, the same random stream; rank 0's state stands for all.
    core.manual_seed(args.seed)
    model = GPT(data.vocab_size, args.context, args.d_model, args.layers, args.heads,
                dropout=args.dropout)
    net = DistributedDataParallel(model, process_group=group)
    opt = core.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.01)
    total, warm = args.steps, max(1, args.warmup)
    sched = core.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    )
    directory = args.checkpoint_dir or core_settings.CHECKPOINT_DIR.get()
    checkpointer = Checkpointer(directory, keep=2) if directory else None
    return Training(args, group, data, sampler, loader, model, net, opt, sched, checkpointer)


def announce(run: Training) -> None:
    """Rank 0's first line: the model's size, the data and the run's shape."""
    if run.rank != 0:
        return
    args, data = run.args, run.data
    n_params = sum(p.numel() for p in run.model.parameters())
    print(f"GPT: {n_params / 1e6:.2f} M parameters, vocabulary {data.vocab_size}, "
          f"{len(data.train)} training and {len(data.held_out)} held-out characters, "
          f"unigram entropy {data.unigram_bits:.3f} bits/char; {run.group.size()} rank(s) x "
          f"batch {args.batch_size} x context {args.context}, dropout {args.dropout:g}, "
          f"deterministic algorithms {'on' if args.deterministic else 'off'}", flush=True)


def resume(run: Training) -> tuple[int, int]:
    """(first step, epoch) from the latest checkpoint, or (0, 0) without one; the model,
    optimizer, schedule, history, loader and random state are restored in place."""
    loaded = run.checkpointer.load_latest() if run.checkpointer is not None else None
    if loaded is None:
        return 0, 0
    start, state = loaded
    run.model.load_state_dict({k: core.Tensor(v) for k, v in state["model"].items()})
    run.opt.load_state_dict(state["optim"])
    run.sched.load_state_dict(state["sched"])
    run.history = state["history"]
    run.loader.load_state_dict(state["loader"])
    # Dropout continues the stream where the checkpoint left it, not from the seed.
    core.set_rng_state(state["rng"])
    if run.rank == 0:
        print(f"resumed from step {start}", flush=True)
    return start, int(state["loader"]["sampler"]["epoch"])


def save(run: Training, done: int) -> None:
    """Rank 0's checkpoint after step `done`, every --checkpoint-every steps."""
    every = run.args.checkpoint_every
    if run.rank == 0 and run.checkpointer is not None and every and done % every == 0:
        run.checkpointer.save(done, {
            "model": {k: v.array.copy() for k, v in run.model.state_dict().items()},
            "optim": run.opt.state_dict(), "sched": run.sched.state_dict(),
            "history": run.history, "loader": run.loader.state_dict(),
            "rng": core.get_rng_state(),
        })


def train(run: Training, start: int, epoch: int) -> Optional[int]:
    """Steps `start` .. --steps, logging every --log-every; the exit code 3 when --stop-after
    ends the run early, else None."""
    args, data, world, total = run.args, run.data, run.group.size(), run.args.steps
    tick, seen, loss_sum, loss_n = time.perf_counter(), 0, 0.0, 0
    stream = batches(run.loader, run.sampler, epoch)
    for step in range(start, total):
        done = step + 1
        # Step time, samples, loss and the last step, per rank (shoal.metrics): what the
        # dashboard's training row and ShoalNoProgress read. Steps are numbered as checkpoints
        # are (after step N the checkpoint is N), so "steps a failure would lose" is exact.
        with sm.step(done, samples=args.batch_size) as record:
            x, y = next(stream)
            logits = run.net(x)
            loss = F.cross_entropy(logits.reshape(-1, data.vocab_size), y.reshape(-1))
            run.opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(run.model.parameters(), 1.0)
            run.opt.step()
            run.sched.step()
            record.loss = float(loss.item())
        seen += args.batch_size * world
        loss_sum, loss_n = loss_sum + record.loss, loss_n + 1
        if done % args.log_every == 0 or done == total:
            rate = seen / (time.perf_counter() - tick)
            bits = held_out_bits(run.model, data, args, run.group)
            run.history.append((done, loss_sum / loss_n, bits))
            if run.rank == 0:
                print(f"step {done}/{total} | {rate:.0f} samples/s | train loss "
                      f"{loss_sum / loss_n:.3f} | held-out {bits:.3f} bits/char", flush=True)
            tick, seen, loss_sum, loss_n = time.perf_counter(), 0, 0.0, 0
        save(run, done)
        if args.stop_after is not None and done >= args.stop_after:
            # Wait for rank 0's checkpoint: a rank that exits first (with 3) makes the
            # launcher stop the others, possibly in the middle of the save.
            run.group.barrier()
            if run.rank == 0:
                print(f"stopping after step {done} as asked", flush=True)
            return 3
        if args.step_sleep:
            time.sleep(args.step_sleep)
    return None


def finish(run: Training, started: float) -> None:
    """Rank 0's last lines: a generated sample, the loss plot, the final held-out loss."""
    args, data, model = run.args, run.data, run.model
    history = run.history
    bits = history[-1][2] if history else held_out_bits(model, data, args, run.group)
    if run.rank == 0:
        print("sample: " + repr(generate(model, data, "The ", args.sample_chars, args.seed)),
              flush=True)
        print(write_plot(args.plot, history, data.unigram_bits), flush=True)
        print(f"final held-out {bits:.3f} bits/char = {bits / data.unigram_bits:.2f} x unigram "
              f"entropy ({data.unigram_bits:.3f}) after {args.steps} steps in "
              f"{time.perf_counter() - started:.0f} s; params_sha256 {params_sha256(model)}",
              flush=True)


def main(argv=None) -> int:
    """Train, checkpointing and resuming, then print a sample and the final loss."""
    args = parse_args(argv)
    started = time.perf_counter()
    core.retain_freed_memory()  # reuse freed activations instead of page-faulting anew
    run = build(args, init_distributed())
    announce(run)
    start, epoch = resume(run)
    stopped = train(run, start, epoch)
    if stopped is not None:
        return stopped
    finish(run, started)
    collectives.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
