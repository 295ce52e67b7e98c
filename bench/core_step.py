"""Training-step time of an MLP 784-1024-1024-10 (batch 256, SGD momentum), one thread.

Times shoal's step (forward, cross-entropy, backward, optimizer step) next to torch's CPU step
on the same model and weights in the same run, alternating A/B, and prints a table plus one
JSON line per row with medians, spread and the ratio. Targets: shoal <= 1.1x torch in float32,
<= 1.2x in float64 (`--dtype float64`: weights, batch and optimizer state in double).

    python bench/core_step.py --iters 40            # torch peer runs when installed
    python bench/core_step.py --breakdown           # per-phase medians for both
    python bench/core_step.py --dtype float64       # the same step in double precision
    python bench/core_step.py --profile 10          # and each side's op breakdown
"""

from __future__ import annotations

import os

# One thread for both sides, set before numpy (and torch) load their BLAS.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402

import numpy as np  # noqa: E402

import models  # noqa: E402  (bench/'s op breakdown; bench/ is not a package)

from shoal import core  # noqa: E402
from shoal.core import nn  # noqa: E402
from shoal.core import optim  # noqa: E402
from shoal.core.nn import functional as F  # noqa: E402

SIZES = (784, 1024, 1024, 10)


def build_shoal(seed: int, dtype: str = "float32"):
    """The shoal model (its parameters in `dtype`) and its SGD-momentum optimizer."""
    core.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    if dtype == "float64":
        model.double()
    return model, optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def build_torch(shoal_model, seed: int = 0, dtype: str = "float32"):
    """The same model in torch, in `dtype`, with shoal's initial weights copied in (torch's own,
    from `seed`, when `shoal_model` is None)."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    if dtype == "float64":
        model.double()
    if shoal_model is not None:
        model.load_state_dict({k: torch.from_numpy(v.array.copy())
                               for k, v in shoal_model.state_dict().items()})
    return torch, model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def shoal_phases(model, opt, x, y):
    """One shoal step; returns the seconds spent in forward, loss, backward and step."""
    t0 = models.clock()
    opt.zero_grad()
    logits = model(x)
    t1 = models.clock()
    loss = F.cross_entropy(logits, y)
    t2 = models.clock()
    loss.backward()
    t3 = models.clock()
    opt.step()
    t4 = models.clock()
    return t1 - t0, t2 - t1, t3 - t2, t4 - t3


def torch_phases(torch, model, opt, x, y):
    """One torch step; returns the seconds spent in forward, loss, backward and step."""
    t0 = models.clock()
    opt.zero_grad()
    logits = model(x)
    t1 = models.clock()
    loss = torch.nn.functional.cross_entropy(logits, y)
    t2 = models.clock()
    loss.backward()
    t3 = models.clock()
    opt.step()
    t4 = models.clock()
    return t1 - t0, t2 - t1, t3 - t2, t4 - t3


def summarize(samples: list[float]) -> dict:
    """Median and 10th/90th percentiles in milliseconds."""
    ms = sorted(s * 1e3 for s in samples)
    q = statistics.quantiles(ms, n=10) if len(ms) >= 2 else [ms[0]] * 9
    return {"median_ms": statistics.median(ms), "p10_ms": q[0], "p90_ms": q[-1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", action="store_true",
                        help="run the torch peer (the default when torch is installed)")
    parser.add_argument("--no-compare", "--no_compare", action="store_true",
                        help="skip the torch peer even when it is installed")
    parser.add_argument("--breakdown", action="store_true", help="per-phase medians too")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="then profile STEPS more steps per side: each op's self time")
    parser.add_argument("--clock", choices=tuple(models.CLOCKS), default="wall",
                        help="wall time, or the thread's CPU time (steadier on a busy machine)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                        help="the parameters', batch's and optimizer state's dtype")
    args = parser.parse_args(argv)
    models.use_clock(args.clock)

    model, opt = build_shoal(args.seed, args.dtype)
    rng = np.random.default_rng(args.seed)
    x_np = rng.standard_normal((args.batch, SIZES[0])).astype(args.dtype)
    y_np = rng.integers(0, SIZES[-1], size=args.batch).astype(np.int64)
    x, y = core.tensor(x_np), core.tensor(y_np)

    peer = None
    if not args.no_compare:
        try:
            torch, tmodel, topt = build_torch(model, dtype=args.dtype)
            peer = (torch, tmodel, topt, torch.from_numpy(x_np), torch.from_numpy(y_np))
        except ImportError:
            if args.compare:
                raise
            print("torch is not installed: timing shoal alone")

    for _ in range(args.warmup):
        shoal_phases(model, opt, x, y)
        if peer:
            torch_phases(*peer)
    shoal_times, torch_times = [], []
    for i in range(args.iters):
        # Alternate which side goes first so drift on a noisy machine hits both equally.
        order = ("shoal", "torch") if i % 2 == 0 else ("torch", "shoal")
        for side in order:
            if side == "shoal":
                shoal_times.append(shoal_phases(model, opt, x, y))
            elif peer:
                torch_times.append(torch_phases(*peer))

    phases = ("forward", "loss", "backward", "optimizer")
    rows = []
    base = {"bench": "core_step", "model": "mlp-784-1024-1024-10", "batch": args.batch,
            "dtype": args.dtype, "optimizer": "sgd-momentum", "threads": 1, "iters": args.iters,
            "clock": args.clock}
    for name, times in (("shoal", shoal_times), ("torch", torch_times)):
        if not times:
            continue
        row = {**base, "impl": name, "phase": "step", **summarize([sum(t) for t in times])}
        rows.append(row)
        if args.breakdown:
            for k, phase in enumerate(phases):
                rows.append({**base, "impl": name, "phase": phase,
                             **summarize([t[k] for t in times])})
    if torch_times:
        torch_median = {(r["phase"]): r["median_ms"] for r in rows if r["impl"] == "torch"}
        for r in rows:
            r["ratio_vs_torch"] = r["median_ms"] / torch_median[r["phase"]]
        # Each iteration ran both sides back to back, so the median of per-iteration ratios
        # cancels most of the drift a busy machine adds to both.
        paired = statistics.median(sum(a) / sum(b) for a, b in zip(shoal_times, torch_times))
        rows[0]["paired_ratio_median"] = paired

    if args.profile:
        breakdowns = {"shoal": models.op_breakdown(lambda: shoal_phases(model, opt, x, y),
                                                   core.profiler.profile, args.profile)}
        if peer:
            breakdowns["torch"] = models.op_breakdown(lambda: torch_phases(*peer),
                                                      peer[0].profiler.profile, args.profile)
        models.print_breakdowns({"bench": "core_step", "dtype": args.dtype}, breakdowns)

    print(f"{'impl':<6} {'phase':<10} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} {'x torch':>8}")
    for r in rows:
        ratio = f"{r['ratio_vs_torch']:.3f}" if "ratio_vs_torch" in r else "-"
        print(f"{r['impl']:<6} {r['phase']:<10} {r['median_ms']:>10.2f} {r['p10_ms']:>8.2f} "
              f"{r['p90_ms']:>8.2f} {ratio:>8}")
    if torch_times:
        print(f"paired ratio (median of per-iteration shoal/torch): {paired:.3f}")
    for r in rows:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
