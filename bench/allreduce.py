"""Collectives bandwidth and latency: shoal's tcp backend next to torch's gloo, same run.

allreduce of 4 KiB, 256 KiB, 4 MiB and 64 MiB at W = 2 and 4; broadcast and all_gather at
4 MiB; the raw loopback limit (one TCP stream between two processes) measured in the same run.
Each iteration starts after a barrier and is timed as the slowest rank's time; medians over
iterations. Both sides' ranks run at once and the parent alternates blocks of iterations
between them (A B A B) while the other side sleeps, so drift on a busy machine hits both; the
table also gives the median of the per-iteration ratios of paired blocks.

shoal runs with its same-host default (SHOAL_LOCAL_TRANSPORT=shm: Unix-socket links, and shared
memory for all_reduce, broadcast and all_gather above 64 KiB), so its large-message figures can
exceed the loopback limit; --tcp-too adds a column with every link on loopback TCP, the figure
for ranks on different hosts, and --unix-too one with every link on a Unix socket and no shared
memory. Every frame on shoal's links carries a 16-byte integrity tag (always on); --encrypt
runs every shoal column with SHOAL_ENCRYPT=1 (payloads sealed with AES-GCM, the store's frames
too), so its cost reads beside gloo's in the same run and beside a run without it. Each row's
JSON also gives every side's CPU time per op (the busiest rank's, all its threads), and with
--tcp-too or --unix-too the table is followed by what the tags cost a rank over sockets: the
bytes a ring all_reduce tags and checks per rank over the GMAC rate measured here, beside that
CPU time (on a machine whose cores the ranks already fill, the tags' time adds to the op's).

Bandwidth as nccl-tests defines it (GB = 1e9 bytes): algbw = bytes / time; busbw = algbw x
2(W-1)/W for allreduce, algbw for broadcast, algbw x (W-1)/W for all_gather (whose size is the
gathered total). Targets: W=2 busbw at 64 MiB >= 2.5x gloo, at 4 MiB >= 3x; W=4 at 64 MiB >=
2x; 4 KiB latency <= 1/5 of gloo's.

    python bench/allreduce.py                 # full run, gloo beside it when torch is installed
    python bench/allreduce.py --quick         # fewer iterations and rounds
    python bench/allreduce.py --no-compare    # shoal only
    python bench/allreduce.py --backend nccl  # shoal's nccl backend (needs a CUDA device)
    python bench/allreduce.py --hosts 2x2     # 2 network-namespace hosts x 2 ranks (root)
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
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import allreduce_hosts  # noqa: E402
from allreduce_cases import (  # noqa: E402
    KiB,
    MiB,
    bus_factor,
    fmt_size,
    gloo_runner,
    iterations,
    shoal_runner,
)

ALLREDUCE_SIZES = (4 * KiB, 256 * KiB, 4 * MiB, 64 * MiB)
CASES = [("all_reduce", n) for n in ALLREDUCE_SIZES] + [("broadcast", 4 * MiB), ("all_gather", 4 * MiB)]
CTX = multiprocessing.get_context("spawn")
# From this size up a ring all_reduce's time is its bytes: the tag bound is printed for these.
THREADED_BYTES = 4 * MiB


# ----------------------------------------------------------------------------- workers

def _worker(side, rank, world, port, backend, commands, out):
    """One rank of one side. It forms its group, then runs blocks of iterations when told, so
    the parent can alternate the sides block by block (A B A B) while the idle side sleeps;
    running both libraries in one process would let gloo's threads slow shoal down."""
    try:
        if side == "gloo":
            import torch
            import torch.distributed as dist

            torch.set_num_threads(1)
            store = dist.TCPStore("127.0.0.1", port, world, False)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
            make = lambda op, n: gloo_runner(dist, torch, op, n, world)  # noqa: E731
        else:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                              WORLD_SIZE=str(world))
            os.environ[collective_settings.USE_AGENT_STORE.name] = "1"
            if side in ("shoal_unix", "shoal_tcp"):  # every link on a Unix socket, or on TCP
                os.environ[collective_settings.LOCAL_TRANSPORT.name] = side[len("shoal_"):]
            if backend == "nccl":
                os.environ["LOCAL_RANK"] = str(rank)  # one GPU per rank
            import shoal.collectives as c

            pg = c.init_process_group(backend, init_method="env://", timeout=300)
            make = lambda op, n: shoal_runner(pg, op, n, world, backend)  # noqa: E731
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
                    runners[(op, nbytes)][0]()
            run, barrier = runners[(op, nbytes)]
            # One untimed iteration per block for either side: the other side's block has just
            # evicted this side's arrays from the caches.
            barrier()
            run()
            ts = []
            cpu0 = time.process_time()  # every thread of this rank: the CPU an op costs
            for _ in range(count):
                barrier()
                t0 = time.perf_counter()
                run()
                ts.append(time.perf_counter() - t0)
            out.put((side, rank, "times", (ts, (time.process_time() - cpu0) / count)))
        if side == "gloo":
            dist.destroy_process_group()
        else:
            c.destroy_process_group()
    except BaseException as exc:
        out.put((side, rank, "error", f"{type(exc).__name__}: {exc}"))
        raise


