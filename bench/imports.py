"""What each entry point costs to import, in fresh interpreters: shoal next to torch's peers.

    python bench/imports.py                 # 15 interpreters per row, torch too when installed
    python bench/imports.py --runs 30 --no-compare

Each row runs `python -X importtime -c CODE` in a fresh interpreter, alternating the rows run by
run (A B C A B C ...), and reads the cumulative import time of the code's modules (what
`-X importtime` reports, in ms; the interpreter's own start is not counted) and the process's
CPU time (start included). Rows:

- launcher: `import shoal.launcher.cli` (parses `shoal run`'s flags), next to torchrun's
  `import torch.distributed.run`;
- worker: what a `shoal run` worker imports before its first all_reduce (collectives, its
  process-group API and the tcp backend), next to `import torch, torch.distributed`;
- core: `import shoal.core` and its torch-like namespace (`core.Tensor`), next to `import torch`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHOAL_ROWS = {
    "launcher": ["shoal.launcher.cli"],
    "worker": ["shoal.collectives", "shoal.collectives.distributed",
               "shoal.collectives.backends.tcp.group"],
    "core": ["shoal.core", "shoal.core._namespace"],
}
TORCH_ROWS = {
    "launcher": ["torch.distributed.run"],
    "worker": ["torch", "torch.distributed"],
    "core": ["torch"],
}


def _one(modules: list[str]) -> tuple[float, float]:
    """(cumulative -X importtime ms of `modules`, process CPU ms) of one fresh interpreter."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c",
                           "; ".join(f"import {m}" for m in modules)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_ms = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1000
    total_us, started = 0, False
    for line in proc.stderr.splitlines():
        parts = line.split("|")
        if len(parts) != 3 or not parts[1].strip().isdigit():
            continue
        name = parts[2][1:]
        if name.startswith(" "):
            continue  # nested: counted in its top-level entry's cumulative time
        if started:
            total_us += int(parts[1])
        # The interpreter's start imports `site` last; what follows is the -c code's.
        started = started or name == "site"
    return total_us / 1000, cpu_ms


def _stats(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 1), "min": round(min(values), 1),
            "max": round(max(values), 1), "n": len(values)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--compare", dest="compare", action="store_true", default=None,
                        help="import torch's peers too (the default when torch is installed)")
    parser.add_argument("--no-compare", dest="compare", action="store_false")
    args = parser.parse_args(argv)
    if args.compare is None:
        import importlib.util

        args.compare = importlib.util.find_spec("torch") is not None
    # From bytecode, as an installed package starts (bench/startup_cache.py says why).
    sys.path.append(str(Path(__file__).resolve().parent))
    from startup_cache import compile_sources

    compile_sources()
    rows = {("shoal", k): v for k, v in SHOAL_ROWS.items()}
    if args.compare:
        rows.update({("torch", k): v for k, v in TORCH_ROWS.items()})
    samples: dict = {key: ([], []) for key in rows}
    for _ in range(args.runs):
        for key, modules in rows.items():
            imported, cpu = _one(modules)
            samples[key][0].append(imported)
            samples[key][1].append(cpu)
    print(f"python {platform.python_version()}; {os.cpu_count()} cpus; load average "
          f"{os.getloadavg()[0]:.1f}; medians (min-max) of {args.runs} fresh interpreters")
    print(f"{'row':10s} {'side':6s} {'import ms':>22s} {'process cpu ms':>22s}  modules")
    out = []
    for (side, row), modules in rows.items():
        imported, cpu = (_stats(v) for v in samples[(side, row)])
        print(f"{row:10s} {side:6s} {imported['median']:8.1f} ({imported['min']:.0f}-"
              f"{imported['max']:.0f}) {cpu['median']:10.1f} ({cpu['min']:.0f}-{cpu['max']:.0f})"
              f"  {', '.join(modules)}")
        out.append({"bench": "imports", "row": row, "side": side, "modules": modules,
                    "import_ms": imported, "process_cpu_ms": cpu})
    if args.compare:
        for row in SHOAL_ROWS:
            a = samples[("shoal", row)][0]
            b = samples[("torch", row)][0]
            print(f"ratio shoal/torch {row} import: {statistics.median(a) / statistics.median(b):.3f}")
    for row in out:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
