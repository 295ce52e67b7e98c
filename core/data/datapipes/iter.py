"""`IterDataPipe` and its functional forms (map, filter, batch, shuffle, sharding_filter, ...).

Every pipe counts what its iteration yielded, so `state_dict()` on the last pipe of a graph
says how far a consumer got (and which seeds the graph's shuffles used); `load_state_dict`
makes the next iteration replay the same order and skip what was already consumed.
"""

from __future__ import annotations

import copy
import functools
import random
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional

from shoal.core.data.collate import default_collate
from shoal.core.data.dataset import IterableDataset


class IterDataPipe(IterableDataset):
    """An iterable stage of a data pipeline; `pipe.map(fn)` and friends chain new stages."""

    functions: dict[str, type] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__iter__" in cls.__dict__:
            cls.__iter__ = _counted(cls.__dict__["__iter__"])

    def __getattr__(self, name: str) -> Any:
        pipe_cls = IterDataPipe.functions.get(name)
        if pipe_cls is None or name.startswith("__"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return functools.partial(pipe_cls, self)

    def sources(self) -> list["IterDataPipe"]:
        """The pipes this one reads from (the graph's edges)."""
        return []

    def graph(self) -> list["IterDataPipe"]:
        """This pipe and every pipe upstream of it, depth first."""
        out, stack, seen = [], [self], set()
        while stack:
            pipe = stack.pop()
            if id(pipe) in seen:
                continue
            seen.add(id(pipe))
            out.append(pipe)
            stack.extend(pipe.sources())
        return out

    def state_dict(self) -> dict:
        """How many items this pipe's current iteration yielded, and its shuffles' seeds."""
        return {"yielded": self.__dict__.get("_yielded", 0),
                "seeds": [p.iteration_seed for p in self.graph() if isinstance(p, Shuffler)]}

    def load_state_dict(self, state: dict) -> None:
        """Make the next iteration continue after `state['yielded']` items."""
        shufflers = [p for p in self.graph() if isinstance(p, Shuffler)]
        if len(shufflers) != len(state["seeds"]):
            raise ValueError(f"the state has {len(state['seeds'])} shuffle seeds for a graph "
                             f"with {len(shufflers)} shuffles")
        for pipe, seed in zip(shufflers, state["seeds"]):
            pipe.set_seed(seed)
        self._resume_skip = int(state["yielded"])


def _counted(inner: Callable) -> Callable:
    @functools.wraps(inner)
    def __iter__(self: IterDataPipe) -> Iterator:
        skip = self.__dict__.pop("_resume_skip", 0)
        self._yielded = 0
        for item in inner(self):
            self._yielded += 1
            if self._yielded > skip:
                yield item

    return __iter__


def functional(name: str) -> Callable[[type], type]:
    """Register a pipe class as `IterDataPipe.<name>(...)`."""

    def register(cls: type) -> type:
        IterDataPipe.functions[name] = cls
        return cls

    return register


class IterableWrapper(IterDataPipe):
    """Any iterable as a pipe (deep-copied per iteration so in-place edits do not leak)."""

    def __init__(self, iterable: Iterable, deepcopy: bool = True) -> None:
        self.iterable, self.deepcopy = iterable, deepcopy

    def __iter__(self) -> Iterator:
        source = copy.deepcopy(self.iterable) if self.deepcopy else self.iterable
        yield from source

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]


class _OneSource(IterDataPipe):
    def __init__(self, source: IterDataPipe) -> None:
        self.source = source

    def sources(self) -> list[IterDataPipe]:
        return [self.source]


@functional("map")
class Mapper(_OneSource):
    """fn(item) for every item."""

    def __init__(self, source: IterDataPipe, fn: Callable) -> None:
        super().__init__(source)
        self.fn = fn

    def __iter__(self) -> Iterator:
        for item in self.source:
            yield self.fn(item)

    def __len__(self) -> int:
        return len(self.source)


@functional("filter")
class Filter(_OneSource):
    """The items for which filter_fn is true."""

    def __init__(self, source: IterDataPipe, filter_fn: Callable) -> None:
        super().__init__(source)
        self.filter_fn = filter_fn

    def __iter__(self) -> Iterator:
        for item in self.source:
            if self.filter_fn(item):
                yield item