def _session(sides: list, world: int, args) -> tuple[dict, dict]:
    """Spawn every side's ranks; per case, alternate blocks of iterations between the sides.

    Returns (case -> side -> the slowest rank's time of each iteration, case -> side -> the
    busiest rank's CPU time per iteration in each block, barriers included).
    """
    from shoal.collectives.store.tcp import TCPStore

    out = CTX.Queue()
    stores, procs, commands = [], {}, {}
    for side in sides:
        if side == "gloo":
            import torch.distributed as dist

            store = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False)
        else:
            store = TCPStore("127.0.0.1", 0, world_size=world, is_master=True, timeout=300,
                             wait_for_workers=False)
        stores.append(store)
        commands[side] = [CTX.Queue() for _ in range(world)]
        procs[side] = [CTX.Process(target=_worker, args=(side, r, world, store.port, args.backend,
                                                         commands[side][r], out))
                       for r in range(world)]
        for p in procs[side]:
            p.start()

    def collect(kind: str, count: int) -> list:
        got = []
        while len(got) < count:
            side, rank, what, value = out.get(timeout=900)
            if what == "error":
                raise SystemExit(f"{side} rank {rank} failed: {value}")
            if what == kind:
                got.append((side, rank, value))
        return got

    results, cpu = {}, {}
    try:
        collect("ready", world * len(sides))
        blocks = args.blocks or (2 if args.quick else 4)
        for case in args.cases:
            per_block = max(1, iterations(case[1], args.quick) // blocks)
            results[case] = {side: [] for side in sides}
            cpu[case] = {side: [] for side in sides}
            for _ in range(blocks):
                for side in sides:
                    for q in commands[side]:
                        q.put((case, per_block))
                    by_rank = {rank: got for _s, rank, got in collect("times", world)}
                    results[case][side] += [max(by_rank[r][0][i] for r in range(world))
                                            for i in range(per_block)]
                    cpu[case][side].append(max(by_rank[r][1] for r in range(world)))
        for side in sides:
            for q in commands[side]:
                q.put(None)
    finally:
        for side in sides:
            for p in procs[side]:
                p.join(30)
                if p.is_alive():
                    p.kill()
        for store in stores:
            if hasattr(store, "close"):
                store.close()
    return results, cpu


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


# ----------------------------------------------------------------------------- integrity bound

def gmac_rate() -> float:
    """GB/s of one AES-GMAC tag over 64 MiB here (the tag every socket frame carries)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead, data = AESGCM(bytes(32)), bytearray(64 * MiB)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        aead.encrypt(bytes(12), b"", data)
        ts.append(time.perf_counter() - t0)
    return len(data) / min(ts) / 1e9


def _print_tag_bound(rows: list[dict], sides: list, rate: float) -> None:
    """What the tags of a ring all_reduce over sockets cost each rank at `rate`, beside the
    busiest rank's CPU time per op: a rank sends and receives 2(W-1)/W of the array, and tags
    what it sends and checks what it receives, so 4(W-1)/W of the bytes pass through GMAC."""
    socket_sides = [side for side in sides if side in ("shoal_tcp", "shoal_unix")]
    print()
    print(f"integrity tags over sockets (AES-GMAC {rate:.1f} GB/s here, one core):")
    for row in rows:
        if row["op"] != "all_reduce" or row["bytes"] < THREADED_BYTES:
            continue
        world, nbytes = row["world"], row["bytes"]
        tagged = 4 * (world - 1) / world * nbytes
        row["tag_ms_per_rank"] = round(tagged / rate / 1e6, 3)
        line = (f"  all_reduce W={world} {fmt_size(nbytes)}: {tagged / MiB:.0f} MiB tagged or "
                f"checked per rank = {row['tag_ms_per_rank']:.2f} ms")
        for side in socket_sides:
            line += (f"; {side} {row[side + '_ms']:.2f} ms a call, "
                     f"CPU {row[side + '_cpu_ms']:.2f} ms per rank")
        print(line)


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
        paired = row["shoal_paired_ratio"]
        verdict = "met" if got >= need else "NOT met"
        print(f"  {what:<42} {got:>6.2f}x (paired {paired:.2f}x)  {verdict}")


def _parser() -> argparse.ArgumentParser:
    """bench/allreduce.py's flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer iterations and one round")
    parser.add_argument("--compare", dest="compare", action="store_true", default=None,
                        help="run torch gloo side by side (default when torch is installed)")
    parser.add_argument("--no-compare", dest="compare", action="store_false")
    parser.add_argument("--backend", default="tcp", help="shoal backend: tcp (default) or nccl")
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    parser.add_argument("--rounds", type=int, default=None, help="sessions per world size (default 2, quick 1)")
    parser.add_argument("--blocks", type=int, default=None,
                        help="A/B blocks each case's iterations are split into (default 4, quick 2)")
    parser.add_argument("--ops", default="all_reduce,broadcast,all_gather", help="which ops to run")
    parser.add_argument("--max-bytes", type=int, default=64 * MiB, help="skip larger cases")
    parser.add_argument("--min-bytes", type=int, default=0, help="skip smaller cases")
    parser.add_argument("--no-loopback", action="store_true", help="skip the raw loopback measurement")
    parser.add_argument("--tcp-too", action="store_true",
                        help="also run shoal with SHOAL_LOCAL_TRANSPORT=tcp (every link on loopback TCP)")
    parser.add_argument("--unix-too", action="store_true",
                        help="also run shoal with SHOAL_LOCAL_TRANSPORT=unix (Unix sockets, no shared memory)")
    parser.add_argument("--encrypt", action="store_true",
                        help="run shoal with SHOAL_ENCRYPT=1: payloads sealed, not only tagged")
    parser.add_argument("--hosts", default=None, metavar="HxL",
                        help="run across H hosts of L ranks made as network namespaces (root): "
                             "shoal's two-level algorithms next to its flat ring and gloo "
                             "(bench/allreduce_hosts.py)")
    parser.add_argument("--mtu", type=int, default=None,
                        help="with --hosts: the veth links' MTU (default the kernel's 1500; "
                             "9000 is a data-centre jumbo frame)")
    parser.add_argument("--link-gbit", type=float, default=None,
                        help="with --hosts: shape every host's link to this many Gbit/s each "
                             "way (tbf), a network that bounds by bandwidth instead of by the "
                             "CPU the unshaped software links cost")
    parser.add_argument("--json", action="store_true",
                        help="with --hosts: print only the JSON rows")
    return parser


def _measure(sides: list, worlds: list, rounds: int, args) -> list[dict]:
    """One row per world and case: each side's median, busbw and spread, and the ratios to
    gloo, over `rounds` sessions."""
    rows = []
    for world in worlds:
        samples = {side: {} for side in sides}
        cpu_samples = {side: {} for side in sides}
        for _ in range(rounds):
            times, cpu = _session(sides, world, args)
            for case, by_side in times.items():
                for side, ts in by_side.items():
                    samples[side].setdefault(case, []).extend(ts)
                    cpu_samples[side].setdefault(case, []).extend(cpu[case][side])
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
                row[f"{side}_cpu_ms"] = round(statistics.median(cpu_samples[side][case]) * 1e3, 4)
            for side in sides:
                if side != "gloo" and "gloo" in sides:
                    row[f"{side}_speedup_vs_gloo"] = round(row["gloo_ms"] / row[f"{side}_ms"], 2)
                    # The median of per-iteration ratios (each pair ran back to back).
                    pairs = [g / x for g, x in zip(samples["gloo"][case], samples[side][case])]
                    row[f"{side}_paired_ratio"] = round(statistics.median(pairs), 2)
            rows.append(row)
    return rows


def _print_table(rows: list[dict], sides: list) -> None:
    """The human-readable table of `_measure`'s rows."""
    header = f"{'op':<11}{'W':>2} {'size':>7}"
    for side in sides:
        header += f" | {side + ' ms':>13} {'busbw':>6}"
    for side in sides:
        if side != "gloo" and "gloo" in sides:
            header += f" | {side + '/gloo':>14} {'paired':>6}"
    print()
    print("median time per op (slowest rank), busbw in GB/s; speedup = gloo time / shoal time "
          "(medians), paired = median of per-iteration ratios")
    print(header)
    print("-" * len(header))
    for row in rows:
        line = f"{row['op']:<11}{row['world']:>2} {fmt_size(row['bytes']):>7}"
        for side in sides:
            line += f" | {row[side + '_ms']:>13.3f} {row[side + '_busbw_gbps']:>6.2f}"
        for side in sides:
            if side != "gloo" and "gloo" in sides:
                line += f" | {row[side + '_speedup_vs_gloo']:>13.2f}x {row[side + '_paired_ratio']:>5.2f}x"
        print(line)


def main(argv=None) -> int:
    """bench/allreduce.py's entry point: parse, run the sessions, print the table and rows."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.encrypt:
        os.environ[core_settings.ENCRYPT.name] = "1"  # the store here and every rank inherit it
    ops = set(args.ops.split(","))
    args.cases = [c for c in CASES if c[0] in ops and args.min_bytes <= c[1] <= args.max_bytes]
    if args.backend != "tcp":
        from shoal.collectives.types import BackendUnavailable
        from shoal.collectives.backends.registry import backend_class

        try:
            backend_class(args.backend)  # "backend 'nccl' needs a CUDA device; none was found."
        except BackendUnavailable as exc:
            print(f"bench/allreduce.py: {exc}", file=sys.stderr)
            return 2
    if args.compare is None:
        try:
            import torch.distributed  # noqa: F401
            args.compare = args.backend != "nccl"  # gloo is no peer for GPU collectives
        except ImportError:
            args.compare = False
    if args.hosts:
        return allreduce_hosts.main(args, args.cases)
    rounds = args.rounds or (1 if args.quick else 2)
    worlds = [int(w) for w in args.worlds.split(",")]
    if args.backend == "nccl":
        import cupy

        gpus = cupy.cuda.runtime.getDeviceCount()
        fitting = [w for w in worlds if w <= gpus] or [gpus]
        if fitting != worlds:
            print(f"nccl needs one GPU per rank and this machine has {gpus}: worlds {fitting}")
        worlds = fitting

    if not args.no_loopback:
        limit = loopback_limit(args.quick)
        print(f"raw loopback, one TCP stream: {limit:.2f} GB/s")
        print(json.dumps({"bench": "allreduce", "row": "loopback", "gbps": round(limit, 3)}))

    sides = ["shoal"] + (["shoal_unix"] if args.unix_too else []) + (["shoal_tcp"] if args.tcp_too else [])
    sides += ["gloo"] if args.compare else []
    rows = _measure(sides, worlds, rounds, args)
    _print_table(rows, sides)
    if args.tcp_too or args.unix_too:
        _print_tag_bound(rows, sides, gmac_rate())
    for row in rows:
        print(json.dumps(row))
    if "gloo" in sides:
        _print_targets(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
