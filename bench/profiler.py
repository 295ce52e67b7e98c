"""What profiling costs: bench/core_step.py's MLP step with no profiler, profiler off, on, and
on with record_shapes + profile_memory, next to torch.profiler on torch's same step.

"none" is shoal's engine with the profiler's one hook test taken out (autograd._run recompiled
without it), so off/none is the whole cost of the profiler being there but off. Conditions run
in alternating blocks of --block steps, each "on" block inside its own profile context (entering
and leaving it are not timed), and the table gives medians per step and the ratios. Targets:
shoal off/none <= 1.01; shoal on/off <= torch's on/off.

    python bench/profiler.py --compare --blocks 12
    python bench/profiler.py --compare --batch 8     # a smaller step
    python bench/profiler.py --compare --workload tiny  # 150 tiny ops: per-op overhead shows
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # torch's profiler: no start/stop lines

import argparse  # noqa: E402
import contextlib  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import core_step  # noqa: E402

from shoal import core  # noqa: E402
from shoal.core import autograd  # noqa: E402
from shoal.core import profiler  # noqa: E402

HOOKED = "fn(g) if _profile_hook is None else _profile_hook(node, fn, g)"


def engine_without_hook():
    """autograd._run as it was before the profiler: the same source minus the hook test."""
    src = inspect.getsource(autograd._run)
    if HOOKED not in src:
        raise SystemExit("autograd._run no longer has the expected hook line; update the bench")
    scope: dict = {}
    exec(compile(src.replace(HOOKED, "fn(g)"), autograd.__file__, "exec"),  # noqa: S102
         autograd.__dict__, scope)
    return scope["_run"]


def shoal_condition(name: str, plain_run, hooked_run):
    """A context for one block of shoal steps under condition `name`."""
    @contextlib.contextmanager
    def ctx():
        autograd._run = plain_run if name == "none" else hooked_run
        try:
            if name == "off" or name == "none":
                yield
            else:
                full = name == "on+shapes+memory"
                with profiler.profile(record_shapes=full, profile_memory=full):
                    yield
        finally:
            autograd._run = hooked_run
    return ctx


def torch_condition(torch, name: str):
    """A context for one block of torch steps under condition `name`."""
    @contextlib.contextmanager
    def ctx():
        if name == "off":
            yield
        else:
            full = name == "on+shapes+memory"
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                        record_shapes=full, profile_memory=full):
                yield
    return ctx


def tiny_step(lib, x) -> None:
    """50 rounds of three small ops and the backward: the same calls in shoal and torch."""
    h = x
    for _ in range(50):
        h = (h * 1.01 + 0.1).tanh()
    h.sum().backward()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12, help="blocks per condition")
    parser.add_argument("--block", type=int, default=4, help="timed steps per block")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--compare", action="store_true", help="run torch.profiler's side too")
    parser.add_argument("--workload", choices=("mlp", "tiny"), default="mlp",
                        help="mlp: core_step's step; tiny: 150 small ops and their backward "
                             "(per-op overhead dominates)")
    args = parser.parse_args(argv)

    model, opt = core_step.build_shoal(0)
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((args.batch, core_step.SIZES[0])).astype(np.float32)
    y_np = rng.integers(0, core_step.SIZES[-1], size=args.batch).astype(np.int64)
    x, y = core.tensor(x_np), core.tensor(y_np)
    hooked = autograd._run
    plain = engine_without_hook()
    shoal_step = lambda: core_step.shoal_phases(model, opt, x, y)  # noqa: E731
    if args.workload == "tiny":
        shoal_step = lambda: tiny_step(core, core.ones(16, requires_grad=True))  # noqa: E731
    conds = []
    for name in ("none", "off", "on", "on+shapes+memory"):
        conds.append(("shoal", name, shoal_condition(name, plain, hooked), shoal_step))
    if args.compare:
        torch, tmodel, topt = core_step.build_torch(model)
        tx, ty = torch.from_numpy(x_np), torch.from_numpy(y_np)
        torch_step = lambda: core_step.torch_phases(torch, tmodel, topt, tx, ty)  # noqa: E731
        if args.workload == "tiny":
            torch_step = lambda: tiny_step(torch, torch.ones(16, requires_grad=True))  # noqa: E731
        for name in ("off", "on", "on+shapes+memory"):
            conds.append(("torch", name, torch_condition(torch, name), torch_step))
    times: dict[tuple, list] = {(impl, name): [] for impl, name, _, _ in conds}
    # per round, each condition's block median: ratios within a round cancel the drift of a
    # shared machine far better than ratios of whole-run medians
    rounds: list[dict] = []
    for _, _, ctx, step in conds:  # warm-up: one untimed block each
        with ctx():
            for _ in range(2):
                step()
    for b in range(args.blocks):
        order = conds if b % 2 == 0 else conds[::-1]  # drift hits every condition alike
        this_round = {}
        for impl, name, ctx, step in order:
            block = []
            with ctx():
                for _ in range(args.block):
                    t0 = time.perf_counter()
                    step()
                    block.append(time.perf_counter() - t0)
            times[(impl, name)].extend(block)
            this_round[(impl, name)] = statistics.median(block)
        rounds.append(this_round)

    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    rows = []
    for (impl, name), m in med.items():
        base = med[(impl, "off")]
        model_name = "mlp-784-1024-1024-10" if args.workload == "mlp" else "tiny-150-ops"
        row = {"bench": "profiler", "model": model_name, "batch": args.batch,
               "threads": 1, "impl": impl, "condition": name, "median_ms": m,
               "p10_ms": statistics.quantiles([t * 1e3 for t in times[(impl, name)]], n=10)[0],
               "p90_ms": statistics.quantiles([t * 1e3 for t in times[(impl, name)]], n=10)[-1],
               "vs_off": m / base, "steps": len(times[(impl, name)]),
               "paired_vs_off": statistics.median(r[(impl, name)] / r[(impl, "off")]
                                                  for r in rounds)}
        if impl == "shoal" and name != "none":
            row["vs_none"] = m / med[("shoal", "none")]
            row["paired_vs_none"] = statistics.median(r[(impl, name)] / r[(impl, "none")]
                                                      for r in rounds)
        if args.compare and impl == "shoal" and ("torch", name) in med and name != "off":
            row["overhead_ratio_vs_torch"] = row["paired_vs_off"] / statistics.median(
                r[("torch", name)] / r[("torch", "off")] for r in rounds)
        rows.append(row)
    print(f"{'impl':<6} {'condition':<18} {'median ms':>10} {'p10':>8} {'p90':>8} "
          f"{'x off':>7} {'x none':>7}  (paired: median of per-round ratios)")
    for r in rows:
        vs_none = f"{r['paired_vs_none']:.3f}" if "paired_vs_none" in r else "-"
        print(f"{r['impl']:<6} {r['condition']:<18} {r['median_ms']:>10.2f} {r['p10_ms']:>8.2f} "
              f"{r['p90_ms']:>8.2f} {r['paired_vs_off']:>7.3f} {vs_none:>7}")
    for r in rows:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
