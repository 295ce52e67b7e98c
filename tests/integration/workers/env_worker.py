"""A worker that meets its peers through the agent's store and prints what it was given.

Used by the launcher tests before (and besides) real process groups: it checks the store at
MASTER_ADDR:MASTER_PORT works, sums every rank's RANK through it (a store-based allreduce),
and exits with --exit-code on the rank given by --fail-rank on the first attempt.
"""

import argparse
import json
import os
import sys
import time

from collectives.store_tcp import TCPStore


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-attempts", type=int, default=1, help="fail while restart < this")
    parser.add_argument("--exit-code", type=int, default=3)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ["SHOAL_RESTART_COUNT"])
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=30)
    store.add("sum", rank)
    arrived = store.add("arrived", 1)
    store.wait([f"go"] if arrived < world else [], 30) if arrived < world else store.set("go", "1")
    total = int(store.add("sum", 0))
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
            "MASTER_PORT", "SHOAL_RUN_ID", "SHOAL_RESTART_COUNT", "SHOAL_CHECKPOINT_DIR",
            "SHOAL_AUTH_TOKEN", "PROMETHEUS_MULTIPROC_DIR", "SHOAL_ASYNC_ERROR_HANDLING",
            "TORCHELASTIC_RESTART_COUNT"]
    print("ENV " + json.dumps({k: os.environ.get(k) for k in keys} | {"sum": total}))
    print(f"to stderr from {rank}", file=sys.stderr)
    if args.sleep:
        time.sleep(args.sleep)
    if rank == args.fail_rank and restart < args.fail_attempts:
        print(f"rank {rank} fails on purpose with {args.exit_code}", flush=True)
        return args.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
