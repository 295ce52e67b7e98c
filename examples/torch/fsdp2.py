"""A PyTorch FSDP2 script (`torch.distributed.fsdp.fully_shard`), unchanged for shoal:
`shoal run --nproc-per-node 2 examples/torch/fsdp2.py` runs it as torchrun would.

Each layer's parameters are sharded across the ranks (DTensor on a 1-D device mesh); the
script trains a few steps, then gathers the full parameters and checks every rank agrees.
`--backend shoal` asks for the shoal backend of torch.distributed (the optional torch bridge).
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gloo",
                        help="torch.distributed backend: gloo (default), shoal, nccl")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    parser.add_argument("--lr", type=float, default=0.01)
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
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # fully_shard keeps each rank's shard of the same initial weights
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(2000 + rank)
    for step in range(args.steps):
        x = torch.randn(args.batch, 32, generator=data)
        y = x[:, :1] * 2.0 - x[:, 1:2]
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    full = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(gathered, full)
    if any(not torch.equal(g, full) for g in gathered):
        raise RuntimeError(f"rank {rank}: the ranks' gathered parameters differ")
    if rank == 0:
        print(f"fsdp2 done: {world} ranks, {args.steps} steps, backend {args.backend}, "
              f"restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", flush=True)
    # Free the sharded model and its mesh (they hold the process group, in reference cycles)
    # while the group is alive, and let every rank finish its traffic before any tears gloo
    # down: left to the interpreter's exit, torch 2.13 sometimes destroys gloo's group during
    # finalization and aborts the rank ("terminate called without an active exception").
    del model, opt, mesh
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
