"""Pipeline bubble fraction against the schedule's theory, shoal next to torch.distributed.pipelining.

S ranks each hold one stage: a Linear(16, 16) followed by a layer whose forward sleeps t_f and
whose backward sleeps t_b = 2 t_f (a fixed, known compute time that two shared cores cannot
distort: a sleeping stage needs no CPU). A step of M micro-batches then keeps each stage busy
for exactly M (t_f + t_b); whatever else the step takes is bubble and messaging:

  bubble   = 1 - M (t_f + t_b) / step time          (the slowest rank's step, median of steps)
  theory   = (S - 1) / (M + S - 1)                  (GPipe and 1F1B alike, with free messages)

shoal runs on the tcp backend, torch on gloo (PipelineStage, ScheduleGPipe, Schedule1F1B), with
the same stages, sizes and sleeps, in turn in the same run.

    python bench/pipeline.py                   # S = 2, 4; M = 4, 8; both schedules; torch too
    python bench/pipeline.py --stages 2 --micro 4 --steps 3 --no-compare
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("SHOAL_AUTH_TOKEN", "bench-pipeline-token")

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import platform  # noqa: E402
import queue  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

WIDTH = 16
ROWS_PER_MICRO = 4
JOIN_S = 600.0
SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")


def _shoal_stage_module(t_f):
    from shoal import core
    from shoal.core import nn

    class Sleep(core.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            time.sleep(t_f)
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            time.sleep(2 * t_f)
            return g

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return Sleep.apply(self.lin(x))

    return Stage()


def _torch_stage_module(torch, t_f):
    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            time.sleep(t_f)
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            time.sleep(2 * t_f)
            return g

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return Sleep.apply(self.lin(x))

    return Stage()


def _mse(out, target):
    diff = out - target
    return (diff * diff).mean()


def _time_steps(sched, first, last, barrier, micro, steps, make):
    times = []
    for i in range(steps + 1):  # the first step pays for set-up (shape exchange) only
        x, y = make(micro * ROWS_PER_MICRO)
        barrier()
        t0 = time.perf_counter()
        sched.step(*([x] if first else []), **({"target": y} if last else {}))
        times.append(time.perf_counter() - t0)
    return times[1:]


def _shoal_rank(rank, world, cfg):
    import numpy as np

    import shoal.collectives as c
    from shoal.collectives import pipelining
    from shoal.core.tensor import Tensor

    c.init_process_group("tcp", init_method="env://", timeout=60)
    rng = np.random.default_rng(rank)
    out = {}
    try:
        for name in SCHEDULES:
            for micro in cfg["micro"]:
                stage = pipelining.PipelineStage(_shoal_stage_module(cfg["t_f"]), rank, world,
                                                 timeout=60)
                sched = getattr(pipelining, name)(stage, micro, loss_fn=_mse)
                out[(name, micro)] = _time_steps(
                    sched, stage.is_first, stage.is_last, c.barrier, micro, cfg["steps"],
                    lambda n: (Tensor(rng.standard_normal((n, WIDTH)).astype(np.float32)),
                               Tensor(rng.standard_normal((n, WIDTH)).astype(np.float32))))
    finally:
        c.destroy_process_group()
    return out


def _torch_rank(rank, world, cfg):
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{cfg['init_file']}", rank=rank,
                            world_size=world)
    out = {}
    try:
        for name in SCHEDULES:
            for micro in cfg["micro"]:
                stage = pipelining.PipelineStage(_torch_stage_module(torch, cfg["t_f"]), rank,
                                                 world, torch.device("cpu"))
                sched = getattr(pipelining, name)(stage, micro, loss_fn=_mse)
                out[(name, micro)] = _time_steps(
                    sched, rank == 0, rank == world - 1, dist.barrier, micro, cfg["steps"],
                    lambda n: (torch.randn(n, WIDTH), torch.randn(n, WIDTH)))
    finally:
        dist.destroy_process_group()
    return out


def _child(impl, rank, world, cfg, env, results):
    os.environ.update(env)
    try:
        fn = _shoal_rank if impl == "shoal" else _torch_rank
        results.put((rank, "ok", fn(rank, world, cfg)))
    except BaseException:  # noqa: BLE001 - reported by the parent with the rank
        results.put((rank, "error", traceback.format_exc()))


def _run(impl, world, cfg):
    """Spawn `world` ranks of `impl`; per (schedule, M), the slowest rank's step times."""
    from shoal.collectives.store.tcp import TCPStore

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=60, wait_for_workers=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(world),
           "SHOAL_USE_AGENT_STORE": "1"}
    fd, init_file = tempfile.mkstemp(prefix="bench-pipeline-gloo-")
    os.close(fd)
    os.unlink(init_file)
    cfg = dict(cfg, init_file=init_file)
    procs = [ctx.Process(target=_child, args=(impl, r, world, cfg, dict(env, RANK=str(r)),
                                              results)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        deadline = time.monotonic() + JOIN_S
        while len(got) < world:
            try:
                rank, status, payload = results.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{impl} ranks {sorted(set(range(world)) - set(got))} sent "
                                   f"nothing within {JOIN_S}s") from None
            if status != "ok":
                raise RuntimeError(f"{impl} rank {rank} failed:\n{payload}")
            got[rank] = payload
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        store.close()
    return {key: [max(v) for v in zip(*(got[r][key] for r in range(world)))] for key in got[0]}


def _machine() -> str:
    """The CPU model and a 64 MiB memcpy rate: figures from different VMs differ by both."""
    import numpy as np

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)
    except OSError:
        pass
    src = np.ones(64 * 2**20, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return f"{model}; memcpy 64 MiB {src.nbytes / best / 1e9:.1f} GB/s"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="2,4", help="comma-separated stage counts S")
    parser.add_argument("--micro", default="4,8", help="comma-separated micro-batch counts M")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row")
    parser.add_argument("--t-f", "--t_f", type=float, default=0.01,
                        help="seconds each stage's forward sleeps per micro-batch")
    parser.add_argument("--compare", action="store_true",
                        help="run torch beside shoal (the default when torch is installed)")
    parser.add_argument("--no-compare", "--no_compare", action="store_true")
    args = parser.parse_args(argv)
    impls = ["shoal"]
    if not args.no_compare:
        try:
            import torch  # noqa: F401
            impls.append("torch")
        except ImportError:
            print("torch is not installed: measuring shoal alone")
    cfg = {"micro": [int(m) for m in args.micro.split(",")], "steps": args.steps,
           "t_f": args.t_f}
    print(f"cpu: {_machine()}; t_f = {args.t_f * 1e3:g} ms, "
          f"t_b = {2 * args.t_f * 1e3:g} ms; shared machine: figures are noisy")
    rows = []
    for world in (int(s) for s in args.stages.split(",")):
        runs = {impl: _run(impl, world, cfg) for impl in impls}
        for (name, micro), _ in runs["shoal"].items():
            theory = (world - 1) / (micro + world - 1)
            busy = micro * 3 * args.t_f
            for impl in impls:
                step = statistics.median(runs[impl][(name, micro)])
                rows.append({"bench": "pipeline", "impl": impl, "schedule": name,
                             "stages": world, "micro": micro, "step_ms": step * 1e3,
                             "bubble": 1.0 - busy / step, "theory": theory})
            if len(impls) == 2:
                rows[-2]["step_vs_torch"] = rows[-2]["step_ms"] / rows[-1]["step_ms"]
    print(f"{'impl':<6} {'schedule':<14} {'S':>2} {'M':>3} {'step ms':>8} {'bubble':>7} "
          f"{'theory':>7} {'x torch':>8}")
    for r in rows:
        ratio = f"{r['step_vs_torch']:.2f}" if "step_vs_torch" in r else "-"
        print(f"{r['impl']:<6} {r['schedule']:<14} {r['stages']:>2} {r['micro']:>3} "
              f"{r['step_ms']:>8.1f} {r['bubble']:>7.3f} {r['theory']:>7.3f} {ratio:>8}")
    for r in rows:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
