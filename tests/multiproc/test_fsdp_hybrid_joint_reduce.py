"""Hybrid sharding (shard within a "host", replicate across hosts) together with the collectives
that travel together (test_fsdp_joint_reduce): the root's gather carries the first layer's, and
the first layer's gradients leave in one reduce_scatter with the root's, whose output every
group must still all-reduce across the replicas. Four ranks as threads of this process over real
tcp groups (test_sharding_options.hybrid_groups). The shard groups must issue the merged
collectives (the same count as at W=2 without replicas), and the final parameters must equal one
process training on the four ranks' batches (bounds as in test_fsdp_joint_reduce: float64 sums
in another order)."""

from __future__ import annotations

from tests.multiproc.test_fsdp_joint_reduce import (
    check_against_one_process,
    make_model,
    train_counting_ops,
)
from tests.multiproc.test_sharding import sharded
from tests.multiproc.test_sharding_options import hybrid_groups
from tests.support.threaded_ranks import run_all

WORLD = 4


def test_hybrid_sharding_with_the_joint_reduce_matches_one_process():
    shard, replicate = hybrid_groups(timeout=30)
    models = [make_model() for _ in range(WORLD)]

    def body(rank):
        model = sharded(models[rank], (replicate[rank], shard[rank]))
        return train_counting_ops(model, shard[rank], rank)

    try:
        results = run_all(list(range(WORLD)), lambda _, rank: body(rank), timeout=90)
    finally:
        run_all(shard, lambda pg, r: pg.shutdown())
        run_all(replicate, lambda pg, r: pg.shutdown())
    check_against_one_process(results, WORLD)
