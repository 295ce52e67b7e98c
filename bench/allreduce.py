"""Collectives bandwidth and latency: shoal's tcp backend next to torch's gloo, same run.

allreduce of 4 KiB, 256 KiB, 4 MiB and 64 MiB at W = 2 and 4; broadcast and all_gather at
4 MiB; the raw loopback limit (one TCP stream between two processes) measured in the same run.
Each iteration starts after a barrier and is timed as the slowest rank's time; medians over
iterations. Sessions alternate shoal, gloo, shoal, gloo so drift on a busy machine hits both.

Bandwidth as nccl-tests defines it (GB = 1e9 bytes): algbw = bytes / time; busbw = algbw x
2(W-1)/W for allreduce, algbw for broadcast, algbw x (W-1)/W for all_gather (whose size is the
gathered total). Targets: W=2 busbw at 64 MiB >= 2.5x gloo, at 4 MiB >= 3x; W=4 at 64 MiB >=
2x; 4 KiB latency <= 1/5 of gloo's.

    python bench/allreduce.py                 # full run, gloo beside it when torch is installed
    python bench/allreduce.py --quick         # fewer iterations and rounds
    python bench/allreduce.py --no-compare    # shoal only
    python bench/allreduce.py --backend nccl  # shoal's nccl backend (needs a CUDA device)
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
if not os.environ.get("SHOAL_AUTH_TOKEN"):
    import secrets

    os.environ["SHOAL_AUTH_TOKEN"] = secrets.token_hex(16)  # the ranks inherit it

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

KiB = 1024
MiB = 1024 * 1024
ALLREDUCE_SIZES = (4 * KiB, 256 * KiB, 4 * MiB, 64 * MiB)
CASES = [("all_reduce", n) for n in ALLREDUCE_SIZES] + [("broadcast", 4 * MiB), ("all_gather", 4 * MiB)]
CTX = multiprocessing.get_context("spawn")


def iterations(nbytes: int, quick: bool) -> int:
    if nbytes <= 4 * KiB:
        n = 300
    elif nbytes <= 256 * KiB:
        n = 100
    elif nbytes <= 4 * MiB:
        n = 30
    else:
        n = 8
    return max(3, n // 3) if quick else n


def bus_factor(op: str, world: int) -> float:
    return {"all_reduce": 2 * (world - 1) / world, "broadcast": 1.0,
            "all_gather": (world - 1) / world}[op]


# ----------------------------------------------------------------------------- workers

def _shoal_worker(rank, world, port, backend, quick, cases, transport, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), SHOAL_USE_AGENT_STORE="1",
                      SHOAL_LOCAL_TRANSPORT=transport)
    try:
        import collectives as c

        pg = c.init_process_group(backend, init_method="env://", timeout=120)
        times = {}
        for op, nbytes in cases:
            n = nbytes // 4
            if op == "all_reduce":
                a = np.zeros(n, np.float32)
                run = lambda: pg.all_reduce(a)  # noqa: E731
            elif op == "broadcast":
                a = np.zeros(n, np.float32)
                run = lambda: pg.broadcast(a, src=0)  # noqa: E731
            else:
                x = np.ones(n // world, np.float32)
                outs = [np.empty_like(x) for _ in range(world)]
                run = lambda: pg.all_gather(outs, x)  # noqa: E731
            for _ in range(3):
                run()
            ts = []
            for _ in range(iterations(nbytes, quick)):
                pg.barrier()
                t0 = time.perf_counter()
                run()
                ts.append(time.perf_counter() - t0)
            times[(op, nbytes)] = ts
        c.destroy_process_group()
        out.put((rank, times))
    except BaseException as exc:
        out.put((rank, exc))
        raise


def _gloo_worker(rank, world, port, quick, cases, out):
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world, False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        times = {}
        for op, nbytes in cases:
            n = nbytes // 4
            if op == "all_reduce":
                t = torch.zeros(n)
                run = lambda: dist.all_reduce(t)  # noqa: E731
            elif op == "broadcast":
                t = torch.zeros(n)
                run = lambda: dist.broadcast(t, src=0)  # noqa: E731
            else:
                x = torch.ones(n // world)
                outs = [torch.empty_like(x) for _ in range(world)]
                run = lambda: dist.all_gather(outs, x)  # noqa: E731
            for _ in range(3):
                run()
            ts = []
            for _ in range(iterations(nbytes, quick)):
                dist.barrier()
                t0 = time.perf_counter()
                run()
                ts.append(time.perf_counter() - t0)
            times[(op, nbytes)] = ts
        dist.destroy_process_group()
        out.put((rank, times))
    except BaseException as exc:
        out.put((rank, exc))
        raise


def _session(side: str, world: int, args) -> dict:
    """Spawn one session of `world` ranks; per case, the slowest rank's time per iteration."""
    out = CTX.Queue()
    if side.startswith("shoal"):
        from collectives.store_tcp import TCPStore

        transport = "tcp" if side == "shoal_tcp" else os.environ.get("SHOAL_LOCAL_TRANSPORT", "unix")
        store = TCPStore("127.0.0.1", 0, world_size=world, is_master=True, timeout=120,
                         wait_for_workers=False)
        procs = [CTX.Process(target=_shoal_worker, args=(r, world, store.port, args.backend, args.quick,
                                                         args.cases, transport, out))
                 for r in range(world)]
    else:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False)
        procs = [CTX.Process(target=_gloo_worker, args=(r, world, store.port, args.quick, args.cases, out))
                 for r in range(world)]
    for p in procs:
        p.start()
    per_rank = {}
    try:
        for _ in range(world):
            rank, value = out.get(timeout=600)
            if isinstance(value, BaseException):
                raise SystemExit(f"{side} rank {rank} failed: {type(value).__name__}: {value}")
            per_rank[rank] = value
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        if side.startswith("shoal"):
            store.close()
    return {case: [max(per_rank[r][case][i] for r in range(world))
                   for i in range(len(per_rank[0][case]))] for case in per_rank[0]}


