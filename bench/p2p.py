"""Batched point-to-point and all_to_all: shoal's tcp backend next to torch's gloo, same run.

Cases, at W = 2 and 4, of 4 KiB, 4 MiB and 64 MiB per rank:
- batch_isend_irecv: every rank sends its array to the next rank and receives the previous
  rank's into another (a ring shift, the pipeline-parallel pattern), as one batch;
- all_to_all: every rank's array cut into W equal blocks, block q to rank q;
- shift_stream: STREAM ring shifts back to back with no barrier between them (a pipeline's
  steady stream, where a receiver may still be copying one message as the next is sent); its
  time is per shift;
- isend_irecv: the same shift as torch users often write it, a plain isend and irecv, then
  wait on both (no batch).

Each iteration starts after a barrier and is timed as the slowest rank's time; medians over
iterations. Both sides' ranks run at once and the parent alternates blocks of iterations
between them (A B A B) while the other side sleeps; the table also gives the median of the
per-iteration ratios of paired blocks. Each run prints the CPU model and a memcpy of 64 MiB,
the copy floor of the largest cases.

Target: shoal's time <= gloo's / 2 (speedup >= 2x) at W = 2 and 4.

    python bench/p2p.py                 # full run, gloo beside it when torch is installed
    python bench/p2p.py --quick         # fewer iterations
    python bench/p2p.py --no-compare    # shoal only
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
import secrets  # noqa: E402

from shoal.collectives import settings as collective_settings  # noqa: E402
from shoal.core import settings as core_settings  # noqa: E402  (after the thread limits)

if not core_settings.AUTH_TOKEN.is_set():
    os.environ[core_settings.AUTH_TOKEN.name] = secrets.token_hex(16)  # the ranks inherit it

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

KiB = 1024
MiB = 1024 * 1024
SIZES = (4 * KiB, 4 * MiB, 64 * MiB)
OPS = ("batch_isend_irecv", "all_to_all", "shift_stream", "isend_irecv")
STREAM = 8  # shifts per timed shift_stream iteration
CTX = multiprocessing.get_context("spawn")


def _iterations(nbytes: int, quick: bool) -> int:
    n = 300 if nbytes <= 4 * KiB else 40 if nbytes <= 4 * MiB else 12
    return max(4, n // 4) if quick else n


def _fmt(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def _case(api, x, empty_like, op: str, rank: int, world: int):
    """A callable running one iteration of `op` on `api`'s default group (shoal.collectives or
    torch.distributed: the same names, the same calls) with the array `x` of this rank;
    `empty_like` makes an output like an array (numpy's or torch's)."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    if op == "isend_irecv":
        y = empty_like(x)

        def run():
            sent, received = api.isend(x, nxt), api.irecv(y, prv)
            sent.wait()
            received.wait()
        return run
    if op in ("batch_isend_irecv", "shift_stream"):
        y = empty_like(x)
        shifts = STREAM if op == "shift_stream" else 1

        def run():
            for _ in range(shifts):
                ops = [api.P2POp(api.isend, x, nxt), api.P2POp(api.irecv, y, prv)]
                for work in api.batch_isend_irecv(ops):
                    work.wait()
        return run
    ins = list(x.reshape(world, -1))
    outs = [empty_like(b) for b in ins]
    return lambda: api.all_to_all(outs, ins)


def _worker(side, rank, world, port, commands, out):
    """One rank of one side: forms its group, then runs blocks of iterations when told."""
    try:
        if side == "gloo":
            import torch
            import torch.distributed as dist

            torch.set_num_threads(1)
            store = dist.TCPStore("127.0.0.1", port, world, False)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
            make = lambda op, n: _case(dist, torch.ones(n), torch.empty_like,  # noqa: E731
                                       op, rank, world)
            barrier, finish = dist.barrier, dist.destroy_process_group
        else:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                              WORLD_SIZE=str(world))
            os.environ[collective_settings.USE_AGENT_STORE.name] = "1"
            import shoal.collectives as c

            c.init_process_group("tcp", init_method="env://", timeout=300)
            make = lambda op, n: _case(c, np.ones(n, np.float32), np.empty_like,  # noqa: E731
                                       op, rank, world)
            barrier, finish = c.barrier, c.destroy_process_group
        out.put((side, rank, "ready", None))
        runners = {}
        while True:
            command = commands.get()
            if command is None:
                break
            (op, nbytes), count = command
            if (op, nbytes) not in runners:
                runners[(op, nbytes)] = make(op, nbytes // 4)
                for _ in range(3):
                    runners[(op, nbytes)]()
            run = runners[(op, nbytes)]
            per_call = STREAM if op == "shift_stream" else 1  # shifts per timed call
            barrier()
            run()  # untimed: the other side's block has just evicted this side's caches
            ts = []
            for _ in range(count):
                barrier()
                t0 = time.perf_counter()
                run()
                ts.append((time.perf_counter() - t0) / per_call)
            out.put((side, rank, "times", ts))
        finish()
    except BaseException as exc:
        out.put((side, rank, "error", f"{type(exc).__name__}: {exc}"))
        raise


def _start(side: str, world: int, out):
    """(store, processes, command queues) of one side's ranks."""
    if side == "gloo":
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False)
    else:
        from shoal.collectives.store.tcp import TCPStore

        store = TCPStore("127.0.0.1", 0, world_size=world, is_master=True, timeout=300,
                         wait_for_workers=False)
    commands = [CTX.Queue() for _ in range(world)]
    procs = [CTX.Process(target=_worker, args=(side, r, world, store.port, commands[r], out))
             for r in range(world)]
    for p in procs:
        p.start()
    return store, procs, commands


