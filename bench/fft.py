"""core.fft next to torch.fft: a 2**20-point FFT (the headline figure) and a few neighbours.

Rows: fft of complex64 and of float32 input, ifft, rfft and irfft of 2**20 points, a 1024 x 1024
fft2, and rfft -> filter -> irfft forward plus backward. core computes on scipy.fft (pocketfft);
torch's CPU build on its own FFT library. One thread each; the libraries alternate call by call;
medians of wall time. The machine's CPU and a 64 MiB memcpy are printed first, since ratios are
what compare across machines.

    python bench/fft.py --compare --iters 20
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

N = 2**20


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memcpy_gbps() -> float:
    src = np.ones(64 * 2**20, dtype=np.uint8)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
    return src.nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _cases(lib, fft) -> dict:
    """name -> a zero-argument callable for either library (the same spelling works on both)."""
    rng = np.random.default_rng(0)
    real = rng.standard_normal(N).astype(np.float32)
    cplx = (real + 1j * rng.standard_normal(N)).astype(np.complex64)
    image = (rng.standard_normal((1024, 1024)) + 0j).astype(np.complex64)
    x_real, x_cplx, x_image = lib.tensor(real), lib.tensor(cplx), lib.tensor(image)
    half = fft.rfft(x_real)
    filt = lib.tensor(rng.standard_normal(N // 2 + 1).astype(np.complex64), requires_grad=True)

    def filtered() -> None:
        filt.grad = None
        out = fft.irfft(fft.rfft(x_real) * filt, n=N)
        (out * out).sum().backward()

    return {
        "fft c64 2^20": lambda: fft.fft(x_cplx),
        "fft f32 2^20": lambda: fft.fft(x_real),
        "ifft c64 2^20": lambda: fft.ifft(x_cplx),
        "rfft f32 2^20": lambda: fft.rfft(x_real),
        "irfft 2^20": lambda: fft.irfft(half, n=N),
        "fft2 c64 1024^2": lambda: fft.fft2(x_image),
        "rfft-filter-irfft fwd+bwd": filtered,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", action="store_true", help="time torch.fft too")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if args.iters < 1:
        parser.error(f"--iters must be at least 1, got {args.iters}")
    libs = {"shoal": _cases(core, core.fft)}
    if args.compare:
        import torch

        torch.set_num_threads(1)
        libs["torch"] = _cases(torch, torch.fft)
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
        record = {"bench": "fft", "case": case, "median_ms": {k: round(v, 3) for k, v in med.items()}}
        if args.compare:
            ratio = med["shoal"] / med["torch"]
            row += f"{ratio:>10.2f}"
            record["ratio_vs_torch"] = round(ratio, 3)
        print(row)
        print(json.dumps(record))


if __name__ == "__main__":
    main()
