"""Where a loader over an iterable dataset stands in its epoch, and how a resumed loader goes on.

A stream's place is recorded per shard. Sharding deals the items entering a DataPipe's one
sharding_filter round-robin over `world_size * max(num_workers, 1)` instances (rank r's worker
w is instance `r * K + w`); instance i's t-th item is the epoch's dealt item `i + N * t`. A
rank's state holds its own instances' counts (`taken`, from each worker's sharding_filter at
the end of the last batch handed out from it), the number of batches it handed out, and the
layout its iteration dealt (`start`, `skip`: positions of the filter's source passed over
because an earlier attempt consumed them).

A loader resumed at the shape it was saved at replays: it reruns the same dealing with the
same seed and discards the batches already handed out, so it yields exactly the batches an
uninterrupted loader would have. At another shape it re-deals: the dealt items every old
instance consumed are passed over, and the rest is dealt afresh over the new instances. That
needs every old instance's count:

- all ranks' states merged (`merge_states`, or shoal.collectives.gather_loader_state)
  give them;
- one rank's state (what elastic.State saves: rank 0's, synced to all) gives them by lockstep:
  under DDP every rank hands out the same number of batches, and every rank's loader takes
  its batches from its workers round-robin from worker 0, so worker w of every rank handed out
  as many batches as the saved rank's worker w, each `per_batch` shard items (a shorter shard
  that ran out had fewer, and claiming items past its end consumes nothing). A filter between
  the sharding_filter and the loader makes the count per batch vary, so there this inference
  is refused and the merged states are required.

A rank whose state was not taken in lockstep with the others (it handed out more or fewer
batches) is not detectable from its state alone; merged states are exact in every case.
Re-dealing neither pads nor evens out the shards (as sharding_filter does not): the new ranks'
shares of the rest may differ by a batch. With drop_last, the items a shard dropped before the
resize may be read after it (never twice), and the new shards drop their own tails.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from shoal.core.data.datapipes.sharding import Resharding
from shoal.core.data.errors import DataLoaderError

_KEYS = ("base_seed", "batches", "world_size", "rank", "num_workers", "shards")


@dataclass(frozen=True)
class Shape:
    """The ranks and workers a loader's epoch is dealt over."""

    world_size: int
    rank: int
    num_workers: int

    @property
    def instances(self) -> int:
        """How many shards the epoch is dealt into."""
        return self.world_size * max(self.num_workers, 1)

    def describe(self) -> str:
        """The shape in words, for error messages."""
        workers = f"{self.num_workers} worker{'s' if self.num_workers != 1 else ''} per rank"
        return f"world size {self.world_size} with {workers}"


@dataclass(frozen=True)
class Plan:
    """How the next iteration starts: the layout it deals and how many batches it discards."""

    layout: tuple[int, tuple[int, ...]]
    replay_batches: int


FRESH = Plan((0, ()), 0)


def saved_shape(state: dict) -> Shape:
    """The shape a state was saved at."""
    return Shape(int(state["world_size"]), int(state.get("rank") or 0),
                 int(state["num_workers"]))


def check(state: Any) -> None:
    """Raise ValueError unless `state` is an iterable loader's state (from state_dict)."""
    if not isinstance(state, dict) or any(key not in state for key in _KEYS):
        raise ValueError(f"not the state of a DataLoader over an IterableDataset (it needs "
                         f"{', '.join(_KEYS)}): {state!r}")
    shards = state["shards"]
    if shards is not None and not (isinstance(shards, dict) and
                                   {"start", "skip", "taken", "per_batch"} <= set(shards)):
        raise ValueError(f"a DataLoader state's 'shards' needs start, skip, taken and "
                         f"per_batch: {shards!r}")


def plan(state: dict, current: Shape, resharding: Resharding) -> Plan:
    """How a loader of shape `current` resumes from `state` (replay or re-deal).

    Raises:
        DataLoaderError: the shape changed and the dataset or the state cannot say which
            samples the other shape read (names both shapes and the reason).
    """
    saved = saved_shape(state)
    shards = state["shards"]
    layout = ((int(shards["start"]), tuple(int(p) for p in shards["skip"]))
              if shards is not None else (0, ()))
    same = (saved.world_size, saved.num_workers) == (current.world_size, current.num_workers)
    if same and state["batches"] is not None:
        return Plan(layout, int(state["batches"]))
    where = (f"a DataLoader state saved at {saved.describe()} cannot resume at "
             f"{current.describe()}")
    if resharding.blocker is not None:
        raise DataLoaderError(f"{where}: {resharding.blocker}; resume at the saved shape")
    if shards is None:
        raise DataLoaderError(f"{where}: the state records no shard positions (it was saved "
                              "over a dataset without one sharding_filter)")
    counts = _counts(state, saved, where)
    return Plan(remaining_layout(layout, saved.instances, counts), 0)


