"""The command line of bench/scale_model.py: measure and fit in rounds, check, predict; or
replay saved output; or run one of a measurement's peer processes."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from . import __doc__ as MODEL_DOC  # the model's description is the package's docstring
from .check import compare, print_check, run_bench, within
from .fit import fit_json, fit_model, median_model, print_fits
from .formulas import Model
from .measure import measure
from .peer import peer_main
from .predict import predict
from .replay import replay


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=MODEL_DOC.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=MODEL_DOC.split("\n\n", 1)[1])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--no-check", action="store_true",
                        help="skip running bench/allreduce.py to check the model")
    parser.add_argument("--rounds", type=int, default=3,
                        help="calibrate and check this many times; the model is every "
                             "parameter's median over the rounds, the measured times the "
                             "median over the rounds' runs (default 3)")
    parser.add_argument("--replay", nargs="+", metavar="LOG",
                        help="no measuring: the check again from saved output of this bench "
                             "(its JSON rows), with the formulas as they are now")
    return parser


def _print_predictions(model: Model) -> None:
    for row in predict(model):
        print(json.dumps(row))


def _replay(logs: list[str]) -> int:
    model, runs, cores = replay(logs)
    print_fits(model, cores, {})
    if runs:
        print_check(compare(model, cores, runs), len(runs))
    else:
        print("\n(no bench rows in the logs: they were --no-check runs; fits and "
              "predictions only)")
    _print_predictions(model)
    return 0


def _one_round(i: int, args: argparse.Namespace, cores: int, loads: dict,
               runs: list) -> Model:
    """Calibrate, fit and (unless --no-check) run the check's benches once; print the
    round's JSON rows and its summary line."""
    raw = measure(5 if args.quick else 9)
    model = fit_model(raw)
    for name, b in raw["background"].items():
        loads.setdefault(name, []).append(b)
    print(json.dumps(fit_json(model, cores, raw["background"], "round_fit", round=i,
                              raw=raw)))
    summary = (f"round {i + 1}/{args.rounds}: a_block unix {model.links['unix'].a_block * 1e6:.1f} "
               f"us, veth {model.links['veth'].a_block * 1e6:.1f} us; veth beta "
               f"{model.links['veth'].beta * 1e9:.3f} ns/B; sw {model.links['unix'].sw * 1e6:.1f} "
               f"us; shm step {model.shm.step * 1e6:.1f} us")
    if not args.no_check:
        rows = run_bench(args.quick)
        runs.append(rows)
        for row in rows:
            print(json.dumps({"bench": "scale_model", "row": "bench", "round": i,
                              "data": row}))
        busy = statistics.fmean(r["background"] for r in rows) if rows else 0.0
        summary += (f"; with this round's fit alone {within(compare(model, cores, [rows]))} "
                    f"of the check's cases within 25% (other work's runnable tasks "
                    f"during the check: {busy:.1f})")
    print(summary, flush=True)
    return model


def _measure_and_check(args: argparse.Namespace) -> int:
    cores = os.cpu_count() or 1
    t0 = time.monotonic()
    models, runs, loads = [], [], {}
    for i in range(args.rounds):
        models.append(_one_round(i, args, cores, loads, runs))
    model = median_model(models)
    print()
    print_fits(model, cores, {name: statistics.median(b) for name, b in loads.items()})
    if runs:
        results = compare(model, cores, runs)
        print_check(results, args.rounds)
        for row in results:
            print(json.dumps(row))
    _print_predictions(model)
    print(f"\n(took {time.monotonic() - t0:.0f} s on {cores} cores shared with other work: "
          f"figures move between runs)")
    return 0


def main(argv=None) -> int:
    """bench/scale_model.py's entry point (`--peer ROLE ...`: a measurement's process)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--peer"]:
        return peer_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be 1 or more")
    if args.replay:
        return _replay(args.replay)
    return _measure_and_check(args)
