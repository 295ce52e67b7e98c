"""core.func and core.linalg next to torch.func and torch.linalg on the same shapes.

Rows: per-sample gradients of an MLP 784-256-10 (batch 64, float32, cross-entropy) by
vmap(grad(loss)) over functional_call (the headline figure for core.func, target <= 1.5x
torch.func), the Jacobian of that MLP's logits by jacrev, and 512 x 512 float32 svd and eigh (the
headline figures for core.linalg, target <= 1.2x torch: numpy's LAPACK against torch's), with
inv, qr and cholesky beside them. One thread each; the libraries alternate call by call; medians
of wall time, with the interquartile range in the JSON lines. The machine's CPU and a 64 MiB
memcpy are printed first, since ratios are what compare across machines.

    python bench/func_linalg.py --compare --iters 15
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from shoal import core  # noqa: E402

SIZES = (784, 256, 10)
BATCH = 64
N = 512


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _memcpy_gbps() -> float:
    src = np.ones(64 * 2**20, dtype=np.uint8)
    dst = np.empty_like(src)
    return src.nbytes / min(_timed(lambda: np.copyto(dst, src)) for _ in range(5)) / 1e9


def _data() -> dict:
    rng = np.random.default_rng(0)
    weights = {}
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        weights[f"{2 * i}.weight"] = (rng.standard_normal((b, a)) / np.sqrt(a)).astype(np.float32)
        weights[f"{2 * i}.bias"] = np.zeros(b, np.float32)
    m = rng.standard_normal((N, N)).astype(np.float32)
    return {
        "weights": weights,
        "x": rng.standard_normal((BATCH, SIZES[0])).astype(np.float32),
        "y": rng.integers(0, SIZES[-1], BATCH),
        "matrix": m,
        "symmetric": (m + m.T) / 2,
        "spd": (m @ m.T / N + np.eye(N)).astype(np.float32),
    }


def _model(nn) -> object:
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _cases(lib, func, data: dict) -> dict:
    """name -> a zero-argument callable; the same spelling runs on core and on torch."""
    model = _model(lib.nn)
    params = {k: lib.tensor(v) for k, v in data["weights"].items()}
    x, y = lib.tensor(data["x"]), lib.tensor(data["y"])
    cross_entropy = lib.nn.functional.cross_entropy

    def loss(p, xi, yi):
        return cross_entropy(func.functional_call(model, p, (xi[None],)), yi[None])

    per_sample = func.vmap(func.grad(loss), in_dims=(None, 0, 0))
    logits = func.jacrev(lambda xi: func.functional_call(model, params, (xi,)))
    a, s, spd = (lib.tensor(data[k]) for k in ("matrix", "symmetric", "spd"))
    return {
        "per-sample grads MLP b64": lambda: per_sample(params, x, y),
        "jacrev MLP logits": lambda: logits(x[0]),
        "svd 512 f32": lambda: lib.linalg.svd(a, full_matrices=False),
        "eigh 512 f32": lambda: lib.linalg.eigh(s),
        "inv 512 f32": lambda: lib.linalg.inv(a),
        "qr 512 f32": lambda: lib.linalg.qr(a),
        "cholesky 512 f32": lambda: lib.linalg.cholesky(spd),
    }


def _quartiles(values: list) -> tuple:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0] * 1e3, q[2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", action="store_true", help="time torch.func/linalg too")
    parser.add_argument("--iters", type=int, default=15)
    args = parser.parse_args()
    if args.iters < 1:
        parser.error(f"--iters must be at least 1, got {args.iters}")
    data = _data()
    libs = {"shoal": _cases(core, core.func, data)}
    if args.compare:
        import torch

        torch.set_num_threads(1)
        libs["torch"] = _cases(torch, torch.func, data)
    print(f"cpu: {_cpu_model()}; memcpy 64 MiB: {_memcpy_gbps():.1f} GB/s; one thread; "
          f"median wall ms of {args.iters} (after one warm-up), libraries alternated")
    print(f"{'case':<28}" + "".join(f"{name:>10}" for name in libs)
          + ("     ratio" if args.compare else ""))
    for case in libs["shoal"]:
        times: dict = {name: [] for name in libs}
        for i in range(args.iters + 1):
            for name, cases in libs.items():
                spent = _timed(cases[case])
                if i:
                    times[name].append(spent)
        med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        row = f"{case:<28}" + "".join(f"{med[name]:>10.2f}" for name in libs)
        record = {"bench": "func_linalg", "case": case,
                  "median_ms": {k: round(v, 3) for k, v in med.items()},
                  "iqr_ms": {k: [round(q, 3) for q in _quartiles(v)] for k, v in times.items()}}
        if args.compare:
            ratio = med["shoal"] / med["torch"]
            row += f"{ratio:>10.2f}"
            record["ratio_vs_torch"] = round(ratio, 3)
        print(row)
        print(json.dumps(record))


if __name__ == "__main__":
    main()
