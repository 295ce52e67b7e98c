"""DDP step time, samples/s and communication hidden behind backward, shoal next to torch DDP.

An MLP 784-1024-1024-10 (float32, batch 128 per rank, plain SGD, cross-entropy) trains at
W = 1 and 2 ranks, one thread per rank, on the tcp backend (shoal) and on gloo (torch), in the
same processes: each rank holds both models and both groups and runs rotating blocks of the four
kinds of step (shoal local, shoal DDP, torch local, torch DDP), meeting the other ranks at a
barrier before each block, so machine noise hits every kind alike; every step is timed on the
slowest rank. The figures, as PEERS.md defines them:

  overhead  = DDP step - local step, the median over rounds of each round's block medians
              (target: shoal <= 0.5 x torch)
  comm      = the same buckets all-reduced back to back on an idle group
  hidden    = 1 - overhead / comm                      (the share backward hid; clamped 0..1)

    python bench/ddp.py                      # W = 1 and 2, torch peer when installed
    python bench/ddp.py --worlds 2 --repeats 3 --no-compare
    nice -n -15 python bench/ddp.py          # on a shared machine: others disturb both less

On 2 cores with 2 ranks every core is busy with backward, so a bucket's all_reduce can only
hide the time it spends waiting for its peer; its CPU work competes with compute.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from shoal.core import settings as core_settings  # noqa: E402  (after the thread limits)

os.environ.setdefault(core_settings.AUTH_TOKEN.name, "bench-ddp-token")

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import queue  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402

SIZES = (784, 1024, 1024, 10)
JOIN_S = 600.0


# ------------------------------------------------------------------ models

def _shoal_model(seed):
    from shoal import core
    from shoal.core import nn

    core.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _torch_model(torch, seed):
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _hist_sum(hist):
    for metric in hist.collect():
        for sample in metric.samples:
            if sample.name.endswith("_sum"):
                return sample.value
    return 0.0


# ------------------------------------------------------------------ one rank

def _rank(rank, world, port, init_file, cfg, out):
    """Time the four kinds of step in rotating blocks, under the same machine load."""
    try:
        out.put((rank, "ok", _rank_body(rank, world, port, init_file, cfg)))
    except BaseException:  # noqa: BLE001  (the parent must hear of any failure, an interrupt too)
        out.put((rank, "error", traceback.format_exc()))


def _rank_body(rank, world, port, init_file, cfg):
    from shoal import core
    from shoal.collectives import metrics as ddp_metrics
    from shoal.collectives.ddp.ddp import DistributedDataParallel
    from shoal.collectives.backends.tcp.group import ProcessGroupTCP
    from shoal.collectives.store.tcp import TCPStore
    from shoal.core.nn import functional as F

    store = TCPStore("127.0.0.1", port, timeout=60)
    group = ProcessGroupTCP(store, rank, world, timeout=120)
    rng = np.random.default_rng([cfg["seed"], rank])
    x_np = rng.standard_normal((cfg["batch"], SIZES[0])).astype(np.float32)
    y_np = rng.integers(0, SIZES[-1], cfg["batch"]).astype(np.int64)

    x, y = core.tensor(x_np), core.tensor(y_np)
    local = _shoal_model(cfg["seed"])
    local_opt = core.optim.SGD(local.parameters(), lr=0.01)
    ddp = DistributedDataParallel(_shoal_model(cfg["seed"]), process_group=group)
    ddp_opt = core.optim.SGD(ddp.parameters(), lr=0.01)

    def shoal_step(model, opt):
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        return time.perf_counter() - t0

    kinds = {
        "shoal_local": lambda: shoal_step(local, local_opt),
        "shoal_ddp": lambda: shoal_step(ddp, ddp_opt),
    }
    if cfg["compare"]:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        tx, ty = torch.from_numpy(x_np), torch.from_numpy(y_np)
        tlocal = _torch_model(torch, cfg["seed"])
        tlocal_opt = torch.optim.SGD(tlocal.parameters(), lr=0.01)
        tddp = torch.nn.parallel.DistributedDataParallel(_torch_model(torch, cfg["seed"]))
        tddp_opt = torch.optim.SGD(tddp.parameters(), lr=0.01)

        def torch_step(model, opt):
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(tx), ty).backward()
            opt.step()
            return time.perf_counter() - t0

        kinds["torch_local"] = lambda: torch_step(tlocal, tlocal_opt)
        kinds["torch_ddp"] = lambda: torch_step(tddp, tddp_opt)

    for _ in range(cfg["warmup"]):
        for step in kinds.values():
            step()
    times = {kind: [] for kind in kinds}
    exposed = []
    wait_hist = ddp_metrics.DDP_COMM_WAIT_SECONDS
    order = list(kinds)
    for block in range(cfg["blocks"]):
        # Rotate the order so that no kind always follows the same neighbour.
        shift = block % len(order)
        for kind in order[shift:] + order[:shift]:
            group.barrier()
            for _ in range(cfg["block"]):
                before = _hist_sum(wait_hist)
                times[kind].append(kinds[kind]())
                if kind == "shoal_ddp":
                    exposed.append(_hist_sum(wait_hist) - before)

    sizes = ddp.reducer.bucket_nbytes
    comm = {"shoal": []}
    buffers = [np.zeros(n // 4, dtype=np.float32) for n in sizes]
    if cfg["compare"]:
        comm["torch"] = []
        tbuffers = [torch.zeros(n // 4) for n in sizes]
    for _ in range(cfg["comm_iters"]):
        group.barrier()
        t0 = time.perf_counter()
        for w in [group.all_reduce(b, async_op=True) for b in buffers]:
            w.wait()
        comm["shoal"].append(time.perf_counter() - t0)
        if cfg["compare"]:
            dist.barrier()
            t0 = time.perf_counter()
            for w in [dist.all_reduce(b, async_op=True) for b in tbuffers]:
                w.wait()
            comm["torch"].append(time.perf_counter() - t0)
    if cfg["compare"]:
        dist.destroy_process_group()
    group.shutdown()
    return {"times": times, "exposed": exposed, "comm": comm, "buckets": sizes}


# ------------------------------------------------------------------ parent

def _run_group(world, cfg):
    """Spawn `world` ranks; per kind, the per-step seconds of the slowest rank."""
    from shoal.collectives.store.tcp import TCPStore

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=60)
    fd, init_file = tempfile.mkstemp(prefix="bench-ddp-gloo-")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_rank, args=(r, world, master.port, init_file, cfg, out))
             for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        deadline = time.monotonic() + JOIN_S
        while len(results) < world:
            try:
                rank, status, payload = out.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"ranks {sorted(set(range(world)) - set(results))} sent "
                                   f"nothing within {JOIN_S}s") from None
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for r, p in enumerate(procs):
            p.join(30)
            if p.is_alive():
                p.kill()
                print(f"rank {r} did not exit; killed it")
        master.close()
    merged = {"buckets": results[0]["buckets"], "exposed": [], "comm": {}, "times": {}}
    for kind in results[0]["times"]:
        merged["times"][kind] = [max(v) for v in zip(*(results[r]["times"][kind] for r in range(world)))]
    for impl in results[0]["comm"]:
        merged["comm"][impl] = [max(v) for v in zip(*(results[r]["comm"][impl] for r in range(world)))]
    merged["exposed"] = [max(v) for v in zip(*(results[r]["exposed"] for r in range(world)))]
    return merged


def _median_ms(values):
    return statistics.median(values) * 1e3 if values else float("nan")


def _spread_ms(values):
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles([v * 1e3 for v in values], n=10)
    return q[-1] - q[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,2", help="comma-separated world sizes")
    parser.add_argument("--batch", type=int, default=128, help="samples per rank")
    parser.add_argument("--block", type=int, default=5, help="steps per block")
    parser.add_argument("--blocks", type=int, default=20,
                        help="rounds of blocks; each round runs every kind of step once")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--comm-iters", "--comm_iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1, help="process groups per world size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", action="store_true",
                        help="run torch DDP beside shoal (the default when torch is installed)")
    parser.add_argument("--no-compare", "--no_compare", action="store_true",
                        help="skip torch DDP even when torch is installed")
    args = parser.parse_args(argv)
    compare = not args.no_compare
    if compare:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("torch is not installed: timing shoal alone")
            compare = False
    cfg = {"batch": args.batch, "block": args.block, "blocks": args.blocks, "compare": compare,
           "warmup": args.warmup, "comm_iters": args.comm_iters, "seed": args.seed}
    impls = ["shoal", "torch"] if compare else ["shoal"]

    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        got = {"times": {}, "comm": {}, "exposed": []}
        for _ in range(args.repeats):
            run = _run_group(world, cfg)
            for kind, values in run["times"].items():
                got["times"].setdefault(kind, []).extend(values)
            for impl, values in run["comm"].items():
                got["comm"].setdefault(impl, []).extend(values)
            got["exposed"].extend(run["exposed"])
            buckets = run["buckets"]
        for impl in impls:
            local_times = got["times"][f"{impl}_local"]
            ddp_times = got["times"][f"{impl}_ddp"]
            local, ddp = _median_ms(local_times), _median_ms(ddp_times)
            comm = _median_ms(got["comm"][impl])
            # Each round's DDP block minus the same round's local block, then the median over
            # rounds: load that drifts between rounds cancels out.
            per_round = [
                _median_ms(ddp_times[i:i + args.block]) - _median_ms(local_times[i:i + args.block])
                for i in range(0, len(ddp_times), args.block)
            ]
            overhead = statistics.median(per_round)
            row = {
                "bench": "ddp", "impl": impl, "world": world, "batch_per_rank": args.batch,
                "model": "mlp-784-1024-1024-10", "dtype": "float32", "buckets_bytes": buckets,
                "steps": len(ddp_times), "local_step_ms": local, "ddp_step_ms": ddp,
                "ddp_spread_ms": _spread_ms(ddp_times), "overhead_ms": overhead,
                "overhead_spread_ms": _spread_ms([v / 1e3 for v in per_round]),
                "comm_alone_ms": comm,
                "hidden_share": min(1.0, max(0.0, 1.0 - overhead / comm)) if world > 1 else None,
                "samples_per_s": world * args.batch / (ddp / 1e3),
            }
            if impl == "shoal":
                row["exposed_wait_ms"] = _median_ms(got["exposed"])
            rows.append(row)
        if compare and world > 1:
            rows[-2]["overhead_vs_torch"] = rows[-2]["overhead_ms"] / rows[-1]["overhead_ms"]

    print(f"{'impl':<6} {'W':>2} {'local ms':>9} {'ddp ms':>8} {'overhead':>9} {'comm ms':>8} "
          f"{'hidden':>7} {'samples/s':>10} {'x torch':>8}")
    for r in rows:
        hidden = f"{r['hidden_share']:.2f}" if r["hidden_share"] is not None else "-"
        ratio = f"{r['overhead_vs_torch']:.2f}" if "overhead_vs_torch" in r else "-"
        print(f"{r['impl']:<6} {r['world']:>2} {r['local_step_ms']:>9.2f} {r['ddp_step_ms']:>8.2f} "
              f"{r['overhead_ms']:>9.2f} {r['comm_alone_ms']:>8.2f} {hidden:>7} "
              f"{r['samples_per_s']:>10.0f} {ratio:>8}")
    for r in rows:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
