"""Training step of an MLP in float32 and under bf16 autocast, shoal next to torch's CPU autocast.

The model is core_step's MLP 784-1024-1024-10 (batch 256, SGD momentum, cross-entropy), float32
weights; "amp" wraps the forward and loss in autocast("cpu", bfloat16), as torch users do.
Step times are medians over alternating runs (shoal f32, torch f32, shoal amp, torch amp) in
one process, one thread each. Peak memory: in one fresh child process per row, the peak RSS
over 3 steps above the RSS after a warm-up step (Linux's VmHWM, reset through clear_refs).

On CPU numpy has no bfloat16 BLAS: ml_dtypes runs bf16 matmuls in its own loops, so shoal's
autocast step is expected to be slower than its float32 step; torch has bf16 kernels (oneDNN).
The autocast speed target (<= 0.6x of float32) is for GPUs and is checked by the GPU runs.

    python bench/amp.py --compare --iters 20
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import core_step  # noqa: E402  (its MLP; bench/ is not a package)

SIZES = core_step.SIZES
BATCH = 256


def _shoal_side(amp: bool):
    from shoal import core  # noqa: PLC0415

    model, opt = core_step.build_shoal(0)
    rng = np.random.default_rng(0)
    x = core.tensor(rng.standard_normal((BATCH, SIZES[0])).astype(np.float32))
    y = core.tensor(rng.integers(0, SIZES[-1], BATCH))
    loss_fn = core.nn.CrossEntropyLoss()

    def step() -> float:
        with core.autocast("cpu", enabled=amp):
            loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    return model, step


def _torch_side(amp: bool, shoal_model=None):
    torch, model, opt = core_step.build_torch(shoal_model, seed=0)
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((BATCH, SIZES[0])).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, SIZES[-1], BATCH))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    return model, step


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(side: str, amp: bool, iters: int) -> None:
    """One row's peak memory in a fresh process: the peak RSS over `iters` steps above the RSS
    after one warm-up step (momentum buffers exist by then), as the step's own working set."""
    _, step = (_shoal_side if side == "shoal" else _torch_side)(amp)
    step()
    gc.collect()
    before = _status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # Linux: reset the peak RSS (VmHWM) to the current RSS
    for _ in range(iters):
        step()
    print(json.dumps({"peak_rss_growth_mib": round(_status_mib("VmHWM") - before, 1)}))


def _peak_memory(side: str, amp: bool, iters: int) -> float | None:
    out = subprocess.run(
        [sys.executable, __file__, "--child", side, "--amp" if amp else "--f32",
         "--iters", str(iters)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    if out.returncode != 0:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_growth_mib"]


def compare(iters: int, warmup: int, with_torch: bool) -> None:
    """Alternate the four rows step by step; print medians, spreads and ratios."""
    rows = {}
    shoal_f32_model, rows["shoal f32"] = _shoal_side(False)
    _, rows["shoal amp"] = _shoal_side(True)
    if with_torch:
        _, rows["torch f32"] = _torch_side(False, shoal_f32_model)
        _, rows["torch amp"] = _torch_side(True, shoal_f32_model)
    times: dict[str, list[float]] = {k: [] for k in rows}
    losses: dict[str, float] = {}
    for i in range(warmup + iters):
        for name, step in rows.items():
            t0 = time.perf_counter()
            losses[name] = step()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"MLP {'-'.join(map(str, SIZES))}, batch {BATCH}, SGD momentum, one thread; "
          f"{iters} steps per row after {warmup} warm-up, rows alternated")
    print(f"{'row':<10} {'median ms':>10} {'p10-p90 ms':>16} {'peak RSS +MiB':>14} {'last loss':>10}")
    for name in rows:
        v = sorted(t * 1e3 for t in times[name])
        spread = f"{v[len(v) // 10]:.1f}-{v[(len(v) * 9) // 10 - 1 if len(v) > 1 else 0]:.1f}"
        side, mode = name.split()
        mem = _peak_memory(side, mode == "amp", 3)
        mem_s = "n/a" if mem is None else f"{mem:.1f}"
        print(f"{name:<10} {med[name]:>10.1f} {spread:>16} {mem_s:>14} {losses[name]:>10.4f}")
        print(json.dumps({"row": name, "median_ms": round(med[name], 2), "peak_rss_growth_mib": mem,
                          "iters": iters}))
    print(f"shoal amp / shoal f32: {med['shoal amp'] / med['shoal f32']:.2f}x "
          "(numpy has no bf16 BLAS: ml_dtypes' loops run the bf16 matmuls)")
    if with_torch:
        print(f"torch amp / torch f32: {med['torch amp'] / med['torch f32']:.2f}x")
        print(f"shoal f32 / torch f32: {med['shoal f32'] / med['torch f32']:.2f}x; "
              f"shoal amp / torch amp: {med['shoal amp'] / med['torch amp']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", action="store_true", help="run torch's CPU autocast too")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--child", choices=("shoal", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--amp", dest="amp", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--f32", dest="amp", action="store_false", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.amp, args.iters)
        return
    with_torch = args.compare
    if with_torch:
        try:
            import torch  # noqa: F401, PLC0415
        except ImportError:
            print("torch is not installed: shoal rows only")
            with_torch = False
    compare(args.iters, args.warmup, with_torch)


if __name__ == "__main__":
    main()
