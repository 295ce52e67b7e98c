"""A 2-rank job whose rank 1 SIGKILLs itself between two collectives, once per attempt, until
attempt `--rounds`; rank 0 then sleeps outside any collective, so only its group's failure
handling can notice the loss.

Each attempt's rank 0 first prints the collectives' error counts of the whole job so far (the
multiprocess files every earlier worker left in PROMETHEUS_MULTIPROC_DIR), as
`attempt N errors {"op/kind": count}`. The last attempt prints `last attempt ready` and both
ranks wait for `--stop-file` before leaving cleanly.
"""

import argparse
import json
import os
import signal
import time

import numpy as np

import shoal.collectives as dist


def job_errors() -> dict:
    from prometheus_client import CollectorRegistry, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=os.environ["PROMETHEUS_MULTIPROC_DIR"])
    return {f"{s.labels['op']}/{s.labels['kind']}": s.value
            for family in registry.collect() for s in family.samples
            if s.name == "shoal_collectives_errors_total" and s.value}


def wait_for(path: str, seconds: float) -> None:
    end = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {seconds}s")
        time.sleep(0.005)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--stop-file", required=True)
    args = parser.parse_args()
    attempt = int(os.environ["SHOAL_RESTART_COUNT"])
    dist.init_process_group("tcp", init_method="env://", timeout=30)
    rank = dist.get_rank()
    dist.all_reduce(np.ones(4))
    if rank == 0:
        print(f"attempt {attempt} errors {json.dumps(job_errors(), sort_keys=True)}", flush=True)
    between = os.path.join(args.out, f"attempt{attempt}-rank0-between-ops")
    if attempt < args.rounds:
        if rank == 0:
            open(between, "w").close()
            time.sleep(60)  # outside any collective: the agent stops this rank
            return
        wait_for(between, 30)  # rank 0's all_reduce is over: it has every byte it needs
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        print("last attempt ready", flush=True)
    wait_for(args.stop_file, 60)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
