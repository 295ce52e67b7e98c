"""An unchanged-torch worker for `shoal run`: gloo over env://, one all_reduce, and torch's own
`@record`. With --fail-rank R --fail-attempts N, rank R raises a ValueError on the first N
attempts (TORCHELASTIC_RESTART_COUNT < N), so the agent restarts the job or, out of restarts,
reports the error that @record wrote to TORCHELASTIC_ERROR_FILE.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-attempts", type=int, default=0)
    args = parser.parse_args()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == args.fail_rank and attempt < args.fail_attempts:
        raise ValueError(f"rank {rank} found a bad batch on attempt {attempt}")
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    assert total.item() == world * (world + 1) / 2, total
    print(f"torch worker {rank} of {world} done on attempt {attempt}", flush=True)
    # Every rank finishes its traffic before any tears gloo down: torch 2.13 aborts a rank
    # ("terminate called without an active exception") in about one exit in five otherwise.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
