"""Sharding a DataPipe graph over (rank, worker), and where the rank comes from.

Across a job, instance `rank * num_workers + worker` of `world * num_workers` keeps every
`world * num_workers`-th item after each sharding_filter, so every item of an epoch is read by
exactly one worker of one rank. Core cannot ask a process group for the rank (collectives sit
above it): `set_distributed_info` sets it (collectives.data does so from a group), else the
RANK and WORLD_SIZE variables `shoal run` sets are used, else a world of one.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from shoal.core.data.datapipes.iter import IterDataPipe, ShardingFilter, Shuffler

_info: Optional[tuple[int, int]] = None


def set_distributed_info(rank: int, world_size: int) -> None:
    """Declare this process's rank and the world size for DataPipe sharding."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    global _info
    _info = (int(rank), int(world_size))


def distributed_info() -> tuple[int, int]:
    """(rank, world_size): as set, else from RANK/WORLD_SIZE, else (0, 1)."""
    if _info is not None:
        return _info
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return 0, 1


def apply_sharding(pipe: IterDataPipe, num_instances: int, instance_id: int) -> IterDataPipe:
    """Shard every sharding_filter of `pipe`'s graph; returns `pipe`."""
    for node in pipe.graph():
        if isinstance(node, ShardingFilter):
            node.apply_sharding(num_instances, instance_id)
    return pipe


def prepare_in_worker(pipe: Any, worker_id: int, num_workers: int, seed: int) -> None:
    """What the DataLoader does to a pipe before each iteration, in each worker: shard it, and
    seed every shuffle with the iteration's base seed.

    Every worker of every rank gets the same seed (the loader's base seed derives from its
    generator), so they agree on the order they then shard, and a resumed loader, which
    reuses the saved base seed, replays it; as in torch, the loader's seed overrides a pipe's.
    """
    rank, world = distributed_info()
    apply_sharding(pipe, world * num_workers, rank * num_workers + worker_id)
    for node in pipe.graph():
        if isinstance(node, Shuffler):
            node.set_seed(seed)
