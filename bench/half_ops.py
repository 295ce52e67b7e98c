"""Elementwise ops on bfloat16 and float16 next to float32: forward plus backward, per op.

Each op runs on a (1536, 576) tensor, the size of the main job GPT's feed-forward activation
(batch 24 x context 64 rows, 4 x 144 features), with a gradient of ones flowing back. core
computes 16-bit elementwise ops in float32 and rounds once (core/ops/_opmath.py); this shows
what that costs next to float32, and (--compare) next to torch's CPU kernels for the same op
and dtype. One thread; the dtypes (and libraries) alternate call by call; medians of CPU time.

    python bench/half_ops.py --compare --iters 15
    python bench/half_ops.py --ops tanh gelu_tanh linear
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from shoal import core  # noqa: E402
from shoal.core.nn import functional as F  # noqa: E402

SHAPE = (24 * 64, 4 * 144)
DTYPES = ("float32", "bfloat16", "float16")


def _ops(nn_functional):
    """name -> fn(a, b, w) for either library (the same spelling works on both)."""
    return {
        "tanh": lambda a, b, w: a.tanh(),
        "sigmoid": lambda a, b, w: a.sigmoid(),
        "exp": lambda a, b, w: (a * 0.1).exp(),
        "relu": lambda a, b, w: a.relu(),
        "gelu_tanh": lambda a, b, w: nn_functional.gelu(a, approximate="tanh"),
        "gelu": lambda a, b, w: nn_functional.gelu(a),
        "add": lambda a, b, w: a + b,
        "mul": lambda a, b, w: a * b,
        "div": lambda a, b, w: a / (b.abs() + 1),
        "bias_add": lambda a, b, w: a + b[0],
        "dropout": lambda a, b, w: nn_functional.dropout(a, 0.1),
        "mse_loss": lambda a, b, w: nn_functional.mse_loss(a, b),
        "linear": lambda a, b, w: nn_functional.linear(a, w),
    }


def _case(lib, dtype: str, fn, data):
    """A callable running fn forward and backward once on fresh leaves of `dtype`."""
    a_np, b_np, w_np = data
    if lib is core:
        dt = getattr(core, dtype)
        a = core.tensor(a_np, dtype=dt, requires_grad=True)
        b = core.tensor(b_np, dtype=dt, requires_grad=True)
        w = core.tensor(w_np, dtype=dt, requires_grad=True)
    else:
        dt = getattr(lib, dtype)
        a, b, w = (lib.tensor(v, dtype=dt, requires_grad=True) for v in (a_np, b_np, w_np))

    def run() -> None:
        a.grad = b.grad = w.grad = None
        out = fn(a, b, w)
        out.backward(lib.ones(out.shape, dtype=out.dtype))

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", action="store_true", help="time torch's CPU kernels too")
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--ops", nargs="+", help="a subset of the ops (default: all)")
    args = parser.parse_args()
    if args.iters < 1:
        parser.error(f"--iters must be at least 1, got {args.iters}")
    core.retain_freed_memory()
    libs = {"shoal": (core, F)}
    if args.compare:
        import torch

        torch.set_num_threads(1)
        libs["torch"] = (torch, torch.nn.functional)
    rng = np.random.default_rng(0)
    data = (rng.standard_normal(SHAPE), rng.standard_normal(SHAPE),
            rng.standard_normal((SHAPE[1], SHAPE[1])) * 0.05)
    names = args.ops or list(_ops(F))
    unknown = sorted(set(names) - set(_ops(F)))
    if unknown:
        parser.error(f"--ops: unknown {unknown}; choose from {sorted(_ops(F))}")
    print(f"forward + backward on {SHAPE}, one thread, median CPU ms of {args.iters} "
          "(after one warm-up), rows alternated")
    header = "".join(f"{lib + ' ' + dt:>16}" for lib in libs for dt in DTYPES)
    print(f"{'op':<10}{header}")
    for name in names:
        rows = {(lib, dt): _case(mod, dt, _ops(fn_ns)[name], data)
                for lib, (mod, fn_ns) in libs.items() for dt in DTYPES}
        times: dict = {key: [] for key in rows}
        for i in range(args.iters + 1):
            for key, run in rows.items():
                t0 = time.process_time()
                run()
                if i:
                    times[key].append(time.process_time() - t0)
        med = {key: statistics.median(v) * 1e3 for key, v in times.items()}
        print(f"{name:<10}" + "".join(f"{med[key]:>16.2f}" for key in rows))
        print(json.dumps({"bench": "half_ops", "op": name, "shape": list(SHAPE),
                          "median_cpu_ms": {f"{lib} {dt}": round(med[(lib, dt)], 3)
                                            for lib, dt in rows}}))


if __name__ == "__main__":
    main()
