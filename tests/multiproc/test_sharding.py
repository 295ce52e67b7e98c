"""fully_shard and ZeroRedundancyOptimizer over the real tcp backend, one process per rank.

Each spawned group trains the same float64 model, whose layers have uneven sizes (7x13, 13x5,
5x3: no parameter divides evenly by 2 or 3), for a few Adam steps on per-rank batches, and sends
its final whole parameters back; the parent compares them with one process training on the
concatenated batch. Gradients differ from the reference only in the order of the sums (a
reduce_scatter or all_reduce adds the ranks' contributions in its own order), a few ulps of
float64; Adam's update is then bounded by lr per step whatever the gradient's size, so after
STEPS steps the parameters agree to far better than 1e-9.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.ranks import run_ranks

STEPS = 3
LR = 0.01
RTOL, ATOL = 1e-9, 1e-10  # see the module docstring


def make_model(hidden=13):
    from shoal import core
    from shoal.core import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(7, hidden, dtype=core.float64)
            self.fc2 = nn.Linear(hidden, 5, dtype=core.float64)
            self.head = nn.Linear(5, 3, dtype=core.float64)

        def forward(self, x):
            return self.head(self.fc2(self.fc1(x).tanh()).tanh())

    core.manual_seed(0)
    return Net()


def batch(step, rank):
    from shoal.core.tensor import Tensor

    rng = np.random.default_rng([step, rank])
    return Tensor(rng.standard_normal((4, 7))), Tensor(rng.standard_normal((4, 3)))


def mse(out, y, scale=1.0):
    diff = out - y
    return (diff * diff).mean() * scale


def reference(world, steps=STEPS, model_fn=make_model, data=batch):
    """The parameters of one process training `model_fn()` on every rank's `data` batch."""
    from shoal import core

    model = model_fn()
    opt = core.optim.Adam(model.parameters(), lr=LR)
    for step in range(steps):
        opt.zero_grad()
        for rank in range(world):
            x, y = data(step, rank)
            mse(model(x), y, 1.0 / world).backward()
        opt.step()
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def _group(rank, world, port):
    from shoal.collectives.backends.tcp.group import ProcessGroupTCP
    from shoal.collectives.store.tcp import TCPStore

    return ProcessGroupTCP(TCPStore("127.0.0.1", port, timeout=30), rank, world, timeout=30)


def sharded(model, group, **kw):
    from shoal.collectives.fsdp import fully_shard

    fully_shard(model.fc1, mesh=group, **kw)
    fully_shard(model.fc2, mesh=group, **kw)
    return fully_shard(model, mesh=group, **kw)  # the root holds `head`


def full_state(model):
    """Every parameter whole, by name (a collective)."""
    return {k: v.full_tensor().numpy() for k, v in model.named_parameters()}


def train_fsdp(model, group, steps=STEPS, start=0, opt=None, rank=None):
    from shoal import core

    opt = opt or core.optim.Adam(model.parameters(), lr=LR)
    for step in range(start, steps):
        opt.zero_grad()
        x, y = batch(step, group.rank() if rank is None else rank)
        mse(model(x), y).backward()
        opt.step()
    return opt


def _fsdp_and_zero(rank, world, port):
    from shoal import core
    from shoal.collectives.ddp.ddp import DistributedDataParallel
    from shoal.collectives.fsdp import model_state_bytes
    from shoal.collectives.optim import ZeroRedundancyOptimizer

    group = _group(rank, world, port)
    try:
        out = {}
        for reshard in (True, False):
            model = sharded(make_model(), group, reshard_after_forward=reshard)
            train_fsdp(model, group)
            out[f"fsdp_reshard={reshard}"] = full_state(model)
        # ZeRO under DDP: DDP averages the gradients, each rank steps its share.
        model = make_model()
        ddp = DistributedDataParallel(model, process_group=group)
        zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=core.optim.Adam,
                                       process_group=group, lr=LR)
        for step in range(STEPS):
            zero.zero_grad()
            x, y = batch(step, rank)
            mse(ddp(x), y).backward()
            zero.step()
        out["zero"] = {k: v.numpy().copy() for k, v in model.state_dict().items()}
        zero.consolidate_state_dict(to=0)
        out["zero_state"] = zero.state_dict() if rank == 0 else None
        out["zero_overlap"] = _zero_overlapped(group, rank)
        # Memory of model state after a step, FSDP against the same model replicated.
        big = sharded(make_model(hidden=256), group)
        opt = train_fsdp(big, group, steps=1)
        out["fsdp_bytes"] = model_state_bytes(big, opt)
        return out
    finally:
        group.shutdown()


