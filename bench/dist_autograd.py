"""Distributed autograd step time: shoal next to torch.distributed.autograd + TensorPipe, same run.

Rows:
- model_parallel_step: examples/model_parallel.py's step on worker 0 (forward over RPC,
  distributed backward, DistributedOptimizer step); two workers.
- ddp_rpc_step: examples/ddp_rpc.py's step on trainer 0 (embedding lookup on the parameter
  server, DDP forward, distributed backward, DistributedOptimizer step, trainer barrier);
  three workers.
- empty_context_<model>: the ratio of a step (forward and backward) inside a context with no
  remote call to the same step with plain local autograd (zero_grad, forward, backward), for
  example 1's two stages on one worker and for a 256-512-512-10 MLP, batch 64.

Both sides run float64 with one thread per process; torch's RPC is TensorPipe forced onto TCP
(`_transports=["uv"], _channels=["basic"]`, PEERS.md), DDP on gloo. Sessions alternate shoal,
torch, shoal, torch; each figure is the median over the session medians, with the spread
beside it. Targets: step time <= 0.7x torch's; an empty context <= 1.10x local autograd.

    python bench/dist_autograd.py               # shoal only
    python bench/dist_autograd.py --compare     # torch beside it
    python bench/dist_autograd.py --quick       # fewer steps and sessions
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
import secrets  # noqa: E402

from shoal.collectives import settings as collective_settings  # noqa: E402
from shoal.core import settings as core_settings  # noqa: E402  (after the thread limits)

if not core_settings.AUTH_TOKEN.is_set():
    os.environ[core_settings.AUTH_TOKEN.name] = secrets.token_hex(16)  # the workers inherit it

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

CTX = multiprocessing.get_context("spawn")
WARMUP = 20
# The empty-context row alternates blocks of local and context steps: step by step, the
# context's fresh gradients would be allocated while .grad still holds the last ones, and the
# page faults of that extra memory (not the context) would dominate the difference.
BLOCK = 50


# ----------------------------------------------------------------------------- shoal side

def _shoal_init(rank: int, world: int) -> None:
    from shoal import rpc_agent

    opts = rpc_agent.RpcBackendOptions(init_method="env://", rpc_timeout=120)
    rpc_agent.init_rpc(f"w{rank}" if world != 3 or rank != 2 else "ps", rank=rank,
                       world_size=world, rpc_backend_options=opts)


def shoal_model_parallel(rank: int, steps: int) -> list:
    from shoal import core, rpc_agent
    from shoal.core.nn import functional as F
    from shoal.examples import model_parallel as ex1
    from shoal.rpc_agent import dist_autograd
    from shoal.rpc_agent.optim import DistributedOptimizer

    _shoal_init(rank, 2)
    times = []
    if rank == 0:
        model = ex1.ModelParallel("w1")
        opt = DistributedOptimizer(core.optim.SGD, model.parameter_rrefs(), lr=ex1.LR)
        for step in range(steps):
            x, y = ex1.batch(step)
            start = time.perf_counter()
            with dist_autograd.context() as cid:
                loss = F.mse_loss(model(x), y)
                dist_autograd.backward(cid, [loss])
                opt.step(cid)
            times.append(time.perf_counter() - start)
    rpc_agent.shutdown(timeout=600)
    return times


def shoal_ddp_rpc(rank: int, steps: int, store_addr: tuple) -> list:
    import shoal.collectives as dist
    from shoal import core, rpc_agent
    from shoal.core.nn import functional as F
    from shoal.examples import ddp_rpc as ex2
    from shoal.rpc_agent import dist_autograd
    from shoal.rpc_agent.optim import DistributedOptimizer

    dist.init_process_group("tcp", init_method="env://")
    trainers = dist.new_group([0, 1])
    if rank == 2:
        ex2._TABLE["table"] = ex2.EmbeddingTable()
    _shoal_init(rank, 3)
    times = []
    if rank != 2:
        table = rpc_agent.rpc_sync("ps", ex2.table_rref)
        model = dist.DistributedDataParallel(ex2.Dense(), process_group=trainers)
        rrefs = table.rpc_sync().parameter_rrefs() + [rpc_agent.RRef(p)
                                                      for p in model.parameters()]
        opt = DistributedOptimizer(core.optim.SGD, rrefs, lr=ex2.LR)
        for step in range(steps):
            indices, targets = ex2.batch(step, rank)
            start = time.perf_counter()
            with dist_autograd.context() as cid:
                loss = F.mse_loss(model(table.rpc_sync().forward(indices)), targets)
                dist_autograd.backward(cid, [loss])
                opt.step(cid)
            dist.barrier(group=trainers)
            times.append(time.perf_counter() - start)
    rpc_agent.shutdown(timeout=600)
    dist.destroy_process_group()
    return times if rank == 0 else []


def shoal_empty_context(steps: int, model: str) -> tuple:
    from shoal import core, rpc_agent
    from shoal.core import nn
    from shoal.core.nn import functional as F
    from shoal.examples import model_parallel as ex1
    from shoal.rpc_agent import dist_autograd

    _shoal_init(0, 1)
    if model == "example1":
        net = nn.Sequential(ex1.Stage1(), ex1.Stage2())
        x, y = ex1.batch(0)
    else:
        net = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                            nn.Linear(512, 10)).double()
        rng = np.random.default_rng(0)
        x = core.Tensor(rng.standard_normal((64, 256)))
        y = core.Tensor(rng.standard_normal((64, 10)))
    local, ctx = [], []
    for _ in range(0, steps, BLOCK):
        for _ in range(BLOCK):
            start = time.perf_counter()
            net.zero_grad(set_to_none=True)
            F.mse_loss(net(x), y).backward()
            local.append(time.perf_counter() - start)
        net.zero_grad(set_to_none=True)  # no .grad stays alive beside the contexts' gradients
        for _ in range(BLOCK):
            start = time.perf_counter()
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [F.mse_loss(net(x), y)])
            ctx.append(time.perf_counter() - start)
    rpc_agent.shutdown()
    return local, ctx


# ----------------------------------------------------------------------------- processes

def _worker(impl: str, job: str, rank: int, env: dict, args: tuple, results) -> None:
    os.environ.update(env)
    try:
        if impl == "torch":
            import dist_autograd_torch as peer

            fn = {"model_parallel": peer.model_parallel, "ddp_rpc": peer.ddp_rpc,
                  "empty_context": peer.empty_context}[job]
        else:
            fn = {"model_parallel": shoal_model_parallel, "ddp_rpc": shoal_ddp_rpc,
                  "empty_context": shoal_empty_context}[job]
        results.put((rank, "ok", fn(rank, *args) if job != "empty_context" else fn(*args)))
    except BaseException as exc:  # noqa: BLE001  (reported by the parent)
        import traceback

        results.put((rank, "error", f"{impl} {job} rank {rank}: {exc}\n"
                                    f"{traceback.format_exc()}"))


def run_job(impl: str, job: str, world: int, args: tuple, timeout: float = 600.0):
    """One session: `world` fresh processes; rank 0's result."""
    if impl == "torch":
        import torch.distributed as tdist

        store = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        env = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    else:
        from shoal.collectives.store.tcp import TCPStore

        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        env = {collective_settings.USE_AGENT_STORE.name: "1"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(world),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    if job == "ddp_rpc":
        args = args + (("127.0.0.1", store.port),)
    results = CTX.Queue()
    procs = [CTX.Process(target=_worker, args=(impl, job, r, dict(env, RANK=str(r)), args,
                                               results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(world):
            rank, status, value = results.get(timeout=timeout)
            if status != "ok":
                raise RuntimeError(value)
            out[rank] = value
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        del store
    return out[0]


# ----------------------------------------------------------------------------- report

def _median_ms(times: list) -> float:
    return statistics.median(times[WARMUP:]) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", action="store_true",
                        help="run torch.distributed.autograd + TensorPipe beside shoal")
    parser.add_argument("--quick", action="store_true", help="fewer steps and sessions")
    parser.add_argument("--sessions", type=int, default=None)
    args = parser.parse_args(argv)
    impls = ["shoal"]
    if args.compare:
        try:
            import torch.distributed.autograd  # noqa: F401

            impls.append("torch")
        except ImportError:
            print("torch is not installed: running shoal alone", file=sys.stderr)
    sessions = args.sessions or (2 if args.quick else 3)
    steps = WARMUP + (100 if args.quick else 300)
    per: dict = {}
    for _ in range(sessions):
        for impl in impls:  # A B A B
            for job, world, row in (("model_parallel", 2, "model_parallel_step"),
                                    ("ddp_rpc", 3, "ddp_rpc_step")):
                times = run_job(impl, job, world, (steps,))
                per.setdefault(row, {}).setdefault(impl, []).append(_median_ms(times))
            for model in ("example1", "mlp"):
                local, ctx = run_job(impl, "empty_context", 1, (steps, model))
                row = f"empty_context_{model}"
                per.setdefault(row, {}).setdefault(impl, []).append(
                    _median_ms(ctx) / _median_ms(local))
                per.setdefault(f"local_step_{model}", {}).setdefault(impl, []).append(
                    _median_ms(local))
    header = (f"{'row':26} {'unit':12} {'shoal':>10} {'torch':>10} {'shoal/torch':>12}  "
              "spread (shoal; torch)")
    print(header)
    print("-" * len(header))
    lines = []
    for row, values in per.items():
        med = {impl: statistics.median(v) for impl, v in values.items()}
        unit = "ctx/local" if row.startswith("empty") else "ms"
        ratio = med["shoal"] / med["torch"] if "torch" in med and unit == "ms" else None
        target = ""
        if row.endswith("_step") and not row.startswith("local") and ratio is not None:
            target = f"target <= 0.7x: {'met' if ratio <= 0.7 else 'missed'}"
        elif row.startswith("empty"):
            target = f"target <= 1.10: {'met' if med['shoal'] <= 1.10 else 'missed'}"
        spread = "; ".join(f"{min(v):.3g}..{max(v):.3g}" for v in values.values())
        print(f"{row:26} {unit:12} {med['shoal']:10.4g} {med.get('torch', float('nan')):10.4g} "
              f"{(f'{ratio:.2f}x' if ratio else '-'):>12}  {spread}"
              + (f"  [{target}]" if target else ""))
        lines.append({"bench": "dist_autograd", "row": row, "unit": unit,
                      "shoal": med["shoal"], "torch": med.get("torch"), "ratio": ratio,
                      "target": target, "sessions": sessions, "steps": steps - WARMUP,
                      "shoal_sessions": values["shoal"], "torch_sessions": values.get("torch")})
    for line in lines:
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
