"""Training step in float32 and under bf16 autocast, shoal next to torch's CPU autocast.

The model is the main job's GPT (bench/models.py's builder and batch: examples/train_gpt.py's
defaults, AdamW, cross-entropy over every position), or with --model mlp core_step's MLP
784-1024-1024-10 (batch 256, SGD momentum). Weights stay float32; "amp" wraps the forward and
the loss in autocast("cpu", bfloat16), as torch users do. torch starts from shoal's weights.

Step time: medians over rows alternated step by step (shoal f32, shoal amp, torch f32, torch
amp) in one process, one thread each, after warm-up steps.

Peak memory, each figure from a fresh child process per row, so no row inherits another's heap:
- peak RSS growth (both libraries, the same method): Linux's VmHWM over the measured steps minus
  the RSS once the model, optimizer and batch exist and before the first step (VmHWM is reset
  through /proc/self/clear_refs). It counts optimizer state, gradients, activations, autocast's
  bf16 copies of the weights and what malloc keeps, i.e. what the machine must have free.
- tracemalloc peak (shoal only): tracemalloc started at that same point; numpy reports its
  array buffers to tracemalloc, so this is the peak of bytes allocated by the steps and still
  held, independent of malloc's caching. torch's allocations are invisible to tracemalloc and
  torch has no CPU peak-memory counter, so torch rows have the RSS figure only.

On CPU numpy has no bfloat16 BLAS: ml_dtypes supplies the bf16 GEMMs and elementwise loops, so
shoal's autocast step should not be expected to gain what torch's oneDNN bf16 kernels gain
(the MLP, GEMM-bound, was slower under autocast; for the GPT, read the ratio this prints). The
autocast speed target (<= 0.6x of float32) is for GPUs and is checked by the GPU runs.

Targets (issue 40): shoal's autocast step <= 1.2x torch's autocast step. `--profile N` then
records N more steps of each row under its library's profiler and prints each op's self CPU
time per step (where the time goes).

    python bench/amp.py --compare --iters 20                # the GPT
    python bench/amp.py --compare --model mlp --iters 20    # core_step's MLP
    python bench/amp.py --compare --profile 3               # and the op breakdowns
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tracemalloc  # noqa: E402
from typing import Callable  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import core_step  # noqa: E402  (its MLP; bench/ is not a package)
import models  # noqa: E402  (the example models' builders)

from shoal import core  # noqa: E402
from shoal.core.nn import functional as F  # noqa: E402

MLP_BATCH = 256
ROWS = (("shoal", False), ("shoal", True), ("torch", False), ("torch", True))


def _row_name(side: str, amp: bool) -> str:
    return f"{side} {'amp' if amp else 'f32'}"


def _shoal_step(model, opt, x, y, loss_fn, amp: bool) -> Callable[[], float]:
    def step() -> float:
        with core.autocast("cpu", enabled=amp):
            loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    return step


def _torch_step(torch, model, opt, x, y, loss_fn, amp: bool) -> Callable[[], float]:
    def step() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    return step


def _gpt_steps(amp: bool, torch_mod) -> dict[str, Callable[[], float]]:
    """Steps for one fresh copy of the GPT (shoal, and torch with the same weights)."""
    vocab = models.GPT_SHAPE["vocab"]
    model, opt, tmodel, topt = models.build("gpt", 0, torch_mod)
    x_np, y_np = models.inputs("gpt", 0)
    steps = {"shoal": _shoal_step(model, opt, core.tensor(x_np), core.tensor(y_np),
                                  lambda out, y: F.cross_entropy(out.reshape(-1, vocab), y), amp)}
    if tmodel is not None:
        tf = torch_mod.nn.functional
        steps["torch"] = _torch_step(
            torch_mod, tmodel, topt, torch_mod.from_numpy(x_np), torch_mod.from_numpy(y_np),
            lambda out, y: tf.cross_entropy(out.reshape(-1, vocab), y), amp)
    return steps


def _mlp_steps(amp: bool, torch_mod) -> dict[str, Callable[[], float]]:
    """Steps for one fresh copy of core_step's MLP (shoal, and torch with the same weights)."""
    model, opt = core_step.build_shoal(0)
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((MLP_BATCH, core_step.SIZES[0])).astype(np.float32)
    y_np = rng.integers(0, core_step.SIZES[-1], MLP_BATCH)
    steps = {"shoal": _shoal_step(model, opt, core.tensor(x_np), core.tensor(y_np),
                                  core.nn.CrossEntropyLoss(), amp)}
    if torch_mod is not None:
        torch, tmodel, topt = core_step.build_torch(model, seed=0)
        steps["torch"] = _torch_step(torch, tmodel, topt, torch.from_numpy(x_np),
                                     torch.from_numpy(y_np), torch.nn.CrossEntropyLoss(), amp)
    return steps


BUILDERS = {"gpt": _gpt_steps, "mlp": _mlp_steps}
DESCRIPTIONS = {
    "gpt": lambda: ("GPT {d_model}x{n_layer} (main job), batch {batch} x context {context}, "
                    "AdamW").format(**models.GPT_SHAPE),
    "mlp": lambda: f"MLP {'-'.join(map(str, core_step.SIZES))}, batch {MLP_BATCH}, SGD momentum",
}


