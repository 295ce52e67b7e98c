"""Collectives that travel together, over the real tcp backend, one process per rank: at a
step's start the root's all_gather carries the first layer's too (its prefetch, issued at the
same moment), and the last layer's gradients leave in one reduce_scatter with the root's when
the root's come last (a language model's embedding; here an input projection the root holds).

The model's root holds its first op (`inp`, 7x6) and its head (6x3), the sharded layers sit
between (6x13, 13x6: no parameter divides evenly by 2 or 3), so the root's gradients are
complete only once backward reaches `inp`, after every layer's. Each rank counts the group's
operations in a step (the sequence numbers of barriers around it) and trains a few Adam steps;
the parent compares the final parameters with one process training on the concatenated batch.
As in test_sharding: the sums differ from the reference only in their order, a few ulps of
float64, and Adam moves a parameter by at most lr a step, so 1e-9 is far above the difference.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.ranks import run_ranks

STEPS = 3
LR = 0.01
RTOL, ATOL = 1e-9, 1e-10  # see the module docstring


def make_model():
    from shoal import core
    from shoal.core import nn

    core.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(7, 6, dtype=core.float64)
            self.fc1 = nn.Linear(6, 13, dtype=core.float64)
            self.fc2 = nn.Linear(13, 6, dtype=core.float64)
            self.head = nn.Linear(6, 3, dtype=core.float64)

        def forward(self, x):
            h = self.fc2(self.fc1(self.inp(x).tanh()).tanh())
            return self.head(h.tanh())

    return Net()


def batch(step, rank):
    rng = np.random.default_rng(1000 * step + rank)
    from shoal import core

    return core.tensor(rng.standard_normal((4, 7))), core.tensor(rng.standard_normal((4, 3)))


def mse(out, y, scale=1.0):
    return ((out - y) ** 2).mean() * scale


def reference(world):
    from shoal import core

    model = make_model()
    opt = core.optim.Adam(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(world):
            x, y = batch(step, rank)
            mse(model(x), y, 1.0 / world).backward()
        opt.step()
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def _train(rank, world, port):
    from shoal import core
    from shoal.collectives.backends.tcp.group import ProcessGroupTCP
    from shoal.collectives.fsdp import fully_shard
    from shoal.collectives.store.tcp import TCPStore

    group = ProcessGroupTCP(TCPStore("127.0.0.1", port, timeout=30), rank, world, timeout=30)
    try:
        model = make_model()
        fully_shard(model.fc1, mesh=group)
        fully_shard(model.fc2, mesh=group)
        fully_shard(model, mesh=group)
        opt = core.optim.Adam(model.parameters(), lr=LR)
        ops = []
        for step in range(STEPS):
            before = group.barrier().seq
            opt.zero_grad()
            x, y = batch(step, rank)
            mse(model(x), y).backward()
            opt.step()
            ops.append(group.barrier().seq - before - 1)
        whole = {k: v.full_tensor().numpy() for k, v in model.named_parameters()}
        return ops, whole
    finally:
        group.shutdown()


@pytest.mark.parametrize("world", [2, 3])
def test_the_first_layer_travels_with_the_root_and_training_matches_one_process(world):
    from shoal.collectives.store.tcp import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size=world, is_master=True, timeout=30,
                     wait_for_workers=False)
    try:
        results = run_ranks(_train, world, args=(store.port,), timeout=90)
    finally:
        store.close()
    want = reference(world)
    for rank, (ops, whole) in enumerate(results):
        # all_gathers: the root with fc1 (the first step: apart, as the order is still being
        # learned), fc2, then fc2 and fc1 again in backward; reduce_scatters: fc2's, and fc1's
        # with the root's. Eight a step before, each of them apart.
        assert ops == [7] + [6] * (STEPS - 1), (rank, ops)
        for name, value in want.items():
            np.testing.assert_allclose(whole[name], value, rtol=RTOL, atol=ATOL,
                                       err_msg=f"rank {rank} {name}")
