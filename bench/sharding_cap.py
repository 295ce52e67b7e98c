"""A model whose replica does not fit a per-process memory cap, trained by fully_shard under it.

Each process caps its private writable memory (RLIMIT_DATA: the heap and every numpy array or
torch storage) at what it holds once set up (imports, process group and its threads, BLAS's
buffer) plus one budget, the same for every process and every implementation; past it an
allocation fails (MemoryError, or torch's RuntimeError). glibc's mmap threshold is pinned at
128 KiB so that freed arrays go back to the kernel. The budget is a fraction of one replica's
Adam model state (16 bytes a parameter: parameters, gradients, two moments).

The model: LAYERS Linear(WIDTH, WIDTH) + tanh, float32, batch 16, Adam; fully_shard on each
Linear and on the root, W ranks (torch: FSDP2's fully_shard on gloo, the same layout). The
replica is the same model trained in one process (what DDP holds on each rank, before its
buckets). Peak = the most memory above the set-up a sampler thread saw (every 0.5 ms).

    python bench/sharding_cap.py                        # W=4, 16 x 1024, budget 0.8
    python bench/sharding_cap.py --world 2 --budget 0.9 --no-compare
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from shoal.core import settings as core_settings  # noqa: E402  (after the thread limits)

os.environ.setdefault(core_settings.AUTH_TOKEN.name, "bench-sharding-cap-token")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import ctypes  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402

JOIN_S = 600.0


def _data_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


class _Peak:
    """The most private writable memory seen, sampled by a thread started before the cap."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.0005):
            self.peak = max(self.peak, _data_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return max(self.peak, _data_bytes())


@contextlib.contextmanager
def _capped(budget: int):
    """Cap private writable memory at now + budget; yield (base, peak sampler); lift on exit
    (sending results back starts a thread, whose stack counts too)."""
    square = np.ones((64, 64), dtype=np.float32)
    square @ square  # OpenBLAS allocates its work buffer at its first product: before the cap
    assert ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024) == 1  # M_MMAP_THRESHOLD
    sampler = _Peak()
    base = _data_bytes()
    before = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (base + budget, before[1]))
    try:
        yield base, sampler
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, before)
        sampler.stop()


def _shoal_model(cfg, group):
    from shoal import core
    from shoal.collectives.fsdp import fully_shard
    from shoal.core import nn

    core.manual_seed(0)
    layers = []
    for _ in range(cfg["layers"]):
        layers += [nn.Linear(cfg["width"], cfg["width"]), nn.Tanh()]
    model = nn.Sequential(*layers)
    if group is not None:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=group)
        fully_shard(model, mesh=group)
    opt = core.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt


def _torch_model(cfg, sharded):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers = []
    for _ in range(cfg["layers"]):
        layers += [torch.nn.Linear(cfg["width"], cfg["width"]), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    if sharded:
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _train(impl, cfg, rank, group, sharded):
    """Build and train under the cap; the outcome, the peak above the set-up, step times."""
    rng = np.random.default_rng(rank)
    x_np = rng.standard_normal((16, cfg["width"])).astype(np.float32)
    y_np = rng.uniform(-0.5, 0.5, (16, cfg["width"])).astype(np.float32)
    budget = int(cfg["budget"] * 16 * cfg["layers"] * (cfg["width"] ** 2 + cfg["width"]))
    # One step of a tiny twin first: the modules a first step imports (torch's optimizers
    # pull in torch._dynamo) would otherwise be charged to the budget.
    _steps(impl, {**cfg, "layers": 1, "width": 8, "steps": 1}, x_np[:, :8], y_np[:, :8],
           group, sharded)
    outcome, times, losses = "trained", [], []
    with _capped(budget) as (base, sampler):
        try:
            times, losses = _steps(impl, cfg, x_np, y_np, group, sharded)
        except (MemoryError, RuntimeError) as exc:  # torch reports a failed allocation so
            if not isinstance(exc, MemoryError) and "alloc" not in str(exc).lower():
                raise
            outcome = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:90]}"
    return {"outcome": outcome, "peak": sampler.stop() - base, "budget": budget,
            "step_ms": statistics.median(times) * 1e3 if times else None, "losses": losses}


def _steps(impl, cfg, x_np, y_np, group, sharded):
    """Build the model and train cfg["steps"] steps: (step times, losses)."""
    times, losses = [], []
    if impl == "shoal":
        from shoal.core.tensor import Tensor

        model, opt = _shoal_model(cfg, group if sharded else None)
        x, y = Tensor(x_np), Tensor(y_np)
    else:
        import torch

        model, opt = _torch_model(cfg, sharded)
        x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    for _ in range(cfg["steps"]):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.item()))
    return times, losses


def _sharded_rank(rank, world, port, init_file, cfg, out):
    try:
        out.put((rank, "ok", _sharded_body(rank, world, port, init_file, cfg)))
    except BaseException:  # noqa: BLE001  (the parent must hear of any failure)
        out.put((rank, "error", traceback.format_exc()))


