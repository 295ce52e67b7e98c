"""Datasets with torch's names: map-style `Dataset`, `IterableDataset`, and the helpers."""

from __future__ import annotations

import bisect
import math
from typing import Any, Generic, Iterable, Iterator, Optional, Sequence, TypeVar, Union

import numpy as np

from shoal.core.data.random import Generator, default_seed

T = TypeVar("T")


class Dataset(Generic[T]):
    """A map-style dataset: `__getitem__(index)` and, for samplers, `__len__`."""

    def __getitem__(self, index: int) -> T:
        raise NotImplementedError(f"{type(self).__name__} must implement __getitem__")

    def __add__(self, other: "Dataset") -> "ConcatDataset":
        return ConcatDataset([self, other])


class IterableDataset(Dataset[T]):
    """A dataset read as a stream: `__iter__`; each loader worker iterates its own copy.

    Split the stream across workers with `get_worker_info()` inside `__iter__`, as in torch.
    """

    def __iter__(self) -> Iterator[T]:
        raise NotImplementedError(f"{type(self).__name__} must implement __iter__")


def _length(array: Any) -> int:
    shape = getattr(array, "shape", None)
    return int(shape[0]) if shape is not None else len(array)


class TensorDataset(Dataset[tuple]):
    """Samples are the i-th rows of arrays (or Tensors) of equal first dimension."""

    def __init__(self, *arrays: Any) -> None:
        if not arrays:
            raise ValueError("TensorDataset needs at least one array")
        sizes = [_length(a) for a in arrays]
        if len(set(sizes)) != 1:
            raise ValueError(
                f"TensorDataset needs arrays of one first dimension, got sizes {sizes}")
        self.tensors = arrays

    def __getitem__(self, index: int) -> tuple:
        return tuple(a[index] for a in self.tensors)

    def __len__(self) -> int:
        return _length(self.tensors[0])


class Subset(Dataset[T]):
    """The samples of `dataset` at `indices`, in that order."""

    def __init__(self, dataset: Dataset[T], indices: Sequence[int]) -> None:
        self.dataset = dataset
        self.indices = [int(i) for i in indices]

    def __getitem__(self, index: int) -> T:
        return self.dataset[self.indices[index]]

    def __len__(self) -> int:
        return len(self.indices)


class ConcatDataset(Dataset):
    """Several map-style datasets read one after the other."""

    def __init__(self, datasets: Sequence[Dataset]) -> None:
        self.datasets = list(datasets)
        if not self.datasets:
            raise ValueError("ConcatDataset needs at least one dataset")
        self.cumulative_sizes = list(np.cumsum([len(d) for d in self.datasets]).tolist())

    def __len__(self) -> int:
        return self.cumulative_sizes[-1]

    def __getitem__(self, index: int):
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} is out of range for a ConcatDataset of {len(self)}")
        which = bisect.bisect_right(self.cumulative_sizes, index)
        before = self.cumulative_sizes[which - 1] if which else 0
        return self.datasets[which][index - before]


class ChainDataset(IterableDataset):
    """Several IterableDatasets read one after the other, chained as they are iterated."""

    def __init__(self, datasets: Iterable[Dataset]) -> None:
        self.datasets = datasets

    def __iter__(self) -> Iterator:
        for d in self.datasets:
            _check_iterable(d)
            yield from d

    def __len__(self) -> int:
        total = 0
        for d in self.datasets:
            _check_iterable(d)
            total += len(d)  # type: ignore[arg-type]
        return total


def _check_iterable(dataset: Any) -> None:
    if not isinstance(dataset, IterableDataset):
        # torch's type and text, so code that catches it behaves alike.
        raise AssertionError("ChainDataset only supports IterableDataset")


class StackDataset(Dataset):
    """Sample i is (a[i], b[i], ...) of datasets given by position, or {name: d[i]} by name."""

    def __init__(self, *args: Dataset, **kwargs: Dataset) -> None:
        if args and kwargs:
            raise ValueError("Supported either ``tuple``- (via ``args``) or``dict``- (via "
                             "``kwargs``) like input/output, but both types are given.")
        parts = list(args) or list(kwargs.values())
        if not parts:
            raise ValueError("At least one dataset should be passed")
        self._length = len(parts[0])
        if any(self._length != len(d) for d in parts):
            raise ValueError("Size mismatch between datasets")
        self.datasets: Union[tuple, dict] = args if args else kwargs

    def __getitem__(self, index: int) -> Union[tuple, dict]:
        if isinstance(self.datasets, dict):
            return {k: d[index] for k, d in self.datasets.items()}
        return tuple(d[index] for d in self.datasets)

    def __getitems__(self, indices: list) -> list:
        """The samples at `indices`, each part read in one batch where it has __getitems__."""
        named = isinstance(self.datasets, dict)
        keys = list(self.datasets) if named else range(len(self.datasets))
        columns = [_column(self.datasets[k], indices) for k in keys]
        if named:
            return [dict(zip(keys, row)) for row in zip(*columns)]
        return [tuple(row) for row in zip(*columns)]

    def __len__(self) -> int:
        return self._length


def _column(dataset: Any, indices: list) -> list:
    if callable(getattr(dataset, "__getitems__", None)):
        items = dataset.__getitems__(indices)
        if len(items) != len(indices):
            raise ValueError(f"Nested dataset's output size mismatch. Expected {len(indices)}, "
                             f"got {len(items)}")
        return list(items)
    return [dataset[i] for i in indices]


def random_split(dataset: Dataset[T], lengths: Sequence[float],
                 generator: Optional[Generator] = None) -> list[Subset[T]]:
    """Split into non-overlapping Subsets of the given lengths (or fractions), as torch does.

    With the same generator seed the subsets hold exactly torch's indices.
    """
    n = len(dataset)
    lengths = list(lengths)
    if lengths and math.isclose(sum(lengths), 1) and sum(lengths) <= 1:
        counts = [int(math.floor(n * frac)) for frac in lengths]
        for i in range(n - sum(counts)):  # torch hands the remainder out round-robin
            counts[i % len(counts)] += 1
        lengths = counts
    if sum(lengths) != n:
        raise ValueError(
            f"random_split: the lengths {lengths} sum to {sum(lengths)}, not the dataset's {n}"
        )
    perm = (generator or Generator(default_seed())).randperm(n).tolist()
    out, offset = [], 0
    for length in lengths:
        out.append(Subset(dataset, perm[offset:offset + length]))
        offset += length
    return out

