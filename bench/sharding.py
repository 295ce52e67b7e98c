"""Sharded training of the GPT: per-rank model-state memory and step time, shoal's fully_shard
and ZeroRedundancyOptimizer beside torch FSDP2 and torch's ZeroRedundancyOptimizer on gloo.

The model is examples/train_gpt.py's GPT at the main job's size (bench/models.py's GPT_SHAPE:
4 pre-norm blocks of width 144, context 64, batch 24 per rank, AdamW), float32, CPU, one thread
per rank. Every rank holds the four set-ups at once, same weights and data:

  fsdp  fully_shard on each block, then on the root (torch: FSDP2's fully_shard)
  zero  DDP with ZeroRedundancyOptimizer(AdamW) (torch: DDP + its ZeroRedundancyOptimizer)

and runs rotating blocks of steps of each, and of one replica stepping alone (`replica`: no
communication; overhead = a set-up's step - the replica's), meeting the others at a barrier
before each block, so machine noise hits all alike; a step's time is the slowest rank's. Memory is what a rank holds
for parameters, gradients and optimizer state after a step, counted from the arrays (each
distinct buffer once, views by their base; torch: tensor storages), not RSS; `ideal_ratio` is
that over 1/W of one replica's (the same model and AdamW in one process).
Targets (issue 39): fsdp memory within 10% of the 1/W ideal; fsdp step <= 0.8x torch FSDP2.
`floor` is the replica's step over torch FSDP2's: the ratio fully_shard would reach if its
communication and copies cost nothing (the step is compute-bound).

    python bench/sharding.py                  # W=2, torch peer when installed
    python bench/sharding.py --worlds 2,4 --blocks 8
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from shoal.core import settings as core_settings  # noqa: E402  (after the thread limits)

os.environ.setdefault(core_settings.AUTH_TOKEN.name, "bench-sharding-token")

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402

JOIN_S = 900.0


def _shoal_setups(group, seed, world):
    from models import GPT_SHAPE, build

    from shoal import core
    from shoal.collectives.ddp.ddp import DistributedDataParallel
    from shoal.collectives.fsdp import fully_shard
    from shoal.collectives.optim import ZeroRedundancyOptimizer

    fsdp, _, _, _ = build("gpt", seed, None)
    for layer in fsdp.blocks.layers:
        fully_shard(layer, mesh=group)
    fully_shard(fsdp, mesh=group)
    fsdp_opt = core.optim.AdamW(fsdp.parameters(), lr=1e-3)
    zmodel, _, _, _ = build("gpt", seed, None)
    ddp = DistributedDataParallel(zmodel, process_group=group)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=core.optim.AdamW,
                                   process_group=group, lr=1e-3)
    replica, replica_opt, _, _ = build("gpt", seed, None)
    return {"fsdp": (fsdp, fsdp_opt, fsdp_opt), "zero": (ddp, zero, zero.optim),
            "replica": (replica, replica_opt, replica_opt), "vocab": GPT_SHAPE["vocab"]}


def _torch_setups(torch, seed):
    from models import build
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    _, _, fsdp, _ = build("gpt", seed, torch)
    for layer in fsdp.blocks.layers:
        fully_shard(layer)
    fully_shard(fsdp)
    fsdp_opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)
    _, _, zmodel, _ = build("gpt", seed, torch)
    ddp = torch.nn.parallel.DistributedDataParallel(zmodel)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                   lr=1e-3)
    _, _, replica, replica_opt = build("gpt", seed, torch)
    return {"fsdp": (fsdp, fsdp_opt, fsdp_opt), "zero": (ddp, zero, zero.optim),
            "replica": (replica, replica_opt, replica_opt)}


def _torch_bytes(model, opt_state_owner):
    """Bytes of distinct storages behind parameters (local shards), grads and optimizer state."""
    seen = {}

    def add(t):
        if t is None:
            return
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for state in opt_state_owner.state.values():
        for v in state.values():
            if hasattr(v, "untyped_storage"):
                add(v)
    return sum(seen.values())


def _rank(rank, world, port, init_file, cfg, out):
    try:
        out.put((rank, "ok", _rank_body(rank, world, port, init_file, cfg)))
    except BaseException:  # noqa: BLE001  (the parent must hear of any failure)
        out.put((rank, "error", traceback.format_exc()))


def _rank_body(rank, world, port, init_file, cfg):
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from models import inputs

    from shoal import core
    from shoal.collectives.backends.tcp.group import ProcessGroupTCP
    from shoal.collectives.fsdp import model_state_bytes
    from shoal.collectives.store.tcp import TCPStore
    from shoal.core.nn import functional as F

    # As the main job and bench/models.py do: malloc keeps freed activations for the next step
    # instead of page-faulting them in anew. torch runs in this process too, so both gain.
    core.retain_freed_memory()
    group = ProcessGroupTCP(TCPStore("127.0.0.1", port, timeout=60), rank, world, timeout=300)
    x_np, y_np = inputs("gpt", cfg["seed"] * 100 + rank)
    x, y = core.tensor(x_np), core.tensor(y_np)
    shoal = _shoal_setups(group, cfg["seed"], world)

    def shoal_step(model, opt):
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x).reshape(-1, shoal["vocab"]), y).backward()
        opt.step()
        return time.perf_counter() - t0

    kinds = {f"shoal_{k}": (lambda m=shoal[k][0], o=shoal[k][1]: shoal_step(m, o))
             for k in ("fsdp", "zero", "replica")}
    shoal_step(*shoal["replica"][:2])
    memory = {"shoal_replica": model_state_bytes(shoal["replica"][0], shoal["replica"][2])}
    if cfg["compare"]:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        tx, ty = torch.from_numpy(x_np), torch.from_numpy(y_np)
        tsets = _torch_setups(torch, cfg["seed"])

        def torch_step(model, opt):
            t0 = time.perf_counter()
            opt.zero_grad()
            logits = model(tx)
            torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                              ty).backward()
            opt.step()
            return time.perf_counter() - t0

        for k in ("fsdp", "zero", "replica"):
            kinds[f"torch_{k}"] = (lambda m=tsets[k][0], o=tsets[k][1]: torch_step(m, o))
        torch_step(*tsets["replica"][:2])
        memory["torch_replica"] = _torch_bytes(tsets["replica"][0], tsets["replica"][2])
    for _ in range(max(1, cfg["warmup"])):  # memory is read after a step: grads and state exist
        for step in kinds.values():
            step()
    for k in ("fsdp", "zero"):
        memory[f"shoal_{k}"] = model_state_bytes(shoal[k][0], shoal[k][2])
        if cfg["compare"]:
            memory[f"torch_{k}"] = _torch_bytes(tsets[k][0], tsets[k][2])
    times = {kind: [] for kind in kinds}
    order = list(kinds)
    for block in range(cfg["blocks"]):
        shift = block % len(order)
        for kind in order[shift:] + order[:shift]:
            group.barrier()
            for _ in range(cfg["block"]):
                times[kind].append(kinds[kind]())
    if cfg["compare"]:
        dist.destroy_process_group()
    group.shutdown()
    return {"times": times, "memory": memory}


def _run_group(world, cfg):
    from shoal.collectives.store.tcp import TCPStore

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=60)
    fd, init_file = tempfile.mkstemp(prefix="bench-sharding-gloo-")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_rank, args=(r, world, master.port, init_file, cfg, out))
             for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        while len(results) < world:
            rank, status, payload = out.get(timeout=JOIN_S)
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        master.close()
    times = {kind: [max(v) for v in zip(*(results[r]["times"][kind] for r in range(world)))]
             for kind in results[0]["times"]}
    memory = {kind: max(results[r]["memory"][kind] for r in range(world))
              for kind in results[0]["memory"]}
    return times, memory


def _machine() -> dict:
    src = np.ones(64 << 18, dtype=np.float32)  # 64 MiB
    dst = np.empty_like(src)
    copy_s = add_s = float("inf")
    for _ in range(3):  # the best of three: a reference of the machine, not of its load
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copy_s = min(copy_s, time.perf_counter() - t0)
        t0 = time.perf_counter()
        np.add(src, src, out=dst)
        add_s = min(add_s, time.perf_counter() - t0)
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "memcpy_64MiB_GBps": round(src.nbytes / copy_s / 1e9, 2),
            "add_64MiB_GBps": round(3 * src.nbytes / add_s / 1e9, 2),
            "load_average": round(os.getloadavg()[0], 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2", help="comma-separated world sizes")
    parser.add_argument("--block", type=int, default=3, help="steps per block")
    parser.add_argument("--blocks", type=int, default=6, help="rounds of blocks")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", action="store_true",
                        help="run torch beside shoal (the default when torch is installed)")
    parser.add_argument("--no-compare", "--no_compare", action="store_true")
    args = parser.parse_args(argv)
    compare = not args.no_compare
    if compare:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("torch is not installed: timing shoal alone")
            compare = False
    cfg = {"block": args.block, "blocks": args.blocks, "warmup": args.warmup,
           "seed": args.seed, "compare": compare}
    machine = _machine()
    print(json.dumps({"bench": "sharding", "machine": machine}))
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        times, memory = _run_group(world, cfg)
        for kind in times:
            impl, setup = kind.split("_")
            replica = memory[f"{impl}_replica"]
            local = statistics.median(times[f"{impl}_replica"]) * 1e3
            rows.append({
                "bench": "sharding", "impl": impl, "setup": setup, "world": world,
                "model": "gpt-4x144", "steps": len(times[kind]),
                "step_ms": statistics.median(times[kind]) * 1e3,
                "step_spread_ms": (max(times[kind]) - min(times[kind])) * 1e3,
                "overhead_ms": statistics.median(times[kind]) * 1e3 - local,
                "model_state_bytes": memory[kind], "replica_bytes": replica,
                "ideal_ratio": memory[kind] / (replica / world),
            })
        if compare:
            by = {(r["impl"], r["setup"]): r for r in rows if r["world"] == world}
            for setup in ("fsdp", "zero", "replica"):
                by[("shoal", setup)]["step_vs_torch"] = (
                    by[("shoal", setup)]["step_ms"] / by[("torch", setup)]["step_ms"])
            # What fully_shard would reach if its communication and copies cost nothing: the
            # replica's step (its compute) over torch FSDP2's.
            by[("shoal", "fsdp")]["floor_vs_torch"] = (
                by[("shoal", "replica")]["step_ms"] / by[("torch", "fsdp")]["step_ms"])
    print(f"{'impl':<6} {'setup':<7} {'W':>2} {'step ms':>8} {'spread':>7} {'overhead':>8} "
          f"{'state MB':>9} {'x 1/W ideal':>11} {'x torch':>8} {'floor':>6}")
    for r in rows:
        ratio = f"{r['step_vs_torch']:.2f}" if "step_vs_torch" in r else "-"
        floor = f"{r['floor_vs_torch']:.2f}" if "floor_vs_torch" in r else "-"
        print(f"{r['impl']:<6} {r['setup']:<7} {r['world']:>2} {r['step_ms']:>8.1f} "
              f"{r['step_spread_ms']:>7.1f} {r['overhead_ms']:>8.1f} "
              f"{r['model_state_bytes'] / 1e6:>9.3f} "
              f"{r['ideal_ratio']:>11.3f} {ratio:>8} {floor:>6}")
    for r in rows:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
