"""A small DDP + RPC job for the observability tests: every step each rank "computes"
(sleeps), runs a DDP forward/backward/SGD step on a linear model, makes one RPC to the other
rank, and records the step with shoal.metrics; rank 0 checkpoints every few steps.

--straggler R makes rank R compute 8x longer; --fail-rank R makes rank R exit 1 at
--fail-step on the first attempt only (SHOAL_RESTART_COUNT 0), so the agent restarts once.
--stall-file F: once F exists every rank stops stepping (no steps, no collectives: the "no
progress" case) while the processes stay up. --hang-file F with --hang-rank R: once F exists,
rank R stops before its next step (on the first attempt only) until --stop-file appears, while
the others go on into the step's all-reduce and wait there for it (a one-rank hang). The job
runs until --stop-file appears (at most 120 s).
"""

import argparse
import os
import sys
import time

import numpy as np

import shoal.metrics as sm
import shoal.rpc_agent as rpc
from shoal import collectives, core
from shoal.collectives.ddp.ddp import DistributedDataParallel
from shoal.core import nn
from shoal.elastic.checkpoint import Checkpointer


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stop-file", required=True)
    parser.add_argument("--straggler", type=int, default=-1)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-step", type=int, default=3)
    parser.add_argument("--stall-file", default="")
    parser.add_argument("--compute", type=float, default=0.01)
    parser.add_argument("--hang-rank", type=int, default=-1)
    parser.add_argument("--hang-file", default="")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="the group's collective timeout (a hang ends after it)")
    args = parser.parse_args()
    collectives.init_process_group("tcp", init_method="env://", timeout=args.timeout)
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
    model = nn.Linear(256, 256)
    net = DistributedDataParallel(model)
    opt = core.optim.SGD(net.parameters(), lr=0.01)
    x = core.tensor(np.random.default_rng(rank).standard_normal((8, 256)).astype(np.float32))
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=collectives.get_world_size())
    peer = f"worker{1 - rank}"
    flags = np.zeros(2, dtype=np.float32)
    compute = args.compute * (8 if rank == args.straggler else 1)
    deadline = time.monotonic() + 120
    stalled = False
    while True:
        if stalled:
            if os.path.exists(args.stop_file) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
            continue
        if rank == args.fail_rank and step == args.fail_step and first_attempt:
            print(f"rank {rank} fails at step {step} on purpose", flush=True)
            return 1
        if rank == args.hang_rank and first_attempt and args.hang_file and \
                os.path.exists(args.hang_file):
            print(f"rank {rank} hangs before step {step}", flush=True)
            while not os.path.exists(args.stop_file) and time.monotonic() < deadline:
                time.sleep(0.05)
            args.hang_file = ""
        with sm.step(step, samples=8) as s:
            time.sleep(compute)
            opt.zero_grad()
            loss = (net(x) ** 2).mean()
            loss.backward()
            opt.step()
            rpc.rpc_sync(peer, np.add, args=(np.ones(2), 1.0))
            s.loss = float(loss.item())
        # Every rank leaves (or stalls) after the same step: flags agreed by all_reduce (MAX).
        flags[0] = os.path.exists(args.stop_file) or time.monotonic() > deadline
        flags[1] = bool(args.stall_file) and os.path.exists(args.stall_file)
        collectives.all_reduce(flags, op=collectives.ReduceOp.MAX)
        if flags[0] > 0:
            break
        if flags[1] > 0:
            print(f"rank {rank} stalls after step {step}", flush=True)
            stalled = True
        if ckpt is not None and step % 5 == 0:
            sm.save_checkpoint(ckpt, step, {"step": step, "w": np.zeros(1000)})
        if step % 10 == 0:
            print(f"rank {rank} at step {step}", flush=True)
        step += 1
    rpc.shutdown()
    collectives.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
