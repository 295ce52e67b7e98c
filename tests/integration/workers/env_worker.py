"""A worker that meets its peers through the agent's store and reports what it was given.

It connects to the store at MASTER_ADDR:MASTER_PORT (the agent hosts it), sums every rank's
RANK through it (a store-based allreduce), prints its environment as JSON, and then fails,
waits or handles signals as its flags say.
"""

import argparse
import json
import os
import signal
import sys
import time

from shoal.collectives.store.tcp import TCPStore

KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
        "MASTER_PORT", "SHOAL_RUN_ID", "SHOAL_RESTART_COUNT", "SHOAL_CHECKPOINT_DIR",
        "SHOAL_AUTH_TOKEN", "PROMETHEUS_MULTIPROC_DIR", "SHOAL_ASYNC_ERROR_HANDLING",
        "TORCHELASTIC_RESTART_COUNT"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-attempts", type=int, default=1,
                        help="fail while SHOAL_RESTART_COUNT is below this")
    parser.add_argument("--exit-code", type=int, default=3)
    parser.add_argument("--on-sigterm", choices=["default", "exit", "ignore"], default="default")
    parser.add_argument("--wait", type=float, default=0.0, help="seconds to stay up at the end")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ["SHOAL_RESTART_COUNT"])
    if args.on_sigterm == "exit":
        def on_term(signum, frame):
            print(f"rank {rank} got SIGTERM", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
    elif args.on_sigterm == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=30)
    store.add("sum", rank)
    if store.add("arrived", 1) == world:
        store.set("all_arrived", "1")
    store.wait(["all_arrived"], 30)
    total = int(store.add("sum", 0))
    print("ENV " + json.dumps({k: os.environ.get(k) for k in KEYS} | {"sum": total}), flush=True)
    print(f"rank {rank} says hello on stderr", file=sys.stderr, flush=True)
    if rank == args.fail_rank and restart < args.fail_attempts:
        print(f"rank {rank} fails on purpose with exit code {args.exit_code}", flush=True)
        return args.exit_code
    print(f"rank {rank} ready", flush=True)
    time.sleep(args.wait)
    return 0


if __name__ == "__main__":
    sys.exit(main())