def _counts(state: dict, saved: Shape, where: str) -> list[int]:
    """Every old instance's count: recorded, or inferred by lockstep from the saved rank's."""
    taken = {int(i): int(c) for i, c in state["shards"]["taken"].items()}
    n, workers = saved.instances, max(saved.num_workers, 1)
    missing = [i for i in range(n) if i not in taken]
    if not missing:
        return [taken[i] for i in range(n)]
    per_batch = state["shards"]["per_batch"]
    if per_batch is None:
        raise DataLoaderError(
            f"{where}: a filter after the sharding_filter lets each rank's batches hold a "
            "different number of the stream's items, so one rank's state cannot tell how far "
            "the others got; merge the states of all ranks "
            "(shoal.collectives.gather_loader_state)")
    batches = int(state["batches"])
    counts = []
    for i in range(n):
        worker = i % workers
        handed = batches // workers + (1 if worker < batches % workers else 0)
        counts.append(taken.get(i, handed * int(per_batch)))
    return counts


def remaining_layout(layout: tuple[int, Sequence[int]], instances: int,
                     counts: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """The layout that passes over what `counts` consumed of an epoch dealt by `layout`.

    Instance i consumed the dealt items i, i + N, ..., i + N (counts[i] - 1). The first dealt
    item no instance consumed becomes the new start; the consumed ones after it join `skip`.
    """
    start, skip = layout
    first = min(i + instances * c for i, c in enumerate(counts))
    later = []
    for i, c in enumerate(counts):
        t = (first - i) // instances + 1 if first >= i else 0
        later.extend(range(i + instances * t, i + instances * c, instances))
    later.sort()
    positions = _positions(start, sorted(skip), [first] + later)
    new_start = positions[0]
    kept = [p for p in skip if p > new_start]
    return new_start, tuple(sorted(kept + positions[1:]))


def _positions(start: int, skip: list[int], dealt: list[int]) -> list[int]:
    """The source positions of the given dealt indices (ascending), under (start, skip)."""
    out, k = [], bisect.bisect_left(skip, start)
    passed = 0  # skipped positions at or before the current one
    for j in dealt:
        position = start + j + passed
        while k < len(skip) and skip[k] <= position:
            k += 1
            passed += 1
            position += 1
        out.append(position)
    return out


def merge_states(states: Sequence[dict]) -> dict:
    """One state from every rank's (in any order): exact counts for every instance.

    The ranks must agree on the seed, the shape and the layout (they do when their loaders are
    built alike); each contributes its own instances' counts. A merged state always re-deals,
    also at the saved shape, since its ranks need not have handed out the same batches.

    Raises:
        ValueError: the states disagree, or a rank is missing or given twice.
    """
    if not states:
        raise ValueError("merge_states needs the state of every rank, got none")
    for state in states:
        check(state)
    first = states[0]
    for state in states[1:]:
        for key in ("base_seed", "world_size", "num_workers"):
            if state[key] != first[key]:
                raise ValueError(f"DataLoader states disagree on {key}: {first[key]!r} (rank "
                                 f"{first['rank']}) and {state[key]!r} (rank {state['rank']})")
    if first["shards"] is None:
        raise ValueError("these DataLoader states record no shard positions (the dataset has "
                         "no single sharding_filter): there is nothing to merge")
    layout = (first["shards"]["start"], list(first["shards"]["skip"]))
    ranks = sorted(int(s["rank"]) for s in states)
    if ranks != list(range(int(first["world_size"]))):
        raise ValueError(f"merge_states needs one state from each of the "
                         f"{first['world_size']} ranks, got ranks {ranks}")
    taken: dict[int, int] = {}
    for state in states:
        if (state["shards"]["start"], list(state["shards"]["skip"])) != layout:
            raise ValueError(f"DataLoader states disagree on the epoch's layout: rank "
                             f"{first['rank']} and rank {state['rank']}")
        if not _same_generator(state.get("generator"), first.get("generator")):
            raise ValueError(f"DataLoader states disagree on the loader generator's state: "
                             f"rank {first['rank']} and rank {state['rank']}")
        taken.update({int(i): int(c) for i, c in state["shards"]["taken"].items()})
    shards = dict(first["shards"], taken=taken)
    # Ended only where every rank's iteration ended; else the re-dealt rest goes on.
    finished = all(bool(state.get("finished")) for state in states)
    return dict(first, rank=None, batches=None, shards=shards, finished=finished)


def _same_generator(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool(np.array_equal(a, b))
