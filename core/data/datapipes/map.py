"""`MapDataPipe`: indexable pipes (map, batch, concat, zip, shuffle into an IterDataPipe)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, Optional, Sequence

from shoal.core.data.dataset import Dataset
from shoal.core.data.datapipes.iter import IterDataPipe
from shoal.core.data.random import Generator, default_seed


class MapDataPipe(Dataset):
    """An indexable stage of a pipeline; `pipe.map(fn)` and friends chain new stages."""

    functions: dict[str, Callable] = {}

    def __getattr__(self, name: str) -> Any:
        fn = MapDataPipe.functions.get(name)
        if fn is None or name.startswith("__"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return functools.partial(fn, self)


def _functional(name: str) -> Callable[[Callable], Callable]:
    def register(cls: Callable) -> Callable:
        MapDataPipe.functions[name] = cls
        return cls

    return register


class SequenceWrapper(MapDataPipe):
    """A sequence as a map-style pipe."""

    def __init__(self, sequence: Sequence) -> None:
        self.sequence = sequence

    def __getitem__(self, index: int) -> Any:
        return self.sequence[index]

    def __len__(self) -> int:
        return len(self.sequence)


@_functional("map")
class MapMapper(MapDataPipe):
    """fn(source[i])."""

    def __init__(self, source: MapDataPipe, fn: Callable) -> None:
        self.source, self.fn = source, fn

    def __getitem__(self, index: int) -> Any:
        return self.fn(self.source[index])

    def __len__(self) -> int:
        return len(self.source)


@_functional("batch")
class MapBatcher(MapDataPipe):
    """Item i is the list of source items [i*batch_size, (i+1)*batch_size)."""

    def __init__(self, source: MapDataPipe, batch_size: int, drop_last: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.source, self.batch_size, self.drop_last = source, batch_size, drop_last

    def __getitem__(self, index: int) -> list:
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} is out of range for {len(self)} batches")
        start = index * self.batch_size
        stop = min(start + self.batch_size, len(self.source))
        return [self.source[i] for i in range(start, stop)]

    def __len__(self) -> int:
        n = len(self.source)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


@_functional("concat")
class MapConcater(MapDataPipe):
    """The pipes' items one after the other."""

    def __init__(self, *sources: MapDataPipe) -> None:
        self.sources = sources

    def __getitem__(self, index: int) -> Any:
        for s in self.sources:
            if index < len(s):
                return s[index]
            index -= len(s)
        raise IndexError("index out of range for the concatenated pipes")

    def __len__(self) -> int:
        return sum(len(s) for s in self.sources)


@_functional("zip")
class MapZipper(MapDataPipe):
    """Tuples (a[i], b[i], ...) up to the shortest pipe."""

    def __init__(self, *sources: MapDataPipe) -> None:
        self.sources = sources

    def __getitem__(self, index: int) -> tuple:
        return tuple(s[index] for s in self.sources)

    def __len__(self) -> int:
        return min(len(s) for s in self.sources)


@_functional("shuffle")
class MapShuffler(IterDataPipe):
    """The items of a map-style pipe in a random order (torch's stream for a seeded Generator)."""

    def __init__(self, source: MapDataPipe, generator: Optional[Generator] = None) -> None:
        self.source, self.generator = source, generator

    def __iter__(self) -> Iterator:
        gen = self.generator or Generator(default_seed())
        for i in gen.randperm(len(self.source)).tolist():
            yield self.source[i]

    def __len__(self) -> int:
        return len(self.source)
