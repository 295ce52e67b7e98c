"""FSDP2 (`fully_shard`) and ZeroRedundancyOptimizer on the "shoal" backend end with the same
parameters as on gloo, in the same two processes (the world on "shoal", a gloo group beside)."""

from __future__ import annotations


def _model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batches(torch, rank, steps=4):
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(5, 8, generator=g) for _ in range(steps)]


def _fsdp2(torch, pg, rank):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = _model(torch)
    mesh = DeviceMesh.from_group(pg, "cpu")
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)  # all_gather before, reduce_scatter after each layer
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for x in _batches(torch, rank):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor().detach() for p in model.parameters()]


def _zero(torch, pg, rank):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model(torch), process_group=pg)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, process_group=pg, lr=0.01)
    for x in _batches(torch, rank):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _sharded_vs_gloo(rank, world):
    import datetime

    import torch
    import torch.distributed as dist

    import shoal.torch_bridge  # noqa: F401 - registers the "shoal" backend

    torch.set_num_threads(1)
    dist.init_process_group("shoal", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        gloo = dist.new_group(backend="gloo")
        out = {}
        for name, train in (("fsdp2", _fsdp2), ("zero", _zero)):
            on_shoal, on_gloo = train(torch, dist.group.WORLD, rank), train(torch, gloo, rank)
            moved = min(float((a - b).abs().max()) for a, b in zip(on_shoal, _model(torch).parameters()))
            out[name] = (max(float((a - b).abs().max()) for a, b in zip(on_shoal, on_gloo)), moved)
        return out
    finally:
        dist.destroy_process_group()


def test_fsdp2_and_zero_on_shoal_end_with_gloos_parameters(torch_env, run_torch_ranks):
    for rank, out in enumerate(run_torch_ranks(_sharded_vs_gloo, 2, timeout=150, env=torch_env)):
        for name, (worst, moved) in out.items():
            assert moved > 1e-3, (rank, name, moved)  # training changed every parameter
            # Two ranks: a sum of two float32 values is the same in either order, so the
            # reductions, and everything after them, agree exactly.
            assert worst == 0.0, (rank, name, worst)
