"""A worker that runs a few allreduces (so its shoal_collectives_* metrics exist) and stays up
until the file named by --stop-file appears (at most 60 s)."""

import argparse
import os
import sys
import time

import numpy as np

from shoal import collectives


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stop-file", required=True)
    args = parser.parse_args()
    collectives.init_process_group("tcp", init_method="env://", timeout=30)
    x = np.ones(4096, dtype=np.float32)
    for _ in range(5):
        collectives.all_reduce(x)
    print(f"rank {collectives.get_rank()} did 5 allreduces: {x[0]:g}; metrics in "
          f"{os.environ['PROMETHEUS_MULTIPROC_DIR']}", flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(args.stop_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    collectives.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