def _zero_overlapped(group, rank):
    """ZeRO stepping inside DDP's hook (overlap_with_ddp=True), one bucket per parameter."""
    from shoal import core
    from shoal.collectives.ddp.comm_hooks import allreduce_hook
    from shoal.collectives.ddp.ddp import DistributedDataParallel
    from shoal.collectives.optim import ZeroRedundancyOptimizer, hook_with_zero_step

    model = make_model()
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.0005)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=core.optim.Adam,
                                   process_group=group, overlap_with_ddp=True, lr=LR)
    ddp.register_comm_hook(group, hook_with_zero_step(allreduce_hook, ddp, zero))
    for step in range(STEPS):
        zero.zero_grad()
        x, y = batch(step, rank)
        mse(ddp(x), y).backward()
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def _replica_bytes():
    from shoal import core
    from shoal.collectives.fsdp import model_state_bytes

    model = make_model(hidden=256)
    opt = core.optim.Adam(model.parameters(), lr=LR)
    x, y = batch(0, 0)
    mse(model(x), y).backward()
    opt.step()
    return model_state_bytes(model, opt)


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_and_zero_end_where_one_process_does(world):
    from shoal import core
    from shoal.collectives.store.tcp import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size=world, is_master=True, timeout=30,
                     wait_for_workers=False)
    try:
        results = run_ranks(_fsdp_and_zero, world, args=(store.port,), timeout=90)
    finally:
        store.close()
    want = reference(world)
    for rank, out in enumerate(results):
        for variant in ("fsdp_reshard=True", "fsdp_reshard=False", "zero", "zero_overlap"):
            for name, value in want.items():
                np.testing.assert_allclose(out[variant][name], value, rtol=RTOL, atol=ATOL,
                                           err_msg=f"rank {rank} {variant} {name}")
    # The consolidated ZeRO state is one Adam's over all parameters.
    model = make_model()
    opt = core.optim.Adam(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(world):
            x, y = batch(step, rank)
            mse(model(x), y, 1.0 / world).backward()
        opt.step()
    saved = results[0]["zero_state"]
    assert sorted(saved["state"]) == sorted(opt.state_dict()["state"])
    for index, entry in opt.state_dict()["state"].items():
        np.testing.assert_allclose(saved["state"][index]["exp_avg"].numpy(),
                                   entry["exp_avg"].numpy(), rtol=1e-9, atol=1e-12)
    # Full sharding: params + grads + Adam state held per rank is 1/W of a replica's (DDP holds
    # a replica's and its gradient buckets besides, so this is the stricter bound), plus the
    # padding of each parameter to a multiple of W elements (under W per parameter, far below
    # 10% of these 256-wide layers) and Adam's scalar step counters.
    replica = _replica_bytes()
    for rank, out in enumerate(results):
        assert out["fsdp_bytes"] <= (1 / world + 0.10) * replica, (rank, out["fsdp_bytes"],
                                                                   replica)


def _hybrid(rank, world):
    from shoal import collectives as dist
    from shoal.collectives.fsdp import hybrid_mesh

    dist.init_process_group("tcp", init_method="env://", timeout=30)
    try:
        replicate, shard = hybrid_mesh(shard_size=2)
        model = sharded(make_model(), (replicate, shard))
        train_fsdp(model, shard, rank=rank)  # each world rank its own batch
        return (replicate.size(), shard.size(), model.fc1.weight.numel()), full_state(model)
    finally:
        dist.destroy_process_group()


def test_hybrid_mesh_shards_within_pairs_at_four_ranks():
    from tests.support.ranks import agent_store

    store, env = agent_store(4)
    try:
        results = run_ranks(_hybrid, 4, env=env, timeout=90)
    finally:
        store.close()
    want = reference(4)
    for rank, (sizes, state) in enumerate(results):
        assert sizes == (2, 2, -(-13 * 7 // 2)), sizes  # fc1 split in halves, not quarters
        for name, value in want.items():
            np.testing.assert_allclose(state[name], value, rtol=RTOL, atol=ATOL,
                                       err_msg=f"rank {rank} {name}")