def _import_torch():
    import torch

    torch.set_num_threads(1)
    return torch


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(model: str, side: str, amp: bool, method: str, iters: int) -> None:
    """One row's peak memory by one method, in this fresh process (see the module docstring)."""
    core.retain_freed_memory()  # as in the timing process and the examples
    torch_mod = _import_torch() if side == "torch" else None
    step = BUILDERS[model](amp, torch_mod)[side]
    gc.collect()
    if method == "rss":
        before = _status_mib("VmRSS")
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # Linux: reset the peak RSS (VmHWM) to the current RSS
        for _ in range(iters):
            step()
        print(json.dumps({"mib": round(_status_mib("VmHWM") - before, 1)}))
        return
    tracemalloc.start()
    for _ in range(iters):
        step()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(json.dumps({"mib": round(peak / 2**20, 1)}))


def _peak_memory(model: str, side: str, amp: bool, method: str, iters: int) -> float | None:
    out = subprocess.run(
        [sys.executable, __file__, "--model", model, "--child", side, "--method", method,
         "--amp" if amp else "--f32", "--iters", str(iters)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    if out.returncode != 0:
        print(f"memory child {side} {method} failed: {out.stderr.strip()[-500:]}")
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])["mib"]


def compare(model: str, iters: int, warmup: int, mem_steps: int, torch_mod,
            profile_steps: int = 0) -> None:
    """Alternate the rows step by step; print medians, spreads, peak memory and ratios."""
    core.retain_freed_memory()
    rows: dict[str, Callable[[], float]] = {}
    for amp in (False, True):
        for side, step in BUILDERS[model](amp, torch_mod).items():
            rows[_row_name(side, amp)] = step
    rows = {name: rows[name] for name in (_row_name(s, a) for s, a in ROWS) if name in rows}
    times: dict[str, list[float]] = {k: [] for k in rows}
    losses: dict[str, float] = {}
    for i in range(warmup + iters):
        for name, step in rows.items():
            t0 = models.clock()
            losses[name] = step()
            if i >= warmup:
                times[name].append(models.clock() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{DESCRIPTIONS[model]()}, one thread; {iters} steps per row after {warmup} warm-up, "
          f"rows alternated; memory over {mem_steps} steps in a fresh process per row")
    print(f"{'row':<10} {'median ms':>10} {'p10-p90 ms':>16} {'peak RSS +MiB':>14} "
          f"{'tracemalloc MiB':>16} {'last loss':>10}")
    for name in rows:
        v = sorted(t * 1e3 for t in times[name])
        spread = f"{v[len(v) // 10]:.1f}-{v[(len(v) * 9) // 10 - 1 if len(v) > 1 else 0]:.1f}"
        side, mode = name.split()
        rss = _peak_memory(model, side, mode == "amp", "rss", mem_steps)
        traced = (_peak_memory(model, side, mode == "amp", "tracemalloc", mem_steps)
                  if side == "shoal" else None)
        rss_s = "n/a" if rss is None else f"{rss:.1f}"
        traced_s = "-" if traced is None else f"{traced:.1f}"
        print(f"{name:<10} {med[name]:>10.1f} {spread:>16} {rss_s:>14} {traced_s:>16} "
              f"{losses[name]:>10.4f}")
        print(json.dumps({"bench": "amp", "model": model, "row": name,
                          "median_ms": round(med[name], 2), "peak_rss_growth_mib": rss,
                          "tracemalloc_peak_mib": traced, "iters": iters,
                          "clock": "cpu" if models.clock is models.CLOCKS["cpu"] else "wall",
                          "mem_steps": mem_steps}))
    print(f"shoal amp / shoal f32: {med['shoal amp'] / med['shoal f32']:.2f}x "
          "(numpy has no bf16 BLAS: ml_dtypes' loops run the bf16 work)")
    if "torch f32" in med:
        print(f"torch amp / torch f32: {med['torch amp'] / med['torch f32']:.2f}x")
        print(f"shoal f32 / torch f32: {med['shoal f32'] / med['torch f32']:.2f}x; "
              f"shoal amp / torch amp: {med['shoal amp'] / med['torch amp']:.2f}x")
    if profile_steps:
        profilers = {"shoal": core.profiler.profile}
        if torch_mod is not None:
            profilers["torch"] = torch_mod.profiler.profile
        models.print_breakdowns(
            {"bench": "amp", "model": model},
            {name: models.op_breakdown(step, profilers[name.split()[0]], profile_steps)
             for name, step in rows.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", action="store_true", help="run torch's CPU autocast too")
    parser.add_argument("--model", choices=tuple(BUILDERS), default="gpt")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--mem-steps", "--mem_steps", type=int, default=3,
                        help="steps each memory child runs")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="then profile STEPS more steps per row: each op's self time")
    parser.add_argument("--clock", choices=tuple(models.CLOCKS), default="wall",
                        help="wall time, or the thread's CPU time (steadier on a busy machine)")
    parser.add_argument("--child", choices=("shoal", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=("rss", "tracemalloc"), help=argparse.SUPPRESS)
    parser.add_argument("--amp", dest="amp", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--f32", dest="amp", action="store_false", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("iters", "warmup", "mem_steps"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')} must be at least "
                         f"{0 if name == 'warmup' else 1}, got {getattr(args, name)}")
    if args.child:
        child(args.model, args.child, args.amp, args.method, args.iters)
        return
    models.use_clock(args.clock)
    torch_mod = None
    if args.compare:
        try:
            torch_mod = _import_torch()
        except ImportError:
            print("torch is not installed: shoal rows only")
    compare(args.model, args.iters, args.warmup, args.mem_steps, torch_mod, args.profile)


if __name__ == "__main__":
    main()