# ----------------------------------------------------------------------------- loopback limit

def _sink(port, nbytes, rounds):
    s = socket.create_connection(("127.0.0.1", port))
    buf = bytearray(4 * MiB)
    view = memoryview(buf)
    for _ in range(rounds):
        got = 0
        while got < nbytes:
            got += s.recv_into(view, min(len(buf), nbytes - got))
        s.sendall(b"k")
    s.close()


def loopback_limit(quick: bool) -> float:
    """GB/s of one TCP stream between two processes on 127.0.0.1 (default kernel buffers)."""
    nbytes = 64 * MiB
    rounds = 3 if quick else 7
    listener = socket.create_server(("127.0.0.1", 0))
    p = CTX.Process(target=_sink, args=(listener.getsockname()[1], nbytes, rounds))
    p.start()
    conn, _ = listener.accept()
    data = memoryview(bytearray(nbytes))
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for off in range(0, nbytes, 4 * MiB):
            conn.sendall(data[off:off + 4 * MiB])
        conn.recv(1)
        ts.append(time.perf_counter() - t0)
    p.join(30)
    conn.close()
    listener.close()
    return nbytes / statistics.median(ts) / 1e9


# ----------------------------------------------------------------------------- main

TARGETS = [  # (op, world, bytes, minimum speedup over gloo, what)
    ("all_reduce", 2, 64 * MiB, 2.5, "W=2 busbw at 64 MiB >= 2.5x gloo"),
    ("all_reduce", 2, 4 * MiB, 3.0, "W=2 busbw at 4 MiB >= 3x gloo"),
    ("all_reduce", 4, 64 * MiB, 2.0, "W=4 busbw at 64 MiB >= 2x gloo"),
    ("all_reduce", 2, 4 * KiB, 5.0, "W=2 latency at 4 KiB <= 1/5 of gloo's"),
    ("all_reduce", 4, 4 * KiB, 5.0, "W=4 latency at 4 KiB <= 1/5 of gloo's"),
]


def _print_targets(rows) -> None:
    print()
    print("targets (speedup = gloo time / shoal time, same run):")
    for op, world, nbytes, need, what in TARGETS:
        row = next((r for r in rows if (r["op"], r["world"], r["bytes"]) == (op, world, nbytes)), None)
        if row is None:
            continue
        got = row["shoal_speedup_vs_gloo"]
        verdict = "met" if got >= need else "NOT met"
        print(f"  {what:<42} {got:>6.2f}x  {verdict}")


