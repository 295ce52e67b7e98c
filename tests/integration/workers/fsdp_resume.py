"""A fully_shard job that resumes from its sharded checkpoint (run by `shoal run`).

    fsdp_resume.py --steps N [--die-after S] [--step-sleep SECONDS [--sleep-below W]]

Every rank trains its share of a global batch of 12 rows per step (float64, uneven layers,
Adam), saving a distributed checkpoint after each step into SHOAL_CHECKPOINT_DIR/step-<k>. On
start it loads the newest complete one (a directory with a .metadata), whatever world size
wrote it. With --die-after S, rank 1 exits with status 3 right after step S's save on the first
attempt (SHOAL_RESTART_COUNT=0), so the agent restarts the group. At the end rank 0 writes the
whole parameters to SHOAL_CHECKPOINT_DIR/final.safetensors and prints `done at step N`. Rank 0
prints `step K saved` after each save; --step-sleep slows the steps so that a test can act
between them (a node joining), only while the world is smaller than --sleep-below if given.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROWS = 12
LR = 0.01


def make_model():
    """The model every rank (and the test's one-process reference) starts from."""
    from shoal import core
    from shoal.core import nn

    core.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13, dtype=core.float64), nn.Tanh(),
                         nn.Linear(13, 5, dtype=core.float64), nn.Tanh(),
                         nn.Linear(5, 3, dtype=core.float64))


def global_batch(step):
    """Step `step`'s 12 rows (inputs, targets)."""
    from shoal.core.tensor import Tensor

    rng = np.random.default_rng([7, step])
    return Tensor(rng.standard_normal((ROWS, 7))), Tensor(rng.standard_normal((ROWS, 3)))


def loss_of(out, y):
    """Mean squared error."""
    diff = out - y
    return (diff * diff).mean()


def reference(steps):
    """The whole parameters after `steps` steps in one process (for the test)."""
    from shoal import core

    model = make_model()
    opt = core.optim.Adam(model.parameters(), lr=LR)
    for step in range(steps):
        opt.zero_grad()
        x, y = global_batch(step)
        loss_of(model(x), y).backward()
        opt.step()
    return {k: v.numpy() for k, v in model.state_dict().items()}


def _latest(ckdir):
    done = [d for d in os.listdir(ckdir) if d.startswith("step-")
            and os.path.exists(os.path.join(ckdir, d, ".metadata"))]
    return max(done, key=lambda d: int(d.split("-")[1]), default=None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--die-after", type=int, default=-1)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--sleep-below", type=int, default=0)
    args = parser.parse_args(argv)

    from shoal import collectives as dist
    from shoal import core
    from shoal.collectives import checkpoint as dcp
    from shoal.collectives.checkpoint.state_dict import get_state_dict, set_state_dict
    from shoal.collectives.fsdp import fully_shard

    dist.init_process_group("tcp", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckdir = os.environ["SHOAL_CHECKPOINT_DIR"]
    model = make_model()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = core.optim.Adam(model.parameters(), lr=LR)
    start = 0
    latest = _latest(ckdir)
    if latest is not None:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": 0}
        dcp.load(state, checkpoint_id=os.path.join(ckdir, latest))
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        start = state["step"]
        print(f"rank {rank} of {world} resumed at step {start} from {latest}", flush=True)
    rows = ROWS // world
    for step in range(start, args.steps):
        opt.zero_grad()
        x, y = global_batch(step)
        loss_of(model(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows]
                ).backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "step": step + 1},
                 checkpoint_id=os.path.join(ckdir, f"step-{step + 1}"))
        if rank == 0:
            print(f"step {step + 1} saved at world size {world}", flush=True)
        if not args.sleep_below or world < args.sleep_below:
            time.sleep(args.step_sleep)
        if (step + 1 == args.die_after and rank == 1
                and os.environ.get("SHOAL_RESTART_COUNT") == "0"):
            print(f"rank {rank} dies after step {step + 1}", flush=True)
            sys.stdout.flush()
            os._exit(3)
    whole = {name: p.full_tensor() for name, p in model.named_parameters()}
    if rank == 0:
        core.save(whole, os.path.join(ckdir, "final.safetensors"))
        print(f"done at step {args.steps}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
