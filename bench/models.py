"""Training-step time of the example models (GPT block stack, digits convnet), one thread.

Each step is forward, cross-entropy, backward and AdamW. torch CPU runs the same model with the
same weights in the same run (its twins live in bench/torch_twins.py), alternating
A/B; the script prints a table and one JSON line per row with medians, spread and the ratio.
Targets (issue 40): GPT step <= 1.1x torch, convnet step <= 1.1x torch. `--profile N` then
records N more steps of each side under its own profiler (shoal's core.profiler, torch's
torch.profiler) and prints where the time goes: each op's self CPU time per step.

    python bench/models.py --compare                 # both models, torch peer required
    python bench/models.py --model gpt --breakdown   # per-phase medians too
    python bench/models.py --compare --profile 10    # and both libraries' op breakdowns
    python bench/models.py --compare --clock cpu     # CPU time: steadier on a busy machine
"""

from __future__ import annotations

import os

# One thread for both sides, set before numpy (and torch) load their BLAS.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from shoal import core  # noqa: E402
from shoal.core.nn import functional as F  # noqa: E402
from shoal.examples.train_convnet import ConvNet  # noqa: E402
from shoal.examples.train_gpt import GPT, parse_args  # noqa: E402

# The main job's own model (examples/train_gpt.py's defaults), so the figures are for what the
# README's first command trains; 103 is the character vocabulary of pydoc_data's topics.
_MAIN_JOB = parse_args([])
GPT_SHAPE = {"vocab": 103, "context": _MAIN_JOB.context, "d_model": _MAIN_JOB.d_model,
             "n_layer": _MAIN_JOB.layers, "n_head": _MAIN_JOB.heads, "batch": _MAIN_JOB.batch_size}
CONV_SHAPE = {"width": 32, "batch": 64}

# --clock: wall time (the default), or the CPU time of the calling thread, which both sides'
# single-threaded steps spend entirely and which other work on a shared machine inflates far
# less than the wall time (it still shares caches and memory bandwidth).
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = CLOCKS["wall"]


def use_clock(name: str) -> None:
    """Time the steps (here, in core_step.py and amp.py) with CLOCKS[name]."""
    global clock
    clock = CLOCKS[name]


def inputs(name: str, seed: int) -> tuple:
    """(x, y) as numpy arrays: a batch of token ids and next ids (gpt) or of 8x8 images."""
    rng = np.random.default_rng(seed)
    if name == "gpt":
        s = GPT_SHAPE
        x = rng.integers(0, s["vocab"], (s["batch"], s["context"]))
        y = rng.integers(0, s["vocab"], (s["batch"] * s["context"],))
        return x, y
    x = rng.random((CONV_SHAPE["batch"], 1, 8, 8)).astype(np.float32)
    return x, rng.integers(0, 10, CONV_SHAPE["batch"])


def build(name: str, seed: int, torch_mod) -> tuple:
    """(shoal model, shoal AdamW, torch model or None, torch AdamW or None), same weights."""
    core.manual_seed(seed)
    if name == "gpt":
        s = GPT_SHAPE
        model = GPT(s["vocab"], s["context"], s["d_model"], s["n_layer"], s["n_head"])
    else:
        model = ConvNet(width=CONV_SHAPE["width"])
    opt = core.optim.AdamW(model.parameters(), lr=1e-3)
    if torch_mod is None:
        return model, opt, None, None
    from torch_twins import TorchConvNet, TorchGPT

    if name == "gpt":
        s = GPT_SHAPE
        tmodel = TorchGPT(s["vocab"], s["context"], s["d_model"], s["n_layer"], s["n_head"])
    else:
        tmodel = TorchConvNet(width=CONV_SHAPE["width"])
    tmodel.load_state_dict({k: torch_mod.from_numpy(v.array.copy())
                            for k, v in model.state_dict().items()})
    return model, opt, tmodel, torch_mod.optim.AdamW(tmodel.parameters(), lr=1e-3)


