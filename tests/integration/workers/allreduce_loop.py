"""A worker that joins the default group with init_process_group's default timeout (so
`shoal run --collective-timeout` decides it) and all-reduces in a loop.

In its first attempt (SHOAL_RESTART_COUNT 0) it runs until stopped from outside; after a
restart it does --steps all-reduces and exits 0, so a test can see the job recover."""

import argparse
import os
import sys
import time

import numpy as np

from shoal import collectives


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    collectives.init_process_group("tcp", init_method="env://")
    rank = collectives.get_rank()
    restart = int(os.environ["SHOAL_RESTART_COUNT"])
    print(f"rank {rank} group timeout {collectives.get_default_group().timeout:g}s "
          f"(restart {restart})", flush=True)
    step = 0
    while restart > 0 and step < args.steps or restart == 0 and step < 100000:
        step += 1
        x = np.ones(16, dtype=np.float32)
        collectives.all_reduce(x)
        print(f"rank {rank} step {step} sum {x[0]:g}", flush=True)
        time.sleep(0.05)
    collectives.destroy_process_group()
    print(f"rank {rank} done after restart {restart}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
