"""The torch bridge: torch.distributed on backend "shoal" next to gloo, and next to shoal's own API.

Two figures, in the same processes (the world on "shoal", a gloo group of the same ranks beside
it, and the shoal group under the bridge reached through `shoal.torch_bridge.shoal_group()`):

  all_reduce  torch's `dist.all_reduce` of float32 tensors through the bridge and through gloo at
              4 KiB, 4 MiB and 64 MiB, W = 1, 2 and 4; and the same shoal group called directly
              on numpy views of the same tensors. bridge cost per call = bridge - shoal's own
              API (cleanest at W = 1, where no peer's timing adds noise).
              Targets: bridge >= 3x gloo from 4 MiB within a host; bridge cost <= 30 us.
  ddp         torch DDP of an MLP 784-1024-1024-10 (batch 128 per rank, SGD, W = 2) on "shoal"
              and on "gloo"; overhead = DDP step - the same model's local step (paired by
              rotation, the median over rotations).
              Target: overhead on "shoal" <= 0.4x gloo's.
              Where it goes, in the same rotation: "floor", the same DDP with a comm hook that
              communicates nothing (DDP's own bucket copies and hooks, which no backend removes);
              "comm", shoal's own API all_reducing arrays of DDP's bucket sizes one after
              another. floor + comm is what the step would add if nothing overlapped the
              communication (W ranks on W cores leave no idle core for it): the bridge's
              overhead below it means the worker thread's all_reduce overlapped backward, above
              it shows the bridge's own costs (calls, Work/Future objects, the hand-off to the
              group's worker thread). CPU time over the local step, summed over every thread of
              every rank, is printed beside (less sensitive to other jobs). "worker": the same
              DDP on "shoal" with `defer_in_backward=False` (each bucket handed to the group's
              worker thread at once), beside the default (parked until backward ends where a
              host has no core per rank to spare, as on 2 cores at W=2).

The kinds run in rotating blocks (A B C A B C ...) after a barrier each, so machine noise hits
each alike; a block's time is its slowest rank's; medians over blocks. One thread per rank.

    python bench/torch_bridge.py               # both figures
    python bench/torch_bridge.py --quick       # fewer blocks
    python bench/torch_bridge.py --only ddp    # one figure
    python bench/torch_bridge.py --hosts 2x2   # 2 network-namespace hosts x 2 ranks (root)
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import secrets  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import torch_bridge_hosts  # noqa: E402

KiB, MiB = 1024, 1024 * 1024
SIZES = (4 * KiB, 4 * MiB, 64 * MiB)
MLP = (784, 1024, 1024, 10)
CTX = multiprocessing.get_context("spawn")


def _iters(nbytes: int, quick: bool) -> int:
    """Iterations per block: enough that a block lasts tens of milliseconds."""
    n = 200 if nbytes <= 64 * KiB else 10 if nbytes <= 8 * MiB else 2
    return max(1, n // 2) if quick else n


def _slowest(shoal_pg, seconds: float) -> float:
    """The slowest rank's time for the block (a max all_reduce outside the timed part)."""
    t = np.array([seconds])
    shoal_pg.all_reduce(t, op="max")
    return float(t[0])


# ------------------------------------------------------------------ the all_reduce figure

