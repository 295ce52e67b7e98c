"""The check: the model's predictions against bench/allreduce.py's rows measured in the same
invocation (every rank of every namespace on this machine's cores), and its table."""

from __future__ import annotations

import dataclasses
import statistics
import subprocess

from .allreduce_bench import allreduce_rows, has_hosts_mode
from .constants import SHAPED_LINK_GBIT
from .formulas import Model
from .load import LoadSampler
from .params import Machine
from .units import MiB, fmt_size


def predictions_for(row: dict, model: Model, cores: int) -> list[tuple[str, float, float]]:
    """(label, predicted s, measured s) for each shoal column of one bench/allreduce.py row."""
    nbytes = row["bytes"]
    here = Machine(cores, one_machine=True)
    out = []
    if "hosts" in row:  # --hosts HxL: every rank of every namespace on this machine's cores
        hosts, local = row["hosts"], row["per_host"]
        veth, unix = model.links["veth"], model.links["unix"]
        tag = f"{hosts}x{local}"
        if row.get("link_gbit"):  # --link-gbit: the same links, shaped to a rate
            veth = dataclasses.replace(veth, wire=shaped_wire(row["link_gbit"],
                                                              row.get("mtu") or 1500))
            tag += f" at {row['link_gbit']:g} Gbit/s"
        if row.get("shoal_ms"):
            out.append((f"{tag} hierarchical",
                        model.hierarchical(nbytes, hosts, local, veth, unix, here),
                        row["shoal_ms"] / 1e3))
        if row.get("shoal_flat_ms"):
            out.append((f"{tag} flat ring", model.flat(nbytes, hosts, local, veth, unix, here),
                        row["shoal_flat_ms"] / 1e3))
        return out
    world = row["world"]
    if row.get("shoal_ms"):
        out.append((f"1x{world} shm/unix", model.one_host(nbytes, world, here),
                    row["shoal_ms"] / 1e3))
    if row.get("shoal_tcp_ms"):
        _, g = model.memory.rates(2 * world * nbytes)
        out.append((f"1x{world} ring tcp_lo",
                    model.ring(nbytes, world, [model.links["tcp_lo"]], here.k(1, world),
                               here.spin(world), g), row["shoal_tcp_ms"] / 1e3))
    return out


def shaped_wire(gbit: float, mtu: int = 1500) -> float:
    """Seconds per payload byte on a link shaped to `gbit` Gbit/s: the shaper counts whole
    Ethernet frames, MTU + 14 bytes of header, each carrying MTU - 52 bytes of TCP payload
    (IPv4 20 and TCP 32 with timestamps)."""
    return 8 / (gbit * 1e9) * (mtu + 14) / (mtu - 52)


def _bench_argvs(quick: bool) -> list[list[str]]:
    """bench/allreduce.py's invocations the check compares against: the three layouts over
    the software links, and 2x2 over links shaped to SHAPED_LINK_GBIT (the wire term of the
    model, which the unshaped links never exercise; only its large sizes, where the rate
    shows)."""
    common = ["--no-compare", "--ops", "all_reduce", "--no-loopback"] + (["--quick"] if quick else [])
    if has_hosts_mode():
        # --link-gbit came with this check: a bench with --hosts takes it.
        shaped = ["--link-gbit", f"{SHAPED_LINK_GBIT:g}", "--min-bytes", str(4 * MiB)]
        return ([["--hosts", shape, "--json", *common] for shape in ("2x2", "4x1", "1x4")]
                + [["--hosts", "2x2", "--json", *shaped, *common]])
    print("\nbench/allreduce.py has no --hosts mode yet: checking against its --worlds rows "
          "(one host; shoal_tcp_ms is the ring on loopback TCP)")
    return [["--worlds", "2,4", "--tcp-too", *common]]


def run_bench(quick: bool) -> list[dict]:
    """One run of every check invocation: bench/allreduce.py's all_reduce rows, each with
    `background` (other work's runnable tasks while it ran)."""
    rows = []
    for argv in _bench_argvs(quick):
        try:
            with LoadSampler() as load:
                got = allreduce_rows(argv, timeout=600)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"  bench/allreduce.py {' '.join(argv)}: {exc}")
            continue
        rows.extend(dict(row, background=round(load.background, 2)) for row in got)
    return rows


def compare(model: Model, cores: int, runs: list[list[dict]]) -> list[dict]:
    """(config, bytes, predicted, measured) for every shoal column of the bench rows, the
    measured time the median over `runs` (lists of rows, one per round)."""
    measured: dict[tuple[str, int], list[float]] = {}
    predicted: dict[tuple[str, int], float] = {}
    for rows in runs:
        for row in rows:
            for label, guess, got in predictions_for(row, model, cores):
                key = (label, row["bytes"])
                predicted[key] = guess
                measured.setdefault(key, []).append(got)
    out = []
    for (label, nbytes), guess in predicted.items():
        got = statistics.median(measured[label, nbytes])
        out.append({"bench": "scale_model", "row": "check", "config": label, "bytes": nbytes,
                    "predicted_ms": round(guess * 1e3, 4), "measured_ms": round(got * 1e3, 4),
                    "measured_runs_ms": [round(t * 1e3, 4) for t in measured[label, nbytes]],
                    "error_pct": round(100 * (guess - got) / got, 1)})
    return out


def within(results: list[dict]) -> int:
    """How many of the check's cases the model predicted within 25%."""
    return sum(abs(r["error_pct"]) <= 25 for r in results)


def print_check(results: list[dict], rounds: int) -> None:
    """The check's table: each case's prediction, its measured median and spread, the error."""
    print()
    print(f"{'configuration':<30}{'size':>8} {'predicted ms':>13} {'measured ms':>12} "
          f"{'runs min..max':>18} {'error':>8}")
    for r in results:
        runs = r["measured_runs_ms"]
        flag = "" if abs(r["error_pct"]) <= 25 else "  > 25%"
        print(f"{r['config']:<30}{fmt_size(r['bytes']):>8} {r['predicted_ms']:>13.3f} "
              f"{r['measured_ms']:>12.3f} {f'{min(runs):.3f}..{max(runs):.3f}':>18} "
              f"{r['error_pct']:>+7.1f}%{flag}")
    if results:
        errs = [abs(r["error_pct"]) for r in results]
        print(f"within 25%: {within(results)} of {len(results)}; median |error| "
              f"{statistics.median(errs):.1f}% (the fit and the measured times medians of "
              f"{rounds} round{'s' if rounds != 1 else ''})")
