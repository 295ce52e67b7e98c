"""`DistributedSampler`: each rank's share of a dataset, torch's indices, resumable at any size.

For the same seed, epoch, size, world size and drop_last it yields exactly torch's indices:
the epoch's order (torch's randperm of a Generator seeded with seed + epoch, or 0..n-1), padded
by repeating its head to a multiple of the world size (or cut down to one with drop_last), and
rank r takes every world-size-th index from r.

Its state is global, not per rank: `state_after(k)` after every rank took k indices is the
position k * world_size in the epoch's order, because rank r's first k indices are positions
r, r + W, ..., r + (k - 1) W. A job resumed from that state at any world size splits the rest
of the order (padded for the new size with the epoch's head, as torch pads) the same way, so
across the restart every sample of the epoch is read exactly once when no padding is needed,
and at most once more otherwise; at the same world size the rest is exactly torch's.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional

import numpy as np

from shoal.collectives import distributed
from shoal.collectives.types import CollectiveError
from shoal.core.data import Generator, Sampler, merge_loader_states
from shoal.core.data.datapipes import set_distributed_info

__all__ = ["DistributedSampler", "gather_loader_state", "set_datapipe_sharding"]


def _world(num_replicas: Optional[int], rank: Optional[int]) -> tuple[int, int]:
    if num_replicas is None or rank is None:
        if not distributed.is_initialized():
            raise CollectiveError(
                "DistributedSampler needs num_replicas and rank, or an initialized default "
                "process group to read them from; call collectives.init_process_group() first."
            )
        num_replicas = distributed.get_world_size() if num_replicas is None else num_replicas
        rank = distributed.get_rank() if rank is None else rank
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(
            f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
    return int(num_replicas), int(rank)


class DistributedSampler(Sampler):
    """This rank's indices of `dataset` for the current epoch (torch's DistributedSampler)."""

    def __init__(self, dataset: Any, num_replicas: Optional[int] = None,
                 rank: Optional[int] = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        self.num_replicas, self.rank = _world(num_replicas, rank)
        self.dataset = dataset
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0
        self._start = 0  # where the next iteration starts in the epoch's order (resume)
        # Where the running iteration started; None until the next iteration when set_epoch
        # or load_state_dict moved the position (the running one no longer counts).
        self._current: Optional[int] = None

    def _order(self) -> np.ndarray:
        n = len(self.dataset)
        if self.shuffle:
            return Generator(self.seed + self.epoch).randperm(n)
        return np.arange(n, dtype=np.int64)

    def _share(self, start: int) -> list[int]:
        order = self._order().tolist()
        rest = order[start:]
        world = self.num_replicas
        if self.drop_last:
            rest = rest[: len(rest) // world * world]
        elif rest and len(rest) % world:
            # Padded with the epoch's first indices, as torch pads: resumed at the world size
            # it was saved at (start a multiple of it), the rest is exactly torch's.
            padding = world - len(rest) % world
            rest += (order * math.ceil(padding / len(order)))[:padding]
        return rest[self.rank::world]

    @property
    def num_samples(self) -> int:
        """How many indices this rank's next iteration yields."""
        left = len(self.dataset) - self._start
        if self.drop_last:
            return left // self.num_replicas
        return math.ceil(left / self.num_replicas)

    @property
    def total_size(self) -> int:
        """num_samples times the world size (the padded or cut length of the epoch)."""
        return self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        self._current, self._start = self._start, 0
        return self._counted(iter(self._share(self._current)))

    def __len__(self) -> int:
        return self.num_samples

    @property
    def pending(self) -> bool:
        """True while a position set by set_epoch or load_state_dict waits for `__iter__`."""
        return self._current is None

    def set_epoch(self, epoch: int) -> None:
        """Use `epoch`'s order from the next iteration on, as torch does: a position loaded
        with load_state_dict is kept when `epoch` is the epoch it was saved in (the epoch
        continues), and another epoch starts from its beginning."""
        if int(epoch) != self.epoch:
            self._start = 0
            self._current = None
        self.epoch = int(epoch)

    def state_after(self, consumed: int) -> dict:
        """The position after every rank took `consumed` indices of the current iteration
        (the pending position when set_epoch or load_state_dict moved it since)."""
        if self._current is None:
            position = self._start
        else:
            position = min(self._current + consumed * self.num_replicas, len(self.dataset))
        return {"epoch": self.epoch, "start": position, "seed": self.seed,
                "size": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state` (from state_after, at this or any other world size)."""
        for key in ("epoch", "start", "seed", "size"):
            if key not in state:
                raise ValueError(f"not a DistributedSampler state (no {key!r}): {state!r}")
        if int(state["size"]) != len(self.dataset) or int(state["seed"]) != self.seed:
            raise ValueError(
                f"a DistributedSampler state for a dataset of {state['size']} with seed "
                f"{state['seed']} cannot resume one of {len(self.dataset)} with seed {self.seed}"
            )
        if not 0 <= int(state["start"]) <= len(self.dataset):
            raise ValueError(f"a DistributedSampler state's start {state['start']} is outside "
                             f"0..{len(self.dataset)}")
        self.epoch = int(state["epoch"])
        self._start = int(state["start"])
        self._current = None


def set_datapipe_sharding(group: Any = None) -> None:
    """Shard DataPipes by `group`'s rank and size (default: the default group)."""
    set_distributed_info(distributed.get_rank(group), distributed.get_world_size(group))


def gather_loader_state(loader: Any, group: Any = None, timeout: Any = None) -> dict:
    """Every rank's `loader.state_dict()` merged into one, equal on every rank of `group`.

    For a loader over a sharded DataPipe: with every rank's shard positions the state resumes
    exactly at any world size or worker count, also when the ranks were not in lockstep or a
    filter follows the sharding_filter (one rank's state relies on lockstep there). A
    collective: every rank of `group` calls it.
    """
    states: list = [None] * distributed.get_world_size(group)
    distributed.all_gather_object(states, loader.state_dict(), group=group, timeout=timeout)
    return merge_loader_states(states)
