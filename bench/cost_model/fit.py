"""Fitting the cost model to measurements: least squares on relative errors, each path's and
memory's parameters, shoal's own costs, the median over rounds, and the fit's report."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from typing import Sequence

import numpy as np

from .constants import (
    CALIBRATION_BYTES,
    MEMORY_SIZES,
    SHM_CALIBRATION_SIZES,
    SHM_CHUNK_BYTES,
    SHM_W2_MIN_CHUNK_BYTES,
)
from .formulas import Model
from .params import Link, Memory, ShmCost
from .units import KiB, MiB, fmt_size, gbps


def fit_line(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of t = a + b x by least squares on relative errors (weights 1/t).

    Plain least squares would let the largest sizes decide alone; weighting by 1/t fits the
    small sizes (where the intercept shows) as closely as the large ones.
    """
    if len(xs) != len(ts) or len(xs) < 2:
        raise ValueError(f"fit_line needs two or more (x, t) pairs, got {len(xs)} and {len(ts)}")
    x = np.asarray(xs, dtype=float)
    t = np.asarray(ts, dtype=float)
    if np.any(t <= 0):
        raise ValueError("fit_line needs positive times")
    w = 1.0 / t
    design = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    return float(a), float(b)


def fit_link(timings: dict) -> Link:
    """Latencies from the ping-pongs' intercepts, (o, beta) from the exchange stream."""
    a_block = fit_line(list(timings["pingpong"]), list(timings["pingpong"].values()))[0]
    a_spin = fit_line(list(timings["pingpong_spin"]), list(timings["pingpong_spin"].values()))[0]
    o, beta = fit_line(list(timings["stream"]), list(timings["stream"].values()))
    c_msg = None
    if timings.get("pingpong_cpu"):
        c_msg = max(0.0, fit_line(list(timings["pingpong_cpu"]),
                                  list(timings["pingpong_cpu"].values()))[0])
    busy = 1.0
    cpu = timings.get("stream_cpu")
    if cpu:
        big = [n for n in cpu if n >= 256 * KiB]
        if big:
            busy = statistics.median(cpu[n] / timings["stream"][n] for n in big)
    return Link(max(a_block, 0.0), max(a_spin, 0.0), max(o, 0.0), beta,
                busy=min(1.0, max(0.25, busy)), c_msg=c_msg)


def fit_memory(raw: dict, llc_bytes: int) -> Memory:
    """Copy and add costs per byte, in cache and beyond: the slopes over MEMORY_SIZES."""
    slopes = {}
    for kind in ("copy", "add"):
        for where in ("cache", "mem"):
            ts = [raw[f"{kind}_{where}_{n}"] for n in MEMORY_SIZES]
            slopes[kind, where] = fit_line(MEMORY_SIZES, ts)[1]
    return Memory(slopes["copy", "cache"], slopes["copy", "mem"], slopes["add", "cache"],
                  slopes["add", "mem"], llc_bytes)


def _int_keys(value):
    """`value` with every all-digit dict key turned back into an int (JSON made them str)."""
    if isinstance(value, dict):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): _int_keys(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_int_keys(v) for v in value]
    return value


def fit_model(raw: dict) -> Model:
    """The model from `measure`'s raw figures (fresh, or read back from a saved run)."""
    raw = _int_keys(raw)
    links = {name: fit_link(raw[name]) for name in ("unix", "tcp_lo")}
    links["veth"] = fit_link(raw["veth"]) if "veth" in raw else links["tcp_lo"]
    memory = fit_memory(raw["memory"], raw["llc_bytes"])
    # shoal's own work per data message: its 2-rank 4 KiB all_reduce (one message each way)
    # beyond what the raw unix exchange of that message and its reduction cost.
    unix = links["unix"]
    raw_exchange = (unix.a_block + unix.o
                    + CALIBRATION_BYTES * (unix.beta + memory.rates(4 * CALIBRATION_BYTES)[1]))
    sw = max(0.0, raw["shoal_calls"]["all_reduce"] - raw_exchange)
    links = {name: dataclasses.replace(link, sw=sw) for name, link in links.items()}
    if raw.get("veth_ring"):
        links["veth"] = fit_veth_ring(links["veth"], memory, raw["veth_ring"])
    shm = fit_shm({int(key[4:]): t for key, t in raw["shoal_shm"].items()}, memory)
    return Model(links, memory, shm)


def fit_veth_ring(veth: Link, memory: Memory, rows: list[dict]) -> Link:
    """veth's per-byte cost as shoal's own ring sees it: its all_reduce on 2 hosts x 1 rank (a
    configuration the check does not use) at 256 KiB, 4 MiB and 64 MiB.

    A raw two-process stream (`peer._drive`) moves bytes through Python's sender thread and the
    GIL; shoal's ring keeps its copies in C and overlaps them differently, and measured up to
    1.8x faster per byte here. With W = 2 a ring is two steps of S/2 and one reduction of
    S/2: t(S) - (S/2) g - 2 (a + sw + o) = S beta, beta fitted through the origin (relative
    errors, as `fit_line`). The per-message cost o stays the raw stream's, fitted over
    16 KiB-4 MiB: the ring's own intercept, three sizes from 256 KiB to 64 MiB, moved between
    0 and 92 us from round to round (2026-11-28) and with it every 256 KiB prediction."""
    fixed = 2 * (veth.a_block + veth.sw + veth.o)
    sizes, ts, busy = [], [], []
    for row in rows:
        if not row.get("shoal_ms"):
            continue
        n = row["bytes"]
        sizes.append(n)
        ts.append(row["shoal_ms"] / 1e3)
        if row.get("shoal_cpu_ms"):  # both ranks' CPU per op
            busy.append(row["shoal_cpu_ms"] / (2 * row["shoal_ms"]))
    if not sizes:
        return veth
    x = np.asarray(sizes, dtype=float)
    t = np.asarray(ts, dtype=float)
    y = t - fixed - (x / 2) * np.array([memory.rates(4 * n)[1] for n in sizes])
    w2 = 1.0 / t ** 2
    beta = float(np.sum(w2 * x * y) / np.sum(w2 * x * x))
    fitted = dataclasses.replace(veth, beta=max(beta, 0.0))
    # The per-byte cost being the ring's, so is its busy fraction: the ring kept each rank's
    # core 0.9-1.0 busy on 2026-11-28 where the raw stream kept 0.73.
    if busy:
        fitted = dataclasses.replace(fitted, busy=min(1.0, max(0.25, statistics.median(busy))))
    return fitted


