"""A plain PyTorch DDP script, unchanged for shoal: `shoal run --nproc-per-node 2
examples/torch/ddp.py` runs it exactly as `torchrun --nproc-per-node 2 examples/torch/ddp.py`.

It reads torchrun's environment through `init_process_group(backend)` (env://), trains a small
MLP on synthetic data, and checks at the end that every rank holds the same parameters.
`--backend shoal` asks for the shoal backend of torch.distributed (the optional torch bridge);
`--backend gloo` (the default) is torch's own.
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gloo",
                        help="torch.distributed backend: gloo (default), shoal, nccl")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--lr", type=float, default=0.05)
    return parser.parse_args()


def load_backend(name: str) -> None:
    """Importing shoal's torch bridge registers the "shoal" backend with torch.distributed."""
    if "shoal" in name:
        import shoal.torch_bridge  # noqa: F401, PLC0415  (only --backend shoal needs it)


@record
def main() -> None:
    args = parse_args()
    load_backend(args.backend)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts them anyway)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of samples
    for step in range(args.steps):
        x = torch.randn(args.batch, 16, generator=data)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    if any(not torch.equal(g, flat) for g in gathered):
        raise RuntimeError(f"rank {rank}: the ranks' parameters differ after training")
    if rank == 0:
        print(f"ddp done: {world} ranks, {args.steps} steps, backend {args.backend}, "
              f"restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", flush=True)
    # Free DDP (it holds the process group, in reference cycles) while the group is alive, and
    # let every rank finish its traffic before any tears gloo down: left to the interpreter's
    # exit, torch 2.13 sometimes destroys gloo's group during finalization and aborts the rank
    # ("terminate called without an active exception"), under torchrun as under shoal run.
    del ddp, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
