"""An unchanged PyTorch DDP script (examples/torch/ddp.py, gloo) launched by `shoal run` and by
torchrun: wall time from launch to the launcher's exit, 2 workers on one node.

    python bench/torch_scripts.py                 # 6 trials each, torchrun beside shoal run
    python bench/torch_scripts.py --trials 3 --no-compare

Both launchers run the same file with the same arguments (`--standalone --nproc-per-node 2
--max-restarts 0`), alternating trial by trial (A B A B). The script's own work (importing
torch twice, 20 DDP steps of a small MLP) dominates; the difference is the launcher's: its start,
its rendezvous, the store torch's client talks to (shoal's store door, torchrun's TCPStore) and
its exit. OMP_NUM_THREADS=1 for both.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "torch" / "ddp.py")
ARGS = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0", SCRIPT, "--steps", "20"]
PEERS = {
    "shoal run": [sys.executable, "-m", "shoal.launcher", "run"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}
TRIAL_TIMEOUT_S = 300


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def trial(peer: str) -> dict:
    """One launch of the script by `peer`: its wall time and exit status."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    started = time.perf_counter()
    done = subprocess.run(PEERS[peer] + ARGS, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TRIAL_TIMEOUT_S)
    took = time.perf_counter() - started
    ok = done.returncode == 0 and "ddp done: 2 ranks" in done.stdout + done.stderr
    return {"seconds": took if ok else None, "exit": done.returncode,
            "tail": (done.stdout + done.stderr)[-2000:]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--compare", dest="compare", action="store_true", default=None,
                        help="run torchrun too (the default; torch is needed for the script)")
    parser.add_argument("--no-compare", dest="compare", action="store_false")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("torch") is None:
        print("torch is not installed: the script is a torch script (pip install torch==2.13.0)")
        return 1
    # From bytecode, as an installed package starts (bench/startup_cache.py says why).
    sys.path.append(str(Path(__file__).resolve().parent))
    from startup_cache import compile_sources

    compile_sources()
    peers = list(PEERS) if args.compare in (None, True) else ["shoal run"]
    print(f"cpu: {_cpu_model()}; {os.cpu_count()} cores; script: {SCRIPT} --steps 20, 2 workers")
    times: dict[str, list[float]] = {p: [] for p in peers}
    for i in range(args.trials):
        for peer in peers:  # alternate the peers trial by trial
            result = trial(peer)
            if result["seconds"] is None:
                print(f"trial {i + 1} {peer}: FAILED (exit {result['exit']})\n{result['tail']}")
                continue
            times[peer].append(result["seconds"])
            print(f"trial {i + 1:2d} {peer:10s} {result['seconds']:.2f}s", flush=True)
    print(f"\n{'peer':10s} {'launch->exit s, median (min-max)':>36s} {'ok':>6s}")
    rows = []
    for peer in peers:
        ts = times[peer]
        row = {"bench": "torch_scripts", "peer": peer, "workers": 2, "trials": args.trials,
               "ok": len(ts), "launch_to_exit_s": {
                   "median": statistics.median(ts) if ts else None,
                   "min": min(ts) if ts else None, "max": max(ts) if ts else None}}
        rows.append(row)
        stats = row["launch_to_exit_s"]
        shown = (f"{stats['median']:.2f} ({stats['min']:.2f}-{stats['max']:.2f})"
                 if ts else "n/a")
        print(f"{peer:10s} {shown:>36s} {len(ts):>3d}/{args.trials}")
    if len(peers) == 2 and times["shoal run"] and times["torchrun"]:
        ratio = statistics.median(times["shoal run"]) / statistics.median(times["torchrun"])
        print(f"ratio shoal run/torchrun launch_to_exit_s: {ratio:.2f}")
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
