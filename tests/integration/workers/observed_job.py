"""A small data-parallel job for the observability tests: every step each rank "computes"
(sleeps), all_reduces a gradient-sized array, and records the step with shoal.metrics; rank 0
checkpoints every few steps.

--straggler R makes rank R compute 8x longer; --fail-rank R makes rank R exit 1 at
--fail-step on the first attempt only (SHOAL_RESTART_COUNT 0), so the agent restarts once.
--stall-after N stops recording steps and collectives after step N (the "no progress" case)
while the process stays up. The job runs until --stop-file appears (at most 120 s).
"""

import argparse
import os
import sys
import time

import numpy as np

import shoal.metrics as sm
from shoal import collectives
from shoal.elastic.checkpoint import Checkpointer


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stop-file", required=True)
    parser.add_argument("--straggler", type=int, default=-1)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-step", type=int, default=3)
    parser.add_argument("--stall-after", type=int, default=-1)
    parser.add_argument("--compute", type=float, default=0.01)
    args = parser.parse_args()
    collectives.init_process_group("tcp", init_method="env://", timeout=30)
    rank = collectives.get_rank()
    first_attempt = os.environ.get("SHOAL_RESTART_COUNT", "0") == "0"
    ckpt = Checkpointer(os.environ["SHOAL_CHECKPOINT_DIR"]) if rank == 0 else None
    start = 0
    if ckpt is not None:
        found = sm.load_latest_checkpoint(ckpt)
        start = found[0] + 1 if found else 0
    # Every rank resumes from rank 0's checkpoint.
    agreed = np.array([start], dtype=np.float64)
    collectives.all_reduce(agreed)
    step = int(agreed[0])
    grad = np.ones(64 * 1024, dtype=np.float32)
    compute = args.compute * (8 if rank == args.straggler else 1)
    deadline = time.monotonic() + 120
    while True:
        if 0 <= args.stall_after < step:
            if os.path.exists(args.stop_file) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
            continue
        if rank == args.fail_rank and step == args.fail_step and first_attempt:
            print(f"rank {rank} fails at step {step} on purpose", flush=True)
            return 1
        with sm.step(step, samples=32) as s:
            time.sleep(compute)
            # Element 0 carries "stop" so every rank leaves after the same step.
            grad[:] = 1
            grad[0] = float(os.path.exists(args.stop_file) or time.monotonic() > deadline)
            collectives.all_reduce(grad)
            s.loss = 1.0 / (step + 1)
        if grad[0] > 0:
            break
        if ckpt is not None and step % 5 == 0:
            sm.save_checkpoint(ckpt, step, {"step": step, "w": np.zeros(1000)})
        if step % 10 == 0:
            print(f"rank {rank} at step {step}", flush=True)
        step += 1
    collectives.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
