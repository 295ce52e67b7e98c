"""What the per-rank metrics cost a collective: shoal's collectives.metrics.observe (with the rank
wait counter and heartbeat of issue 21) against the same call without them, and shoal.metrics'
record_step, next to a 4 KiB all_reduce in shoal and in torch gloo (world size 1, so it is the
per-call machinery, not the network) to put the microseconds in proportion.

Everything runs in one process with PROMETHEUS_MULTIPROC_DIR set, as under `shoal run`
(prometheus_client then writes mmapped files: that is the cost a worker pays). Medians of
alternating blocks.

    python bench/metrics_overhead.py --blocks 7 --calls 20000
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="shoal-bench-mp-"))
os.environ.setdefault("RANK", "0")

import argparse
import socket
import statistics
import time

import numpy as np


def _per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--allreduce-calls", type=int, default=2000)
    args = parser.parse_args()

    import shoal.metrics as sm
    from shoal import collectives
    from shoal.collectives import metrics as cm

    hist, nbytes = cm.OP_DURATION.labels(op="all_reduce", backend="tcp"), cm.BYTES.labels(
        op="all_reduce")

    def before_issue_21():  # what observe() did before: histogram + bytes counter
        hist.observe(1e-4)
        nbytes.inc(4096)

    def now():
        cm.observe("all_reduce", "tcp", 1e-4, 4096)

    step = iter(range(10 ** 9))

    def record_step():
        sm.record_step(next(step), 0.01, samples=32, loss=0.5)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="1")
    collectives.init_process_group("tcp", init_method="env://", timeout=30)
    buf = np.ones(1024, dtype=np.float32)  # 4 KiB

    def shoal_allreduce():
        collectives.all_reduce(buf)

    torch_allreduce = None
    try:
        import torch
        import torch.distributed as tdist

        tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                                 rank=0, world_size=1)
        tbuf = torch.ones(1024)

        def torch_allreduce():
            tdist.all_reduce(tbuf)
    except ImportError:
        print("torch is not installed: no torch row")

    rows = {"observe() before issue 21": (before_issue_21, args.calls),
            "observe() now (+ rank wait, heartbeat)": (now, args.calls),
            "shoal.metrics.record_step": (record_step, args.calls),
            "shoal all_reduce 4 KiB (world 1)": (shoal_allreduce, args.allreduce_calls)}
    if torch_allreduce is not None:
        rows["torch gloo all_reduce 4 KiB (world 1)"] = (torch_allreduce, args.allreduce_calls)
    times = {name: [] for name in rows}
    for _ in range(args.blocks):
        for name, (fn, calls) in rows.items():
            times[name].append(_per_call_us(fn, calls))
    medians = {name: statistics.median(v) for name, v in times.items()}
    print(f"{'':42s} {'median us/call':>15s}")
    for name, us in medians.items():
        print(f"{name:42s} {us:15.2f}")
    added = medians["observe() now (+ rank wait, heartbeat)"] - medians["observe() before issue 21"]
    print(f"added per collective: {added:.2f} us = "
          f"{added / medians['shoal all_reduce 4 KiB (world 1)'] * 100:.1f}% of shoal's 4 KiB "
          "all_reduce" + (f", {added / medians['torch gloo all_reduce 4 KiB (world 1)'] * 100:.1f}%"
                          " of torch gloo's" if torch_allreduce is not None else ""))


if __name__ == "__main__":
    main()