def _phases(forward, loss_fn, opt, x, y) -> tuple:
    t0 = clock()
    opt.zero_grad()
    out = forward(x)
    t1 = clock()
    loss = loss_fn(out, y)
    t2 = clock()
    loss.backward()
    t3 = clock()
    opt.step()
    t4 = clock()
    return t1 - t0, t2 - t1, t3 - t2, t4 - t3


def op_breakdown(step, profiler, steps: int, top: int = 12) -> dict[str, float]:
    """{op: self CPU ms per step} of the `top` costliest ops over `steps` calls of `step` under
    `profiler` (core.profiler.profile or torch.profiler.profile), plus "(all ops)": the sum of
    every op's self time, i.e. the step less the Python between ops."""
    with profiler() as prof:
        for _ in range(steps):
            step()
    avgs = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)
    out = {a.key: a.self_cpu_time_total / 1e3 / steps for a in avgs[:top]}
    out["(all ops)"] = sum(a.self_cpu_time_total for a in avgs) / 1e3 / steps
    return out


def print_breakdowns(base: dict, breakdowns: dict[str, dict[str, float]]) -> None:
    """Each side's op breakdown as a table, then one JSON line per side."""
    for side, ops in breakdowns.items():
        print(f"{side}: self CPU ms per step, costliest ops first")
        for op, ms in ops.items():
            print(f"  {op:<44} {ms:>8.3f}")
    for side, ops in breakdowns.items():
        print(json.dumps({**base, "impl": side, "profile_ms_per_step":
                          {k: round(v, 4) for k, v in ops.items()}}))


def conv_gemm_floor(model, x, repeats: int = 50) -> float:
    """Milliseconds that the GEMMs of `model`'s convolutions alone take per training step (the
    forward product, the weight gradient's and, past the first layer, the input gradient's,
    at the shapes shoal's im2col gives them), best of `repeats`: a lower bound on shoal's step."""
    shapes = []  # (rows, K, O, whether the input needs a gradient) per conv, from a forward

    def hook(module, inputs, output):
        w = module.weight.shape
        n, _, ho, wo = output.shape
        shapes.append((n * ho * wo, w[1] * w[2] * w[3], w[0], inputs[0].requires_grad))

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, core.nn.Conv2d)]
    model(x)  # with autograd on, so that requires_grad tells which inputs get a gradient
    for h in handles:
        h.remove()
    rng = np.random.default_rng(0)
    total = 0.0
    for rows, k, o, input_grad in shapes:
        cols = rng.random((rows, k), dtype=np.float32)
        w = rng.random((o, k), dtype=np.float32)
        g = rng.random((rows, o), dtype=np.float32)
        products = [lambda: cols @ w.T, lambda: cols.T @ g]
        if input_grad:  # a stride-1 input gradient is one more GEMM of the same size
            wt = rng.random((k, o), dtype=np.float32)
            products.append(lambda: cols @ wt)
        for product in products:
            best = float("inf")
            for _ in range(repeats):
                t0 = clock()
                product()
                best = min(best, clock() - t0)
            total += best
    return total * 1e3


def summarize(samples: list[float]) -> dict:
    """Median and 10th/90th percentiles in milliseconds."""
    ms = sorted(s * 1e3 for s in samples)
    q = statistics.quantiles(ms, n=10) if len(ms) >= 2 else [ms[0]] * 9
    return {"median_ms": statistics.median(ms), "p10_ms": q[0], "p90_ms": q[-1]}


