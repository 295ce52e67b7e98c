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

from tests.multiproc.test_sharding import (
    ATOL,
    LR,
    RTOL,
    STEPS,
    _group,
    full_state,
    mse,
    reference,
    sharded,
)
from tests.support.ranks import run_ranks


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


def train_counting_ops(model, group, rank):
    """Train `model` (sharded over `group`) STEPS Adam steps on `rank`'s batches; the number of
    `group`'s operations in each step (the sequence numbers of barriers around it) and the
    whole parameters after."""
    from shoal import core

    opt = core.optim.Adam(model.parameters(), lr=LR)
    ops = []
    for step in range(STEPS):
        before = group.barrier().seq
        opt.zero_grad()
        x, y = batch(step, rank)
        mse(model(x), y).backward()
        opt.step()
        ops.append(group.barrier().seq - before - 1)
    return ops, full_state(model)


def check_against_one_process(results, world):
    """Each rank issued the merged collectives and ends with one process's parameters."""
    want = reference(world, model_fn=make_model, data=batch)
    for rank, (ops, whole) in enumerate(results):
        # all_gathers: the root with fc1 (the first step: apart, as the order is still being
        # learned), fc2, then fc2 and fc1 again in backward; reduce_scatters: fc2's, and fc1's
        # with the root's. Eight a step before, each of them apart.
        assert ops == [7] + [6] * (STEPS - 1), (rank, ops)
        for name, value in want.items():
            np.testing.assert_allclose(whole[name], value, rtol=RTOL, atol=ATOL,
                                       err_msg=f"rank {rank} {name}")


def _train(rank, world, port):
    group = _group(rank, world, port)
    try:
        return train_counting_ops(sharded(make_model(), group), group, rank)
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
    check_against_one_process(results, world)
