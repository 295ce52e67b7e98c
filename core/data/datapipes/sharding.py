"""Sharding a DataPipe graph over (rank, worker), and where the rank comes from.

Across a job, instance `rank * num_workers + worker` of `world * num_workers` keeps every
`world * num_workers`-th item after each sharding_filter, so every item of an epoch is read by
exactly one worker of one rank. Core cannot ask a process group for the rank (collectives sit
above it): `set_distributed_info` sets it (collectives.data does so from a group), else the
RANK and WORLD_SIZE variables `shoal run` sets are used, else a world of one.

A loader resumed at another shape re-deals what is left of the epoch (see
core/data/stream_state.py); `resharding` says whether a pipe allows that, and how many of the
shard's items stand behind each item the pipe yields.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from shoal.core.data.datapipes.iter import (
    Batcher,
    Collator,
    Filter,
    IterDataPipe,
    Mapper,
    ShardingFilter,
    Shuffler,
)

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


def prepare_in_worker(pipe: Any, worker_id: int, num_workers: int, seed: int,
                      layout: Optional[tuple[int, Sequence[int]]] = None) -> None:
    """What the DataLoader does to a pipe before each iteration, in each worker: shard it
    (passing over the positions in `layout`, a resumed epoch's (start, skip)), and seed every
    shuffle with the iteration's base seed.

    Every worker of every rank gets the same seed (the loader's base seed derives from its
    generator), so they agree on the order they then shard, and a resumed loader, which
    reuses the saved base seed, replays it; as in torch, the loader's seed overrides a pipe's.
    """
    rank, world = distributed_info()
    apply_sharding(pipe, world * num_workers, rank * num_workers + worker_id)
    start, skip = layout if layout is not None else (0, ())
    for node in pipe.graph():
        if isinstance(node, Shuffler):
            node.set_seed(seed)
        elif isinstance(node, ShardingFilter):
            node.set_layout(start, skip)


def sharding_filters(pipe: Any) -> list[ShardingFilter]:
    """The sharding_filters of `pipe`'s graph (none when it is not a pipe)."""
    if not isinstance(pipe, IterDataPipe):
        return []
    return [node for node in pipe.graph() if isinstance(node, ShardingFilter)]


def progress(pipe: Any) -> Optional[int]:
    """How many of its shard's items the pipe's one sharding_filter has yielded this iteration
    (None when the graph has none or several)."""
    filters = sharding_filters(pipe)
    return filters[0].taken if len(filters) == 1 else None


@dataclass(frozen=True)
class Resharding:
    """Whether a loader can re-deal an epoch of this pipe at another shape.

    `blocker` says why it cannot (None: it can). `items_per_output` is how many shard items
    stand behind each item the pipe yields (a batch stage multiplies it), or None where that
    varies (a filter after the sharding_filter): then one rank's state cannot tell how far the
    other ranks got, and the states of all ranks are needed
    (shoal.collectives.gather_loader_state).
    """

    blocker: Optional[str]
    items_per_output: Optional[int]


# Stages that never hold an item across their outputs: when one of them yields, every item it
# pulled from upstream has left it (in this output or dropped), so the sharding_filter's count
# at a batch's end is exactly what the batches so far consumed.
_ONE_TO_ONE = (Mapper, Collator)


def resharding(pipe: Any) -> Resharding:
    """Whether (and how) `pipe`'s epoch can be re-dealt over another set of ranks and workers."""
    if not isinstance(pipe, IterDataPipe):
        return Resharding(f"{type(pipe).__name__} is an IterableDataset that splits itself "
                          "across ranks and workers, so the loader cannot tell which samples "
                          "another shape would read", None)
    filters = sharding_filters(pipe)
    if len(filters) != 1:
        why = ("has no sharding_filter, so every rank and worker reads the whole stream"
               if not filters else f"has {len(filters)} sharding_filters")
        return Resharding(f"the pipe {why}", None)
    per: Optional[int] = 1
    node = pipe
    while node is not filters[0]:
        if isinstance(node, Batcher):
            per = per * node.batch_size if per is not None else None
        elif isinstance(node, Filter):
            per = None
        elif not isinstance(node, _ONE_TO_ONE):
            return Resharding(
                f"{type(node).__name__} sits between the sharding_filter and the loader and may "
                "hold items across its outputs (only map, filter, batch and collate may follow "
                "the sharding_filter); put the sharding_filter after it", None)
        node = node.sources()[0]
    return Resharding(None, per)