@functional("batch")
class Batcher(_OneSource):
    """Lists of batch_size items (the last one shorter unless drop_last)."""

    def __init__(self, source: IterDataPipe, batch_size: int, drop_last: bool = False,
                 wrapper_class: Callable = list) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        super().__init__(source)
        self.batch_size, self.drop_last, self.wrapper_class = batch_size, drop_last, wrapper_class

    def __iter__(self) -> Iterator:
        batch: list = []
        for item in self.source:
            batch.append(item)
            if len(batch) == self.batch_size:
                yield self.wrapper_class(batch)
                batch = []
        if batch and not self.drop_last:
            yield self.wrapper_class(batch)

    def __len__(self) -> int:
        n = len(self.source)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


@functional("unbatch")
class UnBatcher(_OneSource):
    """The items of each batch, unbatch_level levels deep (-1: all the way)."""

    def __init__(self, source: IterDataPipe, unbatch_level: int = 1) -> None:
        if unbatch_level < -1 or unbatch_level == 0:
            raise ValueError(f"unbatch_level must be -1 or at least 1, got {unbatch_level}")
        super().__init__(source)
        self.unbatch_level = unbatch_level

    def __iter__(self) -> Iterator:
        for batch in self.source:
            yield from self._dive(batch, self.unbatch_level)

    def _dive(self, element: Any, level: int) -> Iterator:
        if level == -1:
            if isinstance(element, (list, tuple)):
                for item in element:
                    yield from self._dive(item, -1)
            else:
                yield element
        elif level == 1:
            if not isinstance(element, (list, tuple)):
                raise IndexError(f"unbatch_level {self.unbatch_level} exceeds the depth of "
                                 f"the pipe's batches (found {type(element).__name__})")
            yield from element
        else:
            for item in element:
                yield from self._dive(item, level - 1)


@functional("shuffle")
class Shuffler(_OneSource):
    """A buffered shuffle: each item waits in a buffer of buffer_size and leaves at random.

    For the same seed it yields torch's ShufflerIterDataPipe stream: a `random.Random(seed)`
    picks the buffer slot to release (randint over the buffer) while the source lasts, then
    pops the buffer at random. The seed is set_seed's (a DataLoader sets its iteration's base
    seed, equal on every rank and worker when the loader's generator is seeded alike); used
    alone, each new iteration takes a seed derived from the last, so epochs differ and replay
    exactly (torch draws it from its global generator instead).
    """

    def __init__(self, source: IterDataPipe, buffer_size: int = 10000, *,
                 unbatch_level: int = 0) -> None:
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be at least 1, got {buffer_size}")
        super().__init__(source if unbatch_level == 0 else UnBatcher(source, unbatch_level))
        self.buffer_size = buffer_size
        self._enabled = True
        self._seed: Optional[int] = None
        self.iteration_seed: Optional[int] = None

    def set_seed(self, seed: int) -> "Shuffler":
        """Fix the seed of the next iteration."""
        self._seed = int(seed)
        return self

    def set_shuffle(self, shuffle: bool = True) -> "Shuffler":
        """Turn the shuffle off (items pass in order) or back on, as torch's set_shuffle."""
        self._enabled = bool(shuffle)
        return self

    def __iter__(self) -> Iterator:
        if not self._enabled:
            yield from self.source
            return
        if self._seed is None:
            self._seed = random.getrandbits(63)
        self.iteration_seed = self._seed
        rng = random.Random(self._seed)
        # Drawn from its own stream so the shuffle's draws stay torch's.
        self._seed = random.Random(f"shoal next shuffle seed {self._seed}").getrandbits(63)
        buffer: list = []
        for item in self.source:
            if len(buffer) == self.buffer_size:
                k = rng.randint(0, len(buffer) - 1)
                yield buffer[k]
                buffer[k] = item
            else:
                buffer.append(item)
        while buffer:
            yield buffer.pop(rng.randint(0, len(buffer) - 1))

    def __len__(self) -> int:
        return len(self.source)


def apply_shuffle_settings(datapipe: IterDataPipe,
                           shuffle: Optional[bool] = None) -> IterDataPipe:
    """Turn every Shuffler of the graph on or off (torch's graph_settings function): with
    shuffle=True and none in the graph, returns the pipe with one added at the end."""
    if shuffle is None:
        return datapipe
    shufflers = [p for p in datapipe.graph() if isinstance(p, Shuffler)]
    if not shufflers and shuffle:
        warnings.warn("`shuffle=True` was set, but the datapipe does not contain a `Shuffler`. "
                      "Adding one at the end. Be aware that the default buffer size might not "
                      "be sufficient for your task.", UserWarning, stacklevel=2)
        datapipe = Shuffler(datapipe)
        shufflers = [datapipe]
    for shuffler in shufflers:
        shuffler.set_shuffle(shuffle)
    return datapipe


