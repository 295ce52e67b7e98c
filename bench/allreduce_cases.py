"""What both all_reduce benches run (bench/allreduce.py on one host, bench/allreduce_hosts.py
across network namespaces): the cases' iteration counts, the bus-bandwidth factors, and one
(run, barrier) pair per case for shoal's and for torch's gloo groups."""

from __future__ import annotations

import numpy as np

KiB = 1024
MiB = 1024 * 1024


def iterations(nbytes: int, quick: bool) -> int:
    """Timed iterations of a case of `nbytes` (fewer for larger messages, and with --quick)."""
    if nbytes <= 4 * KiB:
        n = 300
    elif nbytes <= 256 * KiB:
        n = 100
    elif nbytes <= 4 * MiB:
        n = 40
    else:
        n = 12
    return max(3, n // 3) if quick else n


def bus_factor(op: str, world: int) -> float:
    """busbw / algbw as nccl-tests defines it for `op` over `world` ranks."""
    return {"all_reduce": 2 * (world - 1) / world, "broadcast": 1.0,
            "all_gather": (world - 1) / world}[op]


def fmt_size(n: int) -> str:
    """A case's size as the tables print it (4 KiB, 64 MiB)."""
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def shoal_runner(pg, op, n, world, backend="tcp"):
    """(run, barrier) for one case on a shoal process group (cupy arrays for nccl)."""
    xp, sync = np, None
    if backend == "nccl":
        # Late: cupy is needed for nccl only. Device arrays; each op is timed until the GPU
        # finished it.
        import cupy as xp

        sync = xp.cuda.get_current_stream().synchronize
    if op == "all_reduce":
        a = xp.zeros(n, np.float32)
        run = lambda: pg.all_reduce(a)  # noqa: E731
    elif op == "broadcast":
        a = xp.zeros(n, np.float32)
        run = lambda: pg.broadcast(a, src=0)  # noqa: E731
    else:
        x = xp.ones(n // world, np.float32)
        outs = [xp.empty_like(x) for _ in range(world)]
        run = lambda: pg.all_gather(outs, x)  # noqa: E731
    if sync is not None:
        run = (lambda f: lambda: (f(), sync()))(run)
    return run, pg.barrier


def gloo_runner(dist, torch, op, n, world):
    """(run, barrier) for one case on torch's default (gloo) group."""
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
    return run, dist.barrier
