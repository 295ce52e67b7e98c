"""Elastic launcher: launch to first allreduce, and a worker's death to the group's first
allreduce after the restart, with 2 workers; `shoal run` next to torchrun (c10d rendezvous).

    python bench/elastic.py                 # 20 trials each, torchrun too when torch is installed
    python bench/elastic.py --trials 5 --no-compare

Each trial launches one job of 2 workers on an embedded rendezvous (shoal: `shoal run
--standalone`; torchrun: `--rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:0`, what its
--standalone uses). Every worker records when its first allreduce returned. On the first
attempt rank 1 then records the time and SIGKILLs itself while rank 0 keeps calling allreduce;
the launcher restarts the group, and the restarted workers record their first allreduce again.

- launch to first allreduce: from just before the launcher process is spawned to the moment
  the last rank's first allreduce returned.
- death to resumed: from rank 1's SIGKILL to the last rank's first allreduce of the next
  attempt that got that far.
- first restart ok: the first restart (attempt 1) reached its allreduce on both ranks and the
  job then exited 0. torchrun 2.13's restarted group often reuses the dead attempt's store
  entries and fails; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 avoids that (PEERS.md), so torchrun
  runs both ways. The peers alternate trial by trial (A B C A B C ...).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as `python bench/elastic.py`, this file's folder comes first on sys.path and its name would
# shadow the `elastic` package for anything the workers import.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(ROOT)
VICTIM = 1
TRIAL_TIMEOUT_S = 60.0
ALLREDUCE_TIMEOUT_S = 20.0


# ----------------------------------------------------------------------------- workers

def _record(out: str, attempt: int, rank: int, **fields) -> None:
    path = os.path.join(out, f"attempt{attempt}_rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(fields, f)
    os.replace(path + ".tmp", path)


def _die(out: str, attempt: int, rank: int) -> None:
    # Die only once every other rank has recorded its first allreduce: SIGKILL right after
    # our own allreduce could otherwise reset the connection before a peer read our data.
    others = [os.path.join(out, f"attempt{attempt}_rank{r}.json") for r in range(2) if r != rank]
    deadline = time.monotonic() + 10
    while not all(os.path.exists(p) for p in others) and time.monotonic() < deadline:
        time.sleep(0.001)
    with open(os.path.join(out, f"died_rank{rank}.json.tmp"), "w") as f:
        json.dump({"died": time.time(), "attempt": attempt}, f)
    os.replace(os.path.join(out, f"died_rank{rank}.json.tmp"),
               os.path.join(out, f"died_rank{rank}.json"))
    os.kill(os.getpid(), signal.SIGKILL)


def shoal_worker(out: str) -> int:
    started = time.time()
    import numpy as np

    from shoal import collectives
    from shoal.core import settings as core_settings

    imported = time.time()
    collectives.init_process_group("tcp", init_method="env://", timeout=ALLREDUCE_TIMEOUT_S)
    joined = time.time()
    rank = collectives.get_rank()
    attempt = core_settings.RESTART_COUNT.get()
    x = np.ones(1024, dtype=np.float32)
    collectives.all_reduce(x)
    _record(out, attempt, rank, first=time.time(), sum=float(x[0]), started=started,
            imported=imported, joined=joined)
    if attempt == 0:
        if rank == VICTIM:
            _die(out, attempt, rank)
        while True:  # keep the group busy: the victim's death must surface here
            collectives.all_reduce(x)
            time.sleep(0.005)
    collectives.destroy_process_group()
    return 0


def torch_worker(out: str) -> int:
    started = time.time()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    imported = time.time()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=ALLREDUCE_TIMEOUT_S))
    joined = time.time()
    rank = dist.get_rank()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    x = torch.ones(1024)
    dist.all_reduce(x)
    _record(out, attempt, rank, first=time.time(), sum=float(x[0]), started=started,
            imported=imported, joined=joined)
    if attempt == 0:
        if rank == VICTIM:
            _die(out, attempt, rank)
        while True:
            dist.all_reduce(x)
            time.sleep(0.005)
    dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------- trials

PEERS = {
    "shoal run": lambda out: (
        [sys.executable, "-m", "shoal.launcher", "run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "3", __file__, "--worker", "shoal", "--out", out], {}),
    "torchrun c10d": lambda out: (
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
         "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--max-restarts=3",
         __file__, "--worker", "torch", "--out", out], {}),
    "torchrun c10d, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1": lambda out: (
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
         "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--max-restarts=3",
         __file__, "--worker", "torch", "--out", out],
        {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
}


def _load(out: str) -> tuple[dict, float | None]:
    records: dict = {}
    for path in Path(out).glob("attempt*_rank*.json"):
        attempt, rank = path.stem[len("attempt"):].split("_rank")
        records.setdefault(int(attempt), {})[int(rank)] = json.loads(path.read_text())
    died = Path(out) / f"died_rank{VICTIM}.json"
    return records, (json.loads(died.read_text())["died"] if died.exists() else None)


def trial(peer: str) -> dict:
    """Run one job; return its timings (None where the job never got there) and outcome."""
    with tempfile.TemporaryDirectory(prefix="shoal-bench-elastic-") as out:
        argv, extra = PEERS[peer](out)
        # Late, as in the workers: this module's own import stays free of shoal, whose import
        # time the shoal worker measures.
        from shoal.core import settings as core_settings

        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                   TP_SOCKET_IFNAME="lo", **extra)
        env[core_settings.LOG_LEVEL.name] = "WARNING"
        env.setdefault(core_settings.AUTH_TOKEN.name, "bench-elastic-token")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        launched = time.time()
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True, text=True,
                                errors="replace")
        try:
            _, err = proc.communicate(timeout=TRIAL_TIMEOUT_S)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            code = None
        records, died = _load(out)
    first = records.get(0, {})
    launch = (max(r["first"] for r in first.values()) - launched
              if len(first) == 2 and all("first" in r for r in first.values()) else None)
    resumed = None
    for attempt in sorted(a for a in records if a > 0):
        ranks = records[attempt]
        if len(ranks) == 2 and all("first" in r for r in ranks.values()):
            resumed = max(r["first"] for r in ranks.values()) - died if died else None
            break
    restarted = records.get(1, {})
    first_ok = (code == 0 and len(restarted) == 2
                and all("first" in r for r in restarted.values()))
    phases = {}
    for attempt, ranks in records.items():
        base = launched if attempt == 0 else died
        if base is None:
            continue
        phases[attempt] = {
            key: round(max(r[key] for r in ranks.values()) - base, 3)
            for key in ("started", "imported", "joined", "first")
            if ranks and all(key in r for r in ranks.values())
        }
    return {"launch": launch, "resumed": resumed, "first_restart_ok": first_ok, "exit": code,
            "attempts": len(records), "phases": phases, "stderr_tail": (err or "")[-2000:]}


def _stats(values: list) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def _fmt(stats: dict) -> str:
    if stats["median"] is None:
        return "n/a"
    return f"{stats['median']:.3f} ({stats['min']:.2f}-{stats['max']:.2f})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--compare", dest="compare", action="store_true", default=None,
                        help="run torchrun too (the default when torch is installed)")
    parser.add_argument("--no-compare", dest="compare", action="store_false")
    parser.add_argument("--worker", choices=["shoal", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--verbose", action="store_true", help="print failed trials' stderr")
    args = parser.parse_args(argv)
    if args.worker == "shoal":
        return shoal_worker(args.out)
    if args.worker == "torch":
        return torch_worker(args.out)

    if args.compare is None:
        try:
            import importlib.util
            args.compare = importlib.util.find_spec("torch") is not None
        except ValueError:
            args.compare = False
    # From bytecode, as an installed package starts (bench/startup_cache.py says why).
    sys.path.append(str(Path(__file__).resolve().parent))
    from startup_cache import compile_sources

    compile_sources()
    peers = list(PEERS) if args.compare else ["shoal run"]
    results: dict[str, list[dict]] = {p: [] for p in peers}
    for i in range(args.trials):
        for peer in peers:  # alternate the peers trial by trial
            result = trial(peer)
            results[peer].append(result)
            print(f"trial {i + 1:2d} {peer:52s} launch {result['launch'] or float('nan'):.3f}s "
                  f"resumed {result['resumed'] or float('nan'):.3f}s "
                  f"first restart {'ok' if result['first_restart_ok'] else 'FAILED'} "
                  f"(exit {result['exit']}, attempts {result['attempts']})", flush=True)
            if args.verbose:
                print(f"    phases (s after launch / death): {result['phases']}", flush=True)
                if not result["first_restart_ok"]:
                    print(result["stderr_tail"], flush=True)

    rows = []
    for peer in peers:
        rs = results[peer]
        rows.append({
            "bench": "elastic", "peer": peer, "workers": 2, "trials": len(rs),
            "launch_to_first_allreduce_s": _stats([r["launch"] for r in rs]),
            "death_to_resumed_s": _stats([r["resumed"] for r in rs]),
            "first_restart_ok": sum(r["first_restart_ok"] for r in rs),
        })
    print()
    print(f"{'peer':52s} {'launch->1st allreduce s':>26s} {'death->resumed s':>26s} "
          f"{'1st restart ok':>15s}")
    for row in rows:
        print(f"{row['peer']:52s} {_fmt(row['launch_to_first_allreduce_s']):>26s} "
              f"{_fmt(row['death_to_resumed_s']):>26s} "
              f"{row['first_restart_ok']:>8d} of {row['trials']:<3d}")
    base = rows[0]
    for row in rows[1:]:
        for key in ("launch_to_first_allreduce_s", "death_to_resumed_s"):
            a, b = base[key]["median"], row[key]["median"]
            if a and b:
                print(f"ratio shoal/{row['peer']} {key}: {a / b:.2f}")
    print("medians (min-max) over trials; death->resumed counts trials that resumed at all")
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