def _all_reduce_rows(dist, torch, bridge, gloo, rank, world, blocks, quick):
    shoal_pg = bridge.shoal_group()
    rows = []
    for nbytes in SIZES:
        t = torch.zeros(nbytes // 4)  # sums of zeros stay finite however often they repeat
        view = t.numpy()
        n = _iters(nbytes, quick)
        kinds = {
            "bridge": lambda: dist.all_reduce(t),
            "gloo": lambda: dist.all_reduce(t, group=gloo),
            "shoal": lambda: shoal_pg.all_reduce(view),
        }
        times = {k: [] for k in kinds}
        for fn in kinds.values():
            fn()  # warm up: connections, shared memory, buffers
        for b in range(blocks):
            order = list(kinds)[b % 3:] + list(kinds)[:b % 3]
            for kind in order:
                dist.barrier(group=gloo)
                start = time.perf_counter()
                for _ in range(n):
                    kinds[kind]()
                times[kind].append(_slowest(shoal_pg, (time.perf_counter() - start) / n))
        if rank == 0:
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append({"figure": "all_reduce", "world": world, "bytes": nbytes,
                         **{f"{k}_ms": med[k] * 1e3 for k in med},
                         "bridge_vs_gloo": med["gloo"] / med["bridge"],
                         "bridge_cost_us": (med["bridge"] - med["shoal"]) * 1e6,
                         "spread_bridge": _spread(times["bridge"])})
    return rows


def _spread(values) -> float:
    """(max - min) / median over blocks: how noisy the machine was."""
    return (max(values) - min(values)) / statistics.median(values)


# ------------------------------------------------------------------ the DDP figure

def _mlp(torch):
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(MLP[:-1], MLP[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(MLP) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _no_comm_hook(_state, bucket):
    """A DDP comm hook that communicates nothing: what DDP itself costs (bucket copies,
    hooks, finalize), the part of the overhead no backend can remove."""
    import torch

    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _bucket_bytes(model) -> list:
    """The sizes of DDP's buckets (after its first iterations rebuilt them), in bytes: torch's
    logging data keeps the sizes from before the rebuild, its reducer the current buckets."""
    try:
        buckets = model.reducer._get_zeros_like_grad_buckets()
        return [b.buffer().numel() * b.buffer().element_size() for b in buckets]
    except (AttributeError, RuntimeError):  # another torch: the sizes DDP logged
        sizes = str(model._get_ddp_logging_data().get("bucket_sizes", ""))
        return [int(s) for s in sizes.split(",") if s.strip()]


def _ddp_rows(dist, torch, bridge, gloo, rank, world, blocks, quick):
    from torch.nn.parallel import DistributedDataParallel as DDP

    shoal_pg = bridge.shoal_group()
    x = torch.randn(128, MLP[0], generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, MLP[-1], (128,), generator=torch.Generator().manual_seed(rank))
    models = {"local": _mlp(torch), "shoal": DDP(_mlp(torch)),
              "gloo": DDP(_mlp(torch), process_group=gloo), "floor": DDP(_mlp(torch)),
              "worker": DDP(_mlp(torch))}
    models["floor"].register_comm_hook(None, _no_comm_hook)
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    world_pg = dist.group.WORLD

    def step(kind):
        world_pg.defer_in_backward = False if kind == "worker" else None
        opts[kind].zero_grad()
        torch.nn.functional.cross_entropy(models[kind](x), y).backward()
        opts[kind].step()

    for kind in models:
        step(kind)
        step(kind)  # the second iteration runs on the rebuilt buckets
    # The communication alone: shoal's own API all_reducing arrays of the buckets' sizes, one
    # after another, outside DDP; floor + comm is what a step adds when nothing overlaps it.
    buffers = [np.zeros(n // 4, np.float32) for n in _bucket_bytes(models["shoal"])]

    def comm():
        for buf in buffers:
            shoal_pg.all_reduce(buf)

    kinds = {**{k: (lambda k=k: step(k)) for k in models}, "comm": comm}
    steps = 3 if quick else 6
    times = {k: [] for k in kinds}
    cpu = {k: [] for k in kinds}
    for b in range(blocks):
        order = list(kinds)[b % len(kinds):] + list(kinds)[:b % len(kinds)]
        for kind in order:
            dist.barrier(group=gloo)
            start, cpu0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                kinds[kind]()
            times[kind].append(_slowest(shoal_pg, (time.perf_counter() - start) / steps))
            cpu[kind].append(_total(shoal_pg, (time.process_time() - cpu0) / steps))
    if rank != 0:
        return []
    return [_ddp_row(times, cpu, world, buffers)]


def _total(shoal_pg, seconds: float) -> float:
    """Every rank's figure summed (CPU time: every thread of every rank)."""
    t = np.array([seconds])
    shoal_pg.all_reduce(t)
    return float(t[0])


def _ddp_row(times, cpu, world, buffers) -> dict:
    """The DDP figure from per-block times: overheads paired by rotation (each block minus the
    same rotation's local block, so a slow spell of the machine cancels out), medians."""
    med = {k: statistics.median(v) for k, v in times.items()}

    def over(kind, of=times):
        return statistics.median(a - b for a, b in zip(of[kind], of["local"]))

    wall = {k: over(k) for k in ("shoal", "gloo", "floor", "worker")}
    cpu_over = {k: over(k, cpu) for k in ("shoal", "gloo", "floor", "worker")}
    serial = wall["floor"] + med["comm"]
    gloo_over = wall["gloo"] if wall["gloo"] > 0 else float("nan")
    return {"figure": "ddp", "world": world, "local_ms": med["local"] * 1e3,
            "shoal_step_ms": med["shoal"] * 1e3, "gloo_step_ms": med["gloo"] * 1e3,
            "shoal_overhead_ms": wall["shoal"] * 1e3, "gloo_overhead_ms": wall["gloo"] * 1e3,
            "overhead_vs_gloo": wall["shoal"] / gloo_over,
            "worker_overhead_ms": wall["worker"] * 1e3,
            "worker_vs_gloo": wall["worker"] / gloo_over,
            "floor_ms": wall["floor"] * 1e3, "comm_ms": med["comm"] * 1e3,
            "bucket_bytes": [b.nbytes for b in buffers],
            "no_overlap_ms": serial * 1e3, "no_overlap_vs_gloo": serial / gloo_over,
            "shoal_minus_no_overlap_ms": (wall["shoal"] - serial) * 1e3,
            "cpu_overhead_ms": {k: v * 1e3 for k, v in cpu_over.items()},
            "samples_per_s_shoal": 128 * world / med["shoal"],
            "samples_per_s_gloo": 128 * world / med["gloo"]}


# ------------------------------------------------------------------ ranks and the table

def rank_rows(rank, world, init_method, figures, blocks, quick, ddp_any_world=False) -> list:
    """One rank's part of the figures (rows on rank 0 only): the world on "shoal" through
    `init_method`, a gloo group of the same ranks beside it."""
    import datetime

    import torch
    import torch.distributed as dist

    import shoal.torch_bridge as bridge

    warnings.simplefilter("ignore", FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group("shoal", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    gloo = dist.new_group(backend="gloo")
    rows = []
    if "all_reduce" in figures:
        rows += _all_reduce_rows(dist, torch, bridge, gloo, rank, world, blocks, quick)
    # Within one host the DDP figure runs at W = 2 only (one rank per core of these machines).
    if "ddp" in figures and (world == 2 or (ddp_any_world and world > 1)):
        rows += _ddp_rows(dist, torch, bridge, gloo, rank, world, blocks, quick)
    # Whether the shoal group took its two-level algorithms (several hosts, several ranks each).
    two_level = bool(getattr(bridge.shoal_group(), "hierarchical", False))
    dist.destroy_process_group()
    return [dict(row, two_level=two_level) for row in rows]


def _rank(rank, world, port, figures, blocks, quick, out):
    try:
        rows = rank_rows(rank, world, f"tcp://127.0.0.1:{port}", figures, blocks, quick)
        out.put((rank, "ok", rows))
    except BaseException:  # noqa: BLE001 - reported by the parent with the rank
        out.put((rank, "error", traceback.format_exc()))


def _run(world, figures, blocks, quick) -> list:
    import socket

    with socket.socket() as s:  # torch's tcp:// init needs a port before the ranks start
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = CTX.Queue()
    procs = [CTX.Process(target=_rank, args=(r, world, port, figures, blocks, quick, out))
             for r in range(world)]
    for p in procs:
        p.start()
    rows = []
    try:
        for _ in range(world):
            rank, status, value = out.get(timeout=1800)
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            rows += value
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return rows


def _machine() -> str:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)
    except OSError:
        pass
    src = np.ones(64 * MiB, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return f"cpu: {model} x {os.cpu_count()}; memcpy 64 MiB: {src.nbytes / best / 1e9:.1f} GB/s"


def _print(rows) -> None:
    for row in rows:
        if row["figure"] == "all_reduce":
            size = f"{row['bytes'] // MiB} MiB" if row["bytes"] >= MiB else f"{row['bytes'] // KiB} KiB"
            where = f" hosts {row['hosts']}" if "hosts" in row else ""
            print(f"all_reduce W={row['world']}{where} {size:>7}: bridge {row['bridge_ms']:8.3f} ms  "
                  f"gloo {row['gloo_ms']:8.3f} ms  shoal API {row['shoal_ms']:8.3f} ms  "
                  f"bridge/gloo speedup {row['bridge_vs_gloo']:5.2f}x  "
                  f"bridge cost {row['bridge_cost_us']:+7.1f} us")
        else:
            where = f" hosts {row['hosts']}" if "hosts" in row else ""
            print(f"DDP MLP W={row['world']}{where}: local {row['local_ms']:.2f} ms; overhead shoal "
                  f"{row['shoal_overhead_ms']:.2f} ms, gloo {row['gloo_overhead_ms']:.2f} ms "
                  f"({row['overhead_vs_gloo']:.2f}x); samples/s shoal "
                  f"{row['samples_per_s_shoal']:.0f}, gloo {row['samples_per_s_gloo']:.0f}; "
                  f"handed to the worker thread instead: {row['worker_overhead_ms']:.2f} ms "
                  f"({row['worker_vs_gloo']:.2f}x)")
            print(f"  where it goes: DDP itself (no-comm hook) {row['floor_ms']:.2f} ms + shoal API "
                  f"all_reduce of the buckets {row['comm_ms']:.2f} ms = "
                  f"{row['no_overlap_ms']:.2f} ms without overlap "
                  f"({row['no_overlap_vs_gloo']:.2f}x gloo's); shoal minus that "
                  f"{row['shoal_minus_no_overlap_ms']:+.2f} ms; CPU over local, all ranks: "
                  + ", ".join(f"{k} {v:.2f} ms" for k, v in row["cpu_overhead_ms"].items()))
    for row in rows:
        print(json.dumps(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks and iterations")
    # W=1 has no peer to wait for, so its bridge-minus-API difference is the bridge's own cost.
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--only", choices=("all_reduce", "ddp"), default=None)
    parser.add_argument("--blocks", type=int, default=None, help="rotations of the kinds")
    parser.add_argument("--hosts", default=None, metavar="HxL",
                        help="run across H hosts of L ranks made as network namespaces (root; "
                             "bench/torch_bridge_hosts.py) instead of --worlds")
    parser.add_argument("--worker", nargs=4, default=None, metavar=("RANK", "WORLD", "MASTER", "PORT"),
                        help=argparse.SUPPRESS)  # one rank of --hosts, started on its host
    args = parser.parse_args()
    os.environ.setdefault("SHOAL_AUTH_TOKEN", secrets.token_hex(16))  # the ranks inherit it
    figures = {args.only} if args.only else {"all_reduce", "ddp"}
    blocks = args.blocks or (4 if args.quick else 9)
    if args.worker:
        torch_bridge_hosts.worker(args.worker, figures, blocks, args.quick, rank_rows)
        return
    print(_machine() + "; one thread per rank; the machine may be shared (noisy figures)")
    if args.hosts:
        rows = torch_bridge_hosts.run(args.hosts, figures, blocks, args.quick, __file__)
    else:
        rows = []
        for world in args.worlds:
            rows += _run(world, figures, blocks, args.quick)
    _print(rows)


if __name__ == "__main__":
    main()
