"""DDP step time, samples/s and communication hidden behind backward, shoal next to torch DDP.

An MLP 784-1024-1024-10 (float32, batch 128 per rank, plain SGD, cross-entropy) trains at
W = 1 and 2 ranks, one thread per rank, on the tcp backend (shoal) and on gloo (torch), in the
same run. Inside each group the ranks alternate blocks of local steps (the bare model, no
communication) with blocks of DDP steps, meeting at a barrier before each block, and every step
is timed on the slowest rank. The figures, as PEERS.md defines them:

  overhead  = median DDP step - median local step      (target: shoal <= 0.5 x torch)
  comm      = the same buckets all-reduced back to back on an idle group
  hidden    = 1 - overhead / comm                      (the share backward hid; clamped 0..1)

    python bench/ddp.py                      # W = 1 and 2, torch peer when installed
    python bench/ddp.py --worlds 2 --repeats 3 --no-compare
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("SHOAL_AUTH_TOKEN", "bench-ddp-token")

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


# ------------------------------------------------------------------ shoal rank

def _shoal_model(seed):
    import core
    from core import nn

    core.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _shoal_rank(rank, world, port, cfg, out):
    try:
        import core
        from collectives import ddp_metrics
        from collectives.ddp import DistributedDataParallel
        from collectives.pg_tcp import ProcessGroupTCP
        from collectives.store_tcp import TCPStore
        from core.nn import functional as F

        store = TCPStore("127.0.0.1", port, timeout=60)
        group = ProcessGroupTCP(store, rank, world, timeout=120)

        local = _shoal_model(cfg["seed"])
        local_opt = core.optim.SGD(local.parameters(), lr=0.01)
        ddp = DistributedDataParallel(_shoal_model(cfg["seed"]), process_group=group)
        ddp_opt = core.optim.SGD(ddp.parameters(), lr=0.01)
        rng = np.random.default_rng([cfg["seed"], rank])
        x = core.tensor(rng.standard_normal((cfg["batch"], SIZES[0])).astype(np.float32))
        y = core.tensor(rng.integers(0, SIZES[-1], cfg["batch"]).astype(np.int64))

        def step(model, opt):
            t0 = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            return time.perf_counter() - t0

        wait_hist = ddp_metrics.COMM_WAIT_SECONDS
        result = _alternate(
            lambda: step(local, local_opt), lambda: step(ddp, ddp_opt), group.barrier, cfg,
            exposed=lambda: _hist_sum(wait_hist),
        )
        sizes = ddp.reducer.bucket_nbytes
        buffers = [np.zeros(n // 4, dtype=np.float32) for n in sizes]

        def comm_once():
            group.barrier()
            t0 = time.perf_counter()
            works = [group.all_reduce(b, async_op=True) for b in buffers]
            for w in works:
                w.wait()
            return time.perf_counter() - t0

        result["comm"] = [comm_once() for _ in range(cfg["comm_iters"])]
        result["buckets"] = sizes
        out.put((rank, "ok", result))
        group.shutdown()
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def _hist_sum(hist):
    for metric in hist.collect():
        for sample in metric.samples:
            if sample.name.endswith("_sum"):
                return sample.value
    return 0.0


# ------------------------------------------------------------------ torch rank

def _torch_rank(rank, world, init_file, cfg, out):
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)

        def model():
            torch.manual_seed(cfg["seed"])
            layers = []
            for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
                layers.append(torch.nn.Linear(a, b))
                if i < len(SIZES) - 2:
                    layers.append(torch.nn.ReLU())
            return torch.nn.Sequential(*layers)

        local = model()
        local_opt = torch.optim.SGD(local.parameters(), lr=0.01)
        ddp = torch.nn.parallel.DistributedDataParallel(model())
        ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        rng = np.random.default_rng([cfg["seed"], rank])
        x = torch.from_numpy(rng.standard_normal((cfg["batch"], SIZES[0])).astype(np.float32))
        y = torch.from_numpy(rng.integers(0, SIZES[-1], cfg["batch"]).astype(np.int64))

        def step(m, opt):
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
            return time.perf_counter() - t0

        result = _alternate(lambda: step(local, local_opt), lambda: step(ddp, ddp_opt),
                            dist.barrier, cfg)
        buffers = [torch.zeros(n // 4) for n in cfg["buckets"]]

        def comm_once():
            dist.barrier()
            t0 = time.perf_counter()
            works = [dist.all_reduce(b, async_op=True) for b in buffers]
            for w in works:
                w.wait()
            return time.perf_counter() - t0

        result["comm"] = [comm_once() for _ in range(cfg["comm_iters"])]
        out.put((rank, "ok", result))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


# ------------------------------------------------------------------ shared timing loop

def _alternate(local_step, ddp_step, barrier, cfg, exposed=None):
    """Warm up, then alternate blocks of local and DDP steps; per-step seconds of each."""
    for _ in range(cfg["warmup"]):
        local_step()
        ddp_step()
    local, ddp, waits = [], [], []
    for _ in range(cfg["blocks"]):
        barrier()
        local.extend(local_step() for _ in range(cfg["block"]))
        barrier()
        for _ in range(cfg["block"]):
            before = exposed() if exposed else 0.0
            ddp.append(ddp_step())
            if exposed:
                waits.append(exposed() - before)
    return {"local": local, "ddp": ddp, "exposed": waits}


# ------------------------------------------------------------------ parent

def _run_group(impl, world, cfg):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    cleanup = None
    if impl == "shoal":
        from collectives.store_tcp import TCPStore

        master = TCPStore("127.0.0.1", 0, is_master=True, timeout=60)
        where, cleanup = master.port, master.close
        target = _shoal_rank
    else:
        fd, where = tempfile.mkstemp(prefix="bench-ddp-gloo-")
        os.close(fd)
        os.unlink(where)
        target = _torch_rank
    procs = [ctx.Process(target=target, args=(r, world, where, cfg, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        deadline = time.monotonic() + JOIN_S
        while len(results) < world:
            rank, status, payload = out.get(timeout=max(1.0, deadline - time.monotonic()))
            if status != "ok":
                raise RuntimeError(f"{impl} rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        if cleanup:
            cleanup()
    # Per step, the slowest rank.
    merged = {}
    for key in ("local", "ddp", "comm", "exposed"):
        series = [results[r][key] for r in range(world)]
        merged[key] = [max(vals) for vals in zip(*series)] if series[0] else []
    merged["buckets"] = results[0].get("buckets")
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
    parser.add_argument("--block", type=int, default=10, help="steps per A/B block")
    parser.add_argument("--blocks", type=int, default=4, help="A/B blocks per group")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--comm-iters", "--comm_iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2,
                        help="groups per implementation, alternating shoal and torch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-compare", "--no_compare", action="store_true",
                        help="skip torch DDP even when torch is installed")
    args = parser.parse_args(argv)
    cfg = {"batch": args.batch, "block": args.block, "blocks": args.blocks,
           "warmup": args.warmup, "comm_iters": args.comm_iters, "seed": args.seed}
    impls = ["shoal"]
    if not args.no_compare:
        try:
            import torch  # noqa: F401, PLC0415

            impls.append("torch")
        except ImportError:
            print("torch is not installed: timing shoal alone")

    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        runs = {impl: {"local": [], "ddp": [], "comm": [], "exposed": []} for impl in impls}
        for _ in range(args.repeats):
            for impl in impls:  # A B A B across groups
                cfg_run = dict(cfg)
                if impl == "torch":
                    cfg_run["buckets"] = runs["shoal"]["buckets"]
                got = _run_group(impl, world, cfg_run)
                for key in ("local", "ddp", "comm", "exposed"):
                    runs[impl][key].extend(got[key])
                if got.get("buckets"):
                    runs[impl]["buckets"] = got["buckets"]
        for impl in impls:
            r = runs[impl]
            local, ddp, comm = _median_ms(r["local"]), _median_ms(r["ddp"]), _median_ms(r["comm"])
            overhead = ddp - local
            row = {
                "bench": "ddp", "impl": impl, "world": world, "batch_per_rank": args.batch,
                "model": "mlp-784-1024-1024-10", "dtype": "float32",
                "steps": len(r["ddp"]), "local_step_ms": local, "ddp_step_ms": ddp,
                "ddp_spread_ms": _spread_ms(r["ddp"]), "overhead_ms": overhead,
                "comm_alone_ms": comm,
                "hidden_share": min(1.0, max(0.0, 1.0 - overhead / comm)) if world > 1 else None,
                "samples_per_s": world * args.batch / (ddp / 1e3),
            }
            if impl == "shoal" and r["exposed"]:
                row["exposed_wait_ms"] = _median_ms(r["exposed"])
            rows.append(row)
        if "torch" in impls and world > 1:
            shoal_row, torch_row = rows[-len(impls)], rows[-1]
            shoal_row["overhead_vs_torch"] = shoal_row["overhead_ms"] / torch_row["overhead_ms"]

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