def _fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer iterations and one round")
    parser.add_argument("--compare", dest="compare", action="store_true", default=None,
                        help="run torch gloo side by side (default when torch is installed)")
    parser.add_argument("--no-compare", dest="compare", action="store_false")
    parser.add_argument("--backend", default="tcp", help="shoal backend: tcp (default) or nccl")
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    parser.add_argument("--rounds", type=int, default=None, help="A/B rounds (default 2, quick 1)")
    parser.add_argument("--ops", default="all_reduce,broadcast,all_gather", help="which ops to run")
    parser.add_argument("--max-bytes", type=int, default=64 * MiB, help="skip larger cases")
    parser.add_argument("--no-loopback", action="store_true", help="skip the raw loopback measurement")
    parser.add_argument("--tcp-too", action="store_true",
                        help="also run shoal with SHOAL_LOCAL_TRANSPORT=tcp (every link on loopback TCP)")
    args = parser.parse_args(argv)
    ops = set(args.ops.split(","))
    args.cases = [c for c in CASES if c[0] in ops and c[1] <= args.max_bytes]
    if args.backend != "tcp":
        from collectives.api import BackendUnavailable
        from collectives.distributed import _backend_class

        try:
            _backend_class(args.backend)  # "backend 'nccl' needs a CUDA device; none was found."
        except BackendUnavailable as exc:
            print(f"bench/allreduce.py: {exc}", file=sys.stderr)
            return 2
    if args.compare is None:
        try:
            import torch.distributed  # noqa: F401
            args.compare = True
        except ImportError:
            args.compare = False
    rounds = args.rounds or (1 if args.quick else 2)
    worlds = [int(w) for w in args.worlds.split(",")]

    if not args.no_loopback:
        limit = loopback_limit(args.quick)
        print(f"raw loopback, one TCP stream: {limit:.2f} GB/s")
        print(json.dumps({"bench": "allreduce", "row": "loopback", "gbps": round(limit, 3)}))

    sides = ["shoal"] + (["shoal_tcp"] if args.tcp_too else []) + (["gloo"] if args.compare else [])
    rows = []
    for world in worlds:
        samples = {side: {} for side in sides}
        for _ in range(rounds):
            for side in sides:
                for case, ts in _session(side, world, args).items():
                    samples[side].setdefault(case, []).extend(ts)
        for case in args.cases:
            op, nbytes = case
            row = {"bench": "allreduce", "op": op, "world": world, "bytes": nbytes,
                   "backend": args.backend}
            for side in sides:
                ts = samples[side][case]
                med = statistics.median(ts)
                q = statistics.quantiles(ts, n=10) if len(ts) >= 10 else [min(ts)] * 9
                row[f"{side}_ms"] = round(med * 1e3, 4)
                row[f"{side}_busbw_gbps"] = round(nbytes / med * bus_factor(op, world) / 1e9, 3)
                row[f"{side}_p10_ms"] = round(q[0] * 1e3, 4)
                row[f"{side}_p90_ms"] = round(q[-1] * 1e3, 4)
            for side in sides:
                if side != "gloo" and "gloo" in sides:
                    row[f"{side}_speedup_vs_gloo"] = round(row["gloo_ms"] / row[f"{side}_ms"], 2)
            rows.append(row)

    header = f"{'op':<11}{'W':>2} {'size':>7}"
    for side in sides:
        header += f" | {side + ' ms':>13} {'busbw':>6}"
    for side in sides:
        if side != "gloo" and "gloo" in sides:
            header += f" | {side + '/gloo':>14}"
    print()
    print("median time per op (slowest rank), busbw in GB/s; speedup = gloo time / shoal time")
    print(header)
    print("-" * len(header))
    for row in rows:
        line = f"{row['op']:<11}{row['world']:>2} {_fmt_size(row['bytes']):>7}"
        for side in sides:
            line += f" | {row[side + '_ms']:>13.3f} {row[side + '_busbw_gbps']:>6.2f}"
        for side in sides:
            if side != "gloo" and "gloo" in sides:
                line += f" | {row[side + '_speedup_vs_gloo']:>13.2f}x"
        print(line)
    for row in rows:
        print(json.dumps(row))
    if "gloo" in sides:
        _print_targets(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