@functional("sharding_filter")
class ShardingFilter(_OneSource):
    """One shard of (rank, worker): every num_instances-th item, from instance_id.

    Items are dealt by their position in the source. A resumed epoch (see `set_layout`) first
    passes over the positions earlier attempts consumed, those before `start` and those in
    `skip`, and deals the rest afresh, so a job resumed at another world size or worker count
    reads each remaining item once. `taken` counts this shard's items the current iteration
    has yielded: the loader reads it to record how far each shard got.
    """

    def __init__(self, source: IterDataPipe) -> None:
        super().__init__(source)
        self.num_instances, self.instance_id = 1, 0
        self.start, self.skip = 0, frozenset()
        self.taken = 0

    def apply_sharding(self, num_instances: int, instance_id: int) -> None:
        """Keep the items dealt to instance_id of num_instances."""
        if not 0 <= instance_id < num_instances:
            raise ValueError(f"instance_id {instance_id} is outside 0..{num_instances - 1}")
        self.num_instances, self.instance_id = num_instances, instance_id

    def set_layout(self, start: int = 0, skip: Iterable[int] = ()) -> None:
        """Pass over the source positions before `start` and those in `skip` (a resume)."""
        skip = frozenset(int(p) for p in skip)
        if start < 0 or any(p < start for p in skip):
            raise ValueError(f"a sharding layout needs 0 <= start <= every skipped position, "
                             f"got start {start} and skip {sorted(skip)[:5]}")
        self.start, self.skip = int(start), skip

    def __iter__(self) -> Iterator:
        start, skip = self.start, self.skip
        n, me = self.num_instances, self.instance_id
        self.taken = 0
        dealt = 0
        for position, item in enumerate(self.source):
            if position < start or position in skip:
                continue
            if dealt % n == me:
                self.taken += 1  # before the yield: the item is in the consumer's hands
                yield item
            dealt += 1

    def __len__(self) -> int:
        n = len(self.source)
        left = n - min(self.start, n) - sum(1 for p in self.skip if p < n)
        return left // self.num_instances + (1 if self.instance_id < left % self.num_instances
                                              else 0)


@functional("collate")
class Collator(_OneSource):
    """collate_fn over each batch (default_collate by default)."""

    def __init__(self, source: IterDataPipe, collate_fn: Callable = default_collate) -> None:
        super().__init__(source)
        self.collate_fn = collate_fn

    def __iter__(self) -> Iterator:
        for batch in self.source:
            yield self.collate_fn(batch)

    def __len__(self) -> int:
        return len(self.source)


class _ManySources(IterDataPipe):
    def __init__(self, *sources: IterDataPipe) -> None:
        if not sources:
            raise ValueError(f"{type(self).__name__} needs at least one pipe")
        for s in sources:
            if not isinstance(s, IterDataPipe):
                raise TypeError(f"{type(self).__name__} takes IterDataPipes, got "
                                f"{type(s).__name__}")
        self.datapipes = sources

    def sources(self) -> list[IterDataPipe]:
        return list(self.datapipes)


@functional("zip")
class Zipper(_ManySources):
    """Tuples of one item from each pipe, until the shortest ends."""

    def __iter__(self) -> Iterator:
        yield from zip(*self.datapipes)

    def __len__(self) -> int:
        return min(len(d) for d in self.datapipes)


@functional("concat")
class Concater(_ManySources):
    """The pipes one after the other."""

    def __iter__(self) -> Iterator:
        for d in self.datapipes:
            yield from d

    def __len__(self) -> int:
        return sum(len(d) for d in self.datapipes)


@functional("cycle")
class Cycler(_OneSource):
    """The source count times over (forever when count is None)."""

    def __init__(self, source: IterDataPipe, count: Optional[int] = None) -> None:
        if count is not None and count < 0:
            raise ValueError(f"count must be None or non-negative, got {count}")
        super().__init__(source)
        self.count = count

    def __iter__(self) -> Iterator:
        i = 0
        while self.count is None or i < self.count:
            yield from self.source
            i += 1


@functional("header")
class Header(_OneSource):
    """The first `limit` items."""

    def __init__(self, source: IterDataPipe, limit: int = 10) -> None:
        super().__init__(source)
        self.limit = limit

    def __iter__(self) -> Iterator:
        if self.limit <= 0:
            return
        for i, item in enumerate(self.source):
            yield item
            if i + 1 >= self.limit:
                return