def _sharded_body(rank, world, port, init_file, cfg):
    from shoal.collectives.backends.tcp.group import ProcessGroupTCP
    from shoal.collectives.store.tcp import TCPStore

    group = ProcessGroupTCP(TCPStore("127.0.0.1", port, timeout=60), rank, world, timeout=120)
    small = np.ones(world * 64, dtype=np.float32)  # start the group's threads before the cap
    group.all_gather_into_tensor(small, small[:64].copy(), async_op=True).wait()
    group.reduce_scatter_tensor(small[:64], small.copy(), async_op=True).wait()
    group.barrier()
    result = {"shoal": _train("shoal", cfg, rank, group, True)}
    if cfg["compare"]:
        import warnings

        import torch
        import torch.distributed as dist

        warnings.filterwarnings("ignore", category=FutureWarning)  # the *_tensor spellings
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        warm = torch.ones(world * 64)  # gloo's threads and buffers, before the cap
        dist.all_gather_into_tensor(warm, warm[:64].clone())
        dist.reduce_scatter_tensor(warm[:64], warm.clone())
        group.barrier()
        result["torch"] = _train("torch", cfg, rank, None, True)
        dist.destroy_process_group()
    group.shutdown()
    return result


def _replica(impl, cfg, out):
    try:
        if impl == "torch":
            import torch

            torch.set_num_threads(1)
        out.put((impl, "ok", _train(impl, cfg, 0, None, False)))
    except BaseException:  # noqa: BLE001
        out.put((impl, "error", traceback.format_exc()))


def _spawn(ctx, target, args_list):
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, out)) for args in args_list]
    for p in procs:
        p.start()
    results = {}
    try:
        while len(results) < len(procs):
            key, status, payload = out.get(timeout=JOIN_S)
            if status != "ok":
                raise RuntimeError(f"{key} failed:\n{payload}")
            results[key] = payload
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return results


def run(cfg) -> list[dict]:
    """The rows: fully_shard at W ranks and a replica, each implementation, same budget."""
    from shoal.collectives.store.tcp import TCPStore

    ctx = multiprocessing.get_context("spawn")
    impls = ["shoal", "torch"] if cfg["compare"] else ["shoal"]
    replicas = _spawn(ctx, _replica, [(impl, cfg) for impl in impls])
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=60)
    fd, init_file = tempfile.mkstemp(prefix="bench-sharding-cap-gloo-")
    os.close(fd)
    os.unlink(init_file)
    try:
        ranks = _spawn(ctx, _sharded_rank, [(r, cfg["world"], master.port, init_file, cfg)
                                            for r in range(cfg["world"])])
    finally:
        master.close()
    rows = []
    for impl in impls:
        per_rank = [ranks[r][impl] for r in range(cfg["world"])]
        worst = max(per_rank, key=lambda res: res["peak"])
        failed = [res["outcome"] for res in per_rank if res["outcome"] != "trained"]
        steps = [res["step_ms"] for res in per_rank if res["step_ms"] is not None]
        rows.append({"impl": impl, "setup": "fsdp", "world": cfg["world"],
                     "outcome": failed[0] if failed else "trained",
                     "peak_bytes": worst["peak"], "budget_bytes": worst["budget"],
                     "step_ms": max(steps) if steps else None,
                     "final_loss": per_rank[0]["losses"][-1] if per_rank[0]["losses"] else None})
        rep = replicas[impl]
        rows.append({"impl": impl, "setup": "replica", "world": 1, "outcome": rep["outcome"],
                     "peak_bytes": rep["peak"], "budget_bytes": rep["budget"],
                     "step_ms": rep["step_ms"], "final_loss": None})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--budget", type=float, default=0.8,
                        help="the cap above the set-up, as a fraction of a replica's 16 B/param")
    parser.add_argument("--no-compare", "--no_compare", action="store_true")
    args = parser.parse_args(argv)
    compare = not args.no_compare
    if compare:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("torch is not installed: shoal alone")
            compare = False
    cfg = {"world": args.world, "layers": args.layers, "width": args.width,
           "steps": args.steps, "budget": args.budget, "compare": compare}
    params = args.layers * (args.width ** 2 + args.width)
    print(json.dumps({"bench": "sharding_cap", "params": params,
                      "replica_state_bytes": 16 * params, **cfg}))
    rows = run(cfg)
    print(f"{'impl':<6} {'setup':<8} {'W':>2} {'budget MB':>9} {'peak MB':>8} {'x budget':>8} "
          f"{'step ms':>8}  outcome")
    for r in rows:
        step = f"{r['step_ms']:.1f}" if r["step_ms"] is not None else "-"
        print(f"{r['impl']:<6} {r['setup']:<8} {r['world']:>2} {r['budget_bytes'] / 1e6:>9.1f} "
              f"{r['peak_bytes'] / 1e6:>8.1f} {r['peak_bytes'] / r['budget_bytes']:>8.2f} "
              f"{step:>8}  {r['outcome']}")
    for r in rows:
        print(json.dumps({"bench": "sharding_cap", **{
            k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