def run_model(name: str, args, torch_mod) -> list[dict]:
    """Time one model on both sides; return its rows."""
    model, opt, tmodel, topt = build(name, args.seed, torch_mod)
    x_np, y_np = inputs(name, args.seed)
    vocab = GPT_SHAPE["vocab"]

    def shoal_loss(out, y):
        return F.cross_entropy(out.reshape(-1, vocab) if name == "gpt" else out, y)

    x, y = core.tensor(x_np), core.tensor(y_np)
    sides = {"shoal": lambda: _phases(model, shoal_loss, opt, x, y)}
    if tmodel is not None:
        tf = torch_mod.nn.functional

        def torch_loss(out, yy):
            return tf.cross_entropy(out.reshape(-1, vocab) if name == "gpt" else out, yy)

        tx, ty = torch_mod.from_numpy(x_np), torch_mod.from_numpy(y_np)
        sides["torch"] = lambda: _phases(tmodel, torch_loss, topt, tx, ty)
    for _ in range(args.warmup):
        for fn in sides.values():
            fn()
    times: dict[str, list] = {k: [] for k in sides}
    for i in range(args.iters):
        # Alternate which side goes first so drift on a noisy machine hits both equally.
        order = list(sides) if i % 2 == 0 else list(reversed(list(sides)))
        for side in order:
            times[side].append(sides[side]())
    base = {"bench": "models", "model": name, "threads": 1, "iters": args.iters,
            "optimizer": "adamw", "dtype": "float32", "clock": args.clock}
    base.update(GPT_SHAPE if name == "gpt" else CONV_SHAPE)
    rows = []
    for side, samples in times.items():
        rows.append({**base, "impl": side, "phase": "step", **summarize([sum(t) for t in samples])})
        if args.breakdown:
            for k, phase in enumerate(("forward", "loss", "backward", "optimizer")):
                rows.append({**base, "impl": side, "phase": phase,
                             **summarize([t[k] for t in samples])})
    if args.profile:
        profilers = {"shoal": core.profiler.profile}
        if "torch" in sides:
            profilers["torch"] = torch_mod.profiler.profile
        breakdowns = {side: op_breakdown(sides[side], profilers[side], args.profile)
                      for side in profilers}
        print_breakdowns({"bench": "models", "model": name}, breakdowns)
        if name == "convnet":
            floor = conv_gemm_floor(model, x)
            print(json.dumps({"bench": "models", "model": name,
                              "conv_gemm_floor_ms": round(floor, 4)}))
            print(f"convnet: its convolutions' GEMMs alone take {floor:.2f} ms per step "
                  "(best of 50 each, this BLAS)")
    if "torch" in times:
        ref = {r["phase"]: r["median_ms"] for r in rows if r["impl"] == "torch"}
        for r in rows:
            r["ratio_vs_torch"] = r["median_ms"] / ref[r["phase"]]
        rows[0]["paired_ratio_median"] = statistics.median(
            sum(a) / sum(b) for a, b in zip(times["shoal"], times["torch"])
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt", "convnet", "all"), default="all")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", action="store_true", help="require and run the torch peer")
    parser.add_argument("--breakdown", action="store_true", help="per-phase medians too")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="then profile STEPS more steps per side: each op's self time")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="wall time, or the thread's CPU time (steadier on a busy machine)")
    parser.add_argument("--malloc-default", "--malloc_default", action="store_true",
                        help="leave glibc's trim/mmap thresholds alone (core.retain_freed_memory)")
    args = parser.parse_args(argv)
    use_clock(args.clock)
    if not args.malloc_default:
        # Both sides share this process's malloc, so both gain from reusing freed memory.
        core.retain_freed_memory()
    try:
        import torch as torch_mod

        torch_mod.set_num_threads(1)
    except ImportError:
        if args.compare:
            raise
        torch_mod = None
        print("torch is not installed: timing shoal alone")
    rows = []
    for name in (("gpt", "convnet") if args.model == "all" else (args.model,)):
        rows += run_model(name, args, torch_mod)
    print(f"{'model':<8} {'impl':<6} {'phase':<10} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} "
          f"{'x torch':>8}")
    for r in rows:
        ratio = f"{r['ratio_vs_torch']:.3f}" if "ratio_vs_torch" in r else "-"
        print(f"{r['model']:<8} {r['impl']:<6} {r['phase']:<10} {r['median_ms']:>10.2f} "
              f"{r['p10_ms']:>8.2f} {r['p90_ms']:>8.2f} {ratio:>8}")
        if "paired_ratio_median" in r:
            print(f"{'':<8} paired ratio (median of per-iteration shoal/torch): "
                  f"{r['paired_ratio_median']:.3f}")
    for r in rows:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
