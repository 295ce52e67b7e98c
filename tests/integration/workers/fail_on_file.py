"""A worker that says it is ready, then waits for a file to appear and exits with a code.

Lets a test put the agent into its failure path at the moment it chooses (after it stopped
etcd, say). Without the file it exits 0 after --max-wait seconds."""

import argparse
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-file", required=True)
    parser.add_argument("--exit-code", type=int, default=3)
    parser.add_argument("--max-wait", type=float, default=60.0)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    print(f"rank {rank} ready", flush=True)
    deadline = time.monotonic() + args.max_wait
    while time.monotonic() < deadline:
        if os.path.exists(args.fail_file):
            print(f"rank {rank} fails on purpose with exit code {args.exit_code}", flush=True)
            return args.exit_code
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
