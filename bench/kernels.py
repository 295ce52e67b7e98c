"""Fused CUDA kernels of core.kernels next to the same computation composed from cupy's ops.

Three cases, float32 on one GPU, each a full step of what training runs:
  adam     AdamW update of N parameters (param, exp_avg, exp_avg_sq in place), step 10;
  ce       softmax cross-entropy forward (loss, log-sum-exp) and backward (mean reduction)
           over (rows, classes) logits;
  gelu     exact (erf) GELU forward and backward over N elements.
The composed side is what one writes with cupy's built-in array operations (a kernel per
operation, temporaries in between); both sides compute the same numbers, and the script checks
that they agree before timing. Timing: cupy.cuda events around each call, A and B alternating
call by call, medians over the iterations and the ratio composed / fused. With torch built for
CUDA installed, torch's own kernels (fused Adam, F.cross_entropy, F.gelu) run as a third column
(--no-compare skips them).

    python bench/kernels.py            # full sizes
    python bench/kernels.py --quick    # smaller sizes, fewer iterations
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import numpy as np

LR, BETA1, BETA2, EPS, WD, STEP = 1e-3, 0.9, 0.999, 1e-8, 0.01, 10


def _cuda_or_exit():
    """cupy with a device, or exit (status 2) with a sentence saying why not."""
    try:
        import cupy as cp
    except ImportError:
        _exit("bench/kernels.py needs a CUDA device; none was found (cupy is not installed: "
              "pip install cupy-cuda12x), so there is nothing to measure here.")
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001  (no driver, no device)
        _exit(f"bench/kernels.py needs a CUDA device; none was found ({exc}).")
    if count < 1:
        _exit("bench/kernels.py needs a CUDA device; none was found (cupy sees 0 devices).")
    return cp


def _exit(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


# ----------------------------------------------------------------------------- the cases

def adam_case(cp, n):
    from shoal.core.kernels import adam_step_cuda

    rng = cp.random.default_rng(0)
    g = rng.standard_normal(n, dtype=cp.float32)
    state = {side: [rng.standard_normal(n, dtype=cp.float32), cp.zeros(n, cp.float32),
                    cp.zeros(n, cp.float32)] for side in ("fused", "composed", "torch")}
    for side in state:  # same start on both sides
        for a, b in zip(state[side], state["fused"]):
            a[...] = b
    step_size = LR / (1 - BETA1 ** STEP)
    bc2 = math.sqrt(1 - BETA2 ** STEP)

    def fused():
        p, m, v = state["fused"]
        adam_step_cuda(p, g, m, v, None, step=STEP, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS,
                       weight_decay=WD, decoupled=True)

    def composed():
        p, m, v = state["composed"]
        p *= 1 - LR * WD
        m += (g - m) * (1 - BETA1)
        v *= BETA2
        v += (1 - BETA2) * g * g
        p -= step_size * m / (cp.sqrt(v) / bc2 + EPS)

    def check():
        fused()
        composed()  # one step each from the same start
        return max(float(cp.abs(a - b).max()) for a, b in zip(state["fused"], state["composed"]))

    return fused, composed, check, _torch_adam(state["torch"], g, n)


def ce_case(cp, rows, classes):
    from shoal.core.kernels import cross_entropy_backward_cuda, cross_entropy_forward_cuda

    rng = cp.random.default_rng(1)
    x = rng.standard_normal((rows, classes), dtype=cp.float32) * 3
    t = rng.integers(0, classes, rows).astype(cp.int64)
    idx = cp.arange(rows)
    out = {}

    def fused():
        loss, lse = cross_entropy_forward_cuda(x, t)
        out["fused"] = (loss, cross_entropy_backward_cuda(x, t, lse, 1.0 / rows))

    def composed():
        m = x.max(axis=1)
        e = cp.exp(x - m[:, None])
        s = e.sum(axis=1)
        lse = cp.log(s) + m
        loss = lse - x[idx, t]
        grad = e / s[:, None]
        grad[idx, t] -= 1
        grad *= 1.0 / rows
        out["composed"] = (loss, grad)

    def check():
        fused()
        composed()
        return max(float(cp.abs(a - b).max()) for a, b in zip(out["fused"], out["composed"]))

    return fused, composed, check, _torch_ce(x, t)


def gelu_case(cp, n):
    import cupyx.scipy.special as special

    from shoal.core.kernels import gelu_backward_cuda, gelu_forward_cuda

    rng = cp.random.default_rng(2)
    x = rng.standard_normal(n, dtype=cp.float32)
    gy = rng.standard_normal(n, dtype=cp.float32)
    out = {}
    inv_sqrt2 = np.float32(1 / math.sqrt(2))
    inv_sqrt_2pi = np.float32(1 / math.sqrt(2 * math.pi))

    def fused():
        out["fused"] = (gelu_forward_cuda(x), gelu_backward_cuda(x, gy))

    def composed():
        cdf = 0.5 * (1 + special.erf(x * inv_sqrt2))
        y = x * cdf
        pdf = cp.exp(-0.5 * x * x) * inv_sqrt_2pi
        out["composed"] = (y, gy * (cdf + x * pdf))

    def check():
        fused()
        composed()
        return max(float(cp.abs(a - b).max()) for a, b in zip(out["fused"], out["composed"]))

    return fused, composed, check, _torch_gelu(x, gy)


# ----------------------------------------------------------------------------- torch peer

def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _as_torch(torch, arr):
    return torch.from_dlpack(arr)


def _torch_adam(state, g, n):
    torch = _torch_cuda()
    if torch is None:
        return None
    p = _as_torch(torch, state[0]).requires_grad_(True)
    p.grad = _as_torch(torch, g)
    opt = torch.optim.AdamW([p], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD, fused=True)

    def run():
        opt.step()

    return run


def _torch_ce(x, t):
    torch = _torch_cuda()
    if torch is None:
        return None
    xt = _as_torch(torch, x).detach().clone().requires_grad_(True)
    tt = _as_torch(torch, t)

    def run():
        xt.grad = None
        torch.nn.functional.cross_entropy(xt, tt).backward()

    return run


def _torch_gelu(x, gy):
    torch = _torch_cuda()
    if torch is None:
        return None
    xt = _as_torch(torch, x).detach().clone().requires_grad_(True)
    gt = _as_torch(torch, gy)

    def run():
        xt.grad = None
        torch.nn.functional.gelu(xt).backward(gt)

    return run


# ----------------------------------------------------------------------------- timing

def time_alternating(cp, fns: dict, iters: int, warmup: int) -> dict:
    """Median milliseconds per call of each fn, calling them in turn (A B C A B C ...)."""
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    cp.cuda.get_current_stream().synchronize()
    samples = {k: [] for k in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples[name].append(cp.cuda.get_elapsed_time(start, end))
    return {k: (statistics.median(v), min(v), max(v)) for k, v in samples.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer iterations")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per side")
    parser.add_argument("--compare", action="store_true",
                        help="run the peers beside shoal (the default; kept for bench/ symmetry)")
    parser.add_argument("--no-compare", "--no_compare", action="store_true",
                        help="skip torch's CUDA kernels even where torch with CUDA is installed")
    args = parser.parse_args(argv)
    cp = _cuda_or_exit()
    iters = args.iters or (20 if args.quick else 100)
    n_param = 1 << (22 if args.quick else 24)
    n_elem = 1 << (22 if args.quick else 26)
    rows, classes = (1024, 8192) if args.quick else (8192, 32000)
    cases = [
        ("adam", f"{n_param} params", lambda: adam_case(cp, n_param)),
        ("ce", f"{rows}x{classes}", lambda: ce_case(cp, rows, classes)),
        ("gelu", f"{n_elem} elems", lambda: gelu_case(cp, n_elem)),
    ]
    device = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    device = device.decode() if isinstance(device, bytes) else device
    print(f"device: {device}; float32; {iters} timed calls per side, alternating; medians")
    rows_out = []
    for name, size, build in cases:
        fused, composed, check, peer = build()
        diff = check()
        fns = {"fused": fused, "composed": composed}
        if peer is not None and not args.no_compare:
            fns["torch"] = peer
        t = time_alternating(cp, fns, iters, warmup=3)
        row = {"bench": "kernels", "case": name, "size": size, "device": device,
               "max_abs_diff": diff,
               "fused_ms": round(t["fused"][0], 4), "composed_ms": round(t["composed"][0], 4),
               "fused_min_max_ms": [round(t["fused"][1], 4), round(t["fused"][2], 4)],
               "composed_min_max_ms": [round(t["composed"][1], 4), round(t["composed"][2], 4)],
               "speedup_vs_composed": round(t["composed"][0] / t["fused"][0], 2)}
        if "torch" in t:
            row["torch_ms"] = round(t["torch"][0], 4)
            row["fused_vs_torch"] = round(t["torch"][0] / t["fused"][0], 2)
        rows_out.append(row)
    header = f"{'case':<6} {'size':>18} | {'fused ms':>9} {'composed ms':>12} {'composed/fused':>15}"
    if any("torch_ms" in r for r in rows_out):
        header += f" | {'torch ms':>9} {'torch/fused':>12}"
    print(header)
    print("-" * len(header))
    for r in rows_out:
        line = (f"{r['case']:<6} {r['size']:>18} | {r['fused_ms']:>9.3f} {r['composed_ms']:>12.3f} "
                f"{r['speedup_vs_composed']:>14.2f}x")
        if "torch_ms" in r:
            line += f" | {r['torch_ms']:>9.3f} {r['fused_vs_torch']:>11.2f}x"
        print(line)
    for r in rows_out:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