def fit_shm(times: dict, memory: Memory) -> ShmCost:
    """shoal's shared-memory all_reduce of 2 ranks, t(S) = m(S) b2 + eta S (c + g) (the
    microbenchmark's c and g for S's working set; m(S) steps of S/4 within 256 KiB .. 4 MiB):
    the cost b2 of one step's barrier and bookkeeping, and eta, how much slower than the
    microbenchmark its copies and adds run."""
    steps, work, ts = [], [], []
    for n, t in sorted(times.items()):
        chunk = min(SHM_CHUNK_BYTES, max(SHM_W2_MIN_CHUNK_BYTES, n // 4))
        c, g = memory.rates(2 * 2 * n)
        steps.append(math.ceil(n / chunk))
        work.append(n * (c + g))
        ts.append(t)
    w = 1.0 / np.asarray(ts)
    design = np.stack([steps, work], axis=1) * w[:, None]
    (b2, eta), *_ = np.linalg.lstsq(design, np.asarray(ts) * w, rcond=None)
    return ShmCost(max(float(b2), 0.0), max(float(eta), 0.0))


def median_model(models: Sequence[Model]) -> Model:
    """Every fitted parameter's median over the rounds' models (one noisy calibration, such
    as a 52 us `sw` in one round of 2026-11-28's, then moves no prediction)."""

    def median_of(items):
        fields = {}
        for field in dataclasses.fields(items[0]):
            values = [v for v in (getattr(item, field.name) for item in items) if v is not None]
            if not values:  # no round measured it (c_msg before 2026-11-28)
                fields[field.name] = None
            elif isinstance(values[0], float):
                fields[field.name] = statistics.median(values)
            else:
                fields[field.name] = statistics.median_low(values)
        return type(items[0])(**fields)

    first = models[0]
    return Model({name: median_of([m.links[name] for m in models]) for name in first.links},
                 median_of([m.memory for m in models]), median_of([m.shm for m in models]))


def print_fits(model: Model, cores: int, loads: dict) -> None:
    """The fitted parameters as a table, then as one JSON row."""
    print(f"fitted on this machine ({cores} cores; least squares, weights 1/t, medians)"
          + ("; other work's runnable tasks meanwhile (B): "
             + ", ".join(f"{name} {b:.1f}" for name, b in loads.items()) if loads else ""))
    print(f"  {'path':<8} {'a_block us':>10} {'a_spin us':>10} {'c us':>6} {'o us':>7} "
          f"{'beta ns/B':>10} {'GB/s':>6} {'busy':>5}")
    for name, p in model.links.items():
        c = f"{p.c_msg * 1e6:.1f}" if p.c_msg is not None else "-"
        print(f"  {name:<8} {p.a_block * 1e6:>10.1f} {p.a_spin * 1e6:>10.1f} {c:>6} "
              f"{p.o * 1e6:>7.1f} {p.beta * 1e9:>10.3f} {gbps(p.beta):>6} {p.busy:>5.2f}")
    print(f"  sw, shoal's own work per data message (its 2-rank 4 KiB all_reduce less the raw "
          f"unix exchange): {model.links['unix'].sw * 1e6:.1f} us")
    if model.shm.step is not None:
        print(f"  shoal's shared memory, fitted to its 2-rank all_reduce of "
              f"{', '.join(fmt_size(n) for n in SHM_CALIBRATION_SIZES)}: "
              f"{model.shm.step * 1e6:.1f} us a step, its copies and adds "
              f"{model.shm.eta:.2f} x the microbenchmarks' cost")
    m = model.memory
    print(f"  memory   copy {m.c_cache * 1e9:.3f} ns/B ({gbps(m.c_cache)} GB/s) in cache, "
          f"{m.c_mem * 1e9:.3f} ({gbps(m.c_mem)} GB/s) beyond; float32 add "
          f"{m.g_cache * 1e9:.3f} ({gbps(m.g_cache)} GB/s) / {m.g_mem * 1e9:.3f} "
          f"({gbps(m.g_mem)} GB/s); last-level cache {m.llc_bytes // MiB} MiB")
    print(json.dumps(fit_json(model, cores, loads, "fit")))


def fit_json(model: Model, cores: int, loads: dict, kind: str, **extra) -> dict:
    """A model's JSON row (`kind`: fit, round_fit), with `extra` fields such as the raw
    figures that `replay` refits."""
    return {"bench": "scale_model", "row": kind, **extra, "cores": cores, "background": loads,
            "memory": dataclasses.asdict(model.memory),
            "links": {n: dataclasses.asdict(p) for n, p in model.links.items()},
            "shm": dataclasses.asdict(model.shm)}