def _session(sides: list, world: int, cases: list, quick: bool, blocks: int) -> dict:
    """case -> side -> the slowest rank's time of each iteration, sides alternating by block."""
    out = CTX.Queue()
    started = {side: _start(side, world, out) for side in sides}

    def collect(kind: str, count: int) -> list:
        got = []
        while len(got) < count:
            side, rank, what, value = out.get(timeout=900)
            if what == "error":
                raise SystemExit(f"{side} rank {rank} failed: {value}")
            if what == kind:
                got.append((side, rank, value))
        return got

    results = {}
    try:
        collect("ready", world * len(sides))
        for case in cases:
            per_block = max(1, _iterations(case[1], quick) // blocks)
            results[case] = {side: [] for side in sides}
            for _ in range(blocks):
                for side in sides:
                    for q in started[side][2]:
                        q.put((case, per_block))
                    by_rank = {rank: ts for _s, rank, ts in collect("times", world)}
                    results[case][side] += [max(by_rank[r][i] for r in range(world))
                                            for i in range(per_block)]
        for side in sides:
            for q in started[side][2]:
                q.put(None)
    finally:
        for side in sides:
            store, procs, _ = started[side]
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
            if hasattr(store, "close"):
                store.close()
    return results


def _machine() -> dict:
    """The CPU model and a 64 MiB memcpy (GB/s), printed with every run."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                         model)
    except OSError:
        pass
    a, b = np.ones(16 * MiB, np.float32), np.empty(16 * MiB, np.float32)
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        np.copyto(b, a)
        ts.append(time.perf_counter() - t0)
    return {"cpu": model, "memcpy_64mib_gbps": round(a.nbytes / statistics.median(ts) / 1e9, 2)}


def _rows(samples: dict, sides: list, world: int, cases: list) -> list[dict]:
    rows = []
    for case in cases:
        op, nbytes = case
        row = {"bench": "p2p", "op": op, "world": world, "bytes": nbytes}
        for side in sides:
            ts = samples[case][side]
            q = statistics.quantiles(ts, n=10) if len(ts) >= 10 else [min(ts)] * 9
            row[f"{side}_ms"] = round(statistics.median(ts) * 1e3, 4)
            row[f"{side}_p10_ms"] = round(q[0] * 1e3, 4)
            row[f"{side}_p90_ms"] = round(q[-1] * 1e3, 4)
        if "gloo" in sides:
            row["speedup_vs_gloo"] = round(row["gloo_ms"] / row["shoal_ms"], 2)
            pairs = [g / s for g, s in zip(samples[case]["gloo"], samples[case]["shoal"])]
            row["paired_ratio"] = round(statistics.median(pairs), 2)
        rows.append(row)
    return rows


def _print_table(rows: list[dict], sides: list) -> None:
    header = f"{'op':<18}{'W':>2} {'size':>7}" + "".join(f" | {s + ' ms':>10}" for s in sides)
    if "gloo" in sides:
        header += f" | {'gloo/shoal':>10} {'paired':>6}"
    print()
    print("median time per op (slowest rank); speedup = gloo time / shoal time, paired = "
          "median of per-iteration ratios")
    print(header)
    print("-" * len(header))
    for row in rows:
        line = f"{row['op']:<18}{row['world']:>2} {_fmt(row['bytes']):>7}"
        line += "".join(f" | {row[s + '_ms']:>10.3f}" for s in sides)
        if "gloo" in sides:
            verdict = "" if row["speedup_vs_gloo"] >= 2.0 else "  (target 2x NOT met)"
            line += f" | {row['speedup_vs_gloo']:>9.2f}x {row['paired_ratio']:>5.2f}x{verdict}"
        print(line)


def main(argv=None) -> int:
    """bench/p2p.py's entry point."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer iterations, two blocks")
    parser.add_argument("--compare", dest="compare", action="store_true", default=None,
                        help="run torch gloo side by side (default when torch is installed)")
    parser.add_argument("--no-compare", dest="compare", action="store_false")
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes")
    parser.add_argument("--ops", default=",".join(OPS), help="which ops to run")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes per rank")
    args = parser.parse_args(argv)
    if args.compare is None:
        try:
            import torch.distributed  # noqa: F401
            args.compare = True
        except ImportError:
            args.compare = False
    machine = _machine()
    print(f"cpu: {machine['cpu']}; memcpy 64 MiB: {machine['memcpy_64mib_gbps']} GB/s")
    print(json.dumps({"bench": "p2p", "row": "machine", **machine}))
    sides = ["shoal"] + (["gloo"] if args.compare else [])
    cases = [(op, int(n)) for op in args.ops.split(",") for n in args.sizes.split(",")]
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        samples = _session(sides, world, cases, args.quick, 2 if args.quick else 4)
        rows += _rows(samples, sides, world, cases)
    _print_table(rows, sides)
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
