"""Samplers with torch's semantics, plus the resumable state a checkpoint carries.

A sampler that can resume mid-epoch implements `state_after(consumed)`: the state from which a
fresh iteration yields exactly the indices that follow the first `consumed` ones of the current
iteration; `load_state_dict` installs it for the next `__iter__`. The DataLoader, which knows how
many samples it handed to the training loop (its workers run ahead), asks for it;
`state_dict()` is the state after what the sampler itself yielded, for a loop that reads a
sampler directly.

A loaded position is pending until the next `__iter__`: meanwhile `state_after` reports it
(whatever the last iteration consumed), `len()` counts what is left from it and `pending` is
True, so a loader's len and state agree with what its next iteration yields, and the loader
knows its running iteration's seed no longer belongs to the sampler's position.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Iterator, Optional, Sequence, Sized

import numpy as np

from shoal.core.data.random import Generator, default_seed


class Sampler:
    """Yields dataset indices (or, for a batch sampler, lists of them)."""

    def __iter__(self) -> Iterator:
        raise NotImplementedError(f"{type(self).__name__} must implement __iter__")

    def state_after(self, consumed: int) -> dict:
        """The state that resumes after `consumed` items of the current iteration."""
        raise NotImplementedError(f"{type(self).__name__} cannot resume mid-epoch")

    @property
    def pending(self) -> bool:
        """True while a position set since the last `__iter__` (load_state_dict, or
        set_epoch to another epoch) waits for the next one: `state_after` then names that
        position, not one in the running iteration."""
        return False

    def state_dict(self) -> dict:
        """The state after the indices this sampler yielded so far in its current iteration."""
        return self.state_after(self.__dict__.get("_yielded", 0))

    def _counted(self, indices: Iterator) -> Iterator:
        """`indices`, counting them for state_dict."""
        self._yielded = 0
        for index in indices:
            self._yielded += 1
            yield index

    def load_state_dict(self, state: dict) -> None:
        """Make the next `__iter__` resume from `state` (from state_after)."""
        raise NotImplementedError(f"{type(self).__name__} cannot resume mid-epoch")


def _start(state: dict, what: str) -> int:
    start = state.get("start")
    if not isinstance(start, (int, np.integer)) or start < 0:
        raise ValueError(f"a {what} state needs a non-negative int 'start', got {start!r}")
    return int(start)


class SequentialSampler(Sampler):
    """0, 1, ..., len(data_source) - 1."""

    def __init__(self, data_source: Sized) -> None:
        self.data_source = data_source
        self._begin = 0  # where the next iteration starts (set by load_state_dict)
        self._current: Optional[int] = 0  # where the running iteration started; None: pending

    def __iter__(self) -> Iterator[int]:
        self._current, self._begin = self._begin, 0
        return self._counted(iter(range(self._current, len(self.data_source))))

    def __len__(self) -> int:
        return max(len(self.data_source) - self._begin, 0)

    @property
    def pending(self) -> bool:
        return self._current is None

    def state_after(self, consumed: int) -> dict:
        if self._current is None:
            return {"start": self._begin}
        return {"start": min(self._current + consumed, len(self.data_source))}

    def load_state_dict(self, state: dict) -> None:
        self._begin = _start(state, "SequentialSampler")
        self._current = None


class RandomSampler(Sampler):
    """A random order of the indices (torch's stream for the same Generator seed)."""

    def __init__(self, data_source: Sized, replacement: bool = False,
                 num_samples: Optional[int] = None, generator: Optional[Generator] = None) -> None:
        self.data_source = data_source
        self.replacement = bool(replacement)
        self._num_samples = num_samples
        self.generator = generator
        if not isinstance(self.num_samples, int) or self.num_samples <= 0:
            raise ValueError(
                "num_samples should be a positive integer value, but got "
                f"num_samples={self.num_samples}"
            )
        self._resume: Optional[tuple[np.ndarray, int]] = None  # a loaded position, pending
        self._current: Optional[tuple[np.ndarray, int]] = None  # the running iteration's start

    @property
    def num_samples(self) -> int:
        """How many indices one iteration yields (the dataset's length by default)."""
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def __len__(self) -> int:
        skip = self._resume[1] if self._resume is not None else 0
        return max(self.num_samples - skip, 0)

    @property
    def pending(self) -> bool:
        return self._resume is not None

    def _stream(self, gen: Generator) -> Iterator[int]:
        n = len(self.data_source)
        if self.replacement:
            for _ in range(self.num_samples // 32):
                yield from (gen.words(32) % n).tolist()
            yield from (gen.words(self.num_samples % 32) % n).tolist()
        else:
            for _ in range(self.num_samples // n):
                yield from gen.randperm(n).tolist()
            yield from gen.randperm(n).tolist()[: self.num_samples % n]

    def __iter__(self) -> Iterator[int]:
        if self._resume is not None:
            (state, skip), self._resume = self._resume, None
            gen = self.generator
            if gen is None:  # a one-iteration generator, as a seedless sampler draws
                gen = Generator()
                gen.set_state(state)
        else:
            gen = self.generator or Generator(default_seed())
            skip = 0
        self._current = (gen.get_state(), skip)
        return self._counted(itertools.islice(self._stream(gen), skip, None))

    def state_after(self, consumed: int) -> dict:
        if self._resume is not None:
            state, skip = self._resume
            return {"generator": state.copy(), "start": skip}
        if self._current is None:  # nothing drawn yet: the next iteration starts afresh
            state = self.generator.get_state() if self.generator is not None else None
            return {"generator": state, "start": 0}
        state, skip = self._current
        return {"generator": state.copy(), "start": min(skip + consumed, self.num_samples)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state`. The generator takes the saved state now, not at the next
        `__iter__`: a DataLoader sharing it draws the iteration's base seed in between (from
        the same saved place, when the state was taken before the iteration drew)."""
        start = _start(state, "RandomSampler")
        if state.get("generator") is None:  # saved before its first iteration
            self._resume = None
            return
        words = np.asarray(state["generator"], np.uint32)
        if self.generator is not None:
            self.generator.set_state(words)
        self._resume = (words, start)


class SubsetRandomSampler(Sampler):
    """The given indices in a random order."""

    def __init__(self, indices: Sequence[int], generator: Optional[Generator] = None) -> None:
        self.indices = list(indices)
        self.generator = generator

    def __iter__(self) -> Iterator[int]:
        gen = self.generator or Generator(default_seed())
        for i in gen.randperm(len(self.indices)).tolist():
            yield self.indices[i]

    def __len__(self) -> int:
        return len(self.indices)


class WeightedRandomSampler(Sampler):
    """Indices drawn with probabilities proportional to `weights` (torch.multinomial's draws,
    so the same stream as torch's for a Generator of the same seed)."""

    def __init__(self, weights: Sequence[float], num_samples: int, replacement: bool = True,
                 generator: Optional[Generator] = None) -> None:
        if (not isinstance(num_samples, int) or isinstance(num_samples, bool)
                or num_samples <= 0):
            raise ValueError("num_samples should be a positive integer value, but got "
                             f"num_samples={num_samples}")
        if not isinstance(replacement, bool):
            raise ValueError("replacement should be a boolean value, but got "
                             f"replacement={replacement}")
        weights = np.asarray(weights, dtype=np.float64)
        if weights.ndim != 1:
            raise ValueError("weights should be a 1d sequence but given weights have shape "
                             f"{tuple(weights.shape)}")
        self.weights, self.num_samples = weights, num_samples
        self.replacement, self.generator = replacement, generator

    def __iter__(self) -> Iterator[int]:
        gen = self.generator or Generator(default_seed())
        yield from multinomial(self.weights, self.num_samples, self.replacement, gen).tolist()

    def __len__(self) -> int:
        return self.num_samples


def multinomial(weights: np.ndarray, n: int, replacement: bool, gen: Generator) -> np.ndarray:
    """torch.multinomial over a 1-d float64 `weights` on the CPU, drawing what torch draws.

    Without replacement, or for one sample, torch takes the top n of weights / q with q ~ Exp(1)
    (q = -log1p(-u)); with replacement, a binary search of each uniform in the normalized
    running sum. Errors are torch's RuntimeErrors, with its texts.
    """
    if not replacement and n > len(weights):
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without "
                           "replacement")
    if not replacement or n == 1:
        if len(weights) == 0 or not (np.all(weights >= 0) and np.all(weights < np.inf)):
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        if weights.sum() == 0:
            raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
        keys = weights / -np.log1p(-gen.uniform(len(weights)))
        return np.argsort(-keys, kind="stable")[:n]
    for w in weights:  # torch checks in order, so the first bad entry names the error
        if not w >= 0:
            raise RuntimeError("invalid multinomial distribution (encountering probability "
                               "entry < 0)")
        if not np.isfinite(w):
            raise RuntimeError("invalid multinomial distribution (encountering probability "
                               "entry = infinity or NaN)")
    cumulative = np.cumsum(weights)  # sequential sums, as torch's loop adds them
    if not len(weights) or cumulative[-1] <= 0:
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    cumulative = cumulative / cumulative[-1]
    cumulative[-1] = 1.0
    return np.searchsorted(cumulative, gen.uniform(n), side="left")


class BatchSampler(Sampler):
    """Groups another sampler's indices into lists of `batch_size`."""

    def __init__(self, sampler: Iterable[int], batch_size: int, drop_last: bool) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(
                f"batch_size should be a positive integer value, but got batch_size={batch_size}"
            )
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = bool(drop_last)

    def __iter__(self) -> Iterator[list[int]]:
        # The inner iteration starts now, not at the first batch (a generator's body would
        # wait), so from iter() on the sampler's state is the running iteration's.
        return self._batches(iter(self.sampler))

    def _batches(self, it: Iterator[int]) -> Iterator[list[int]]:
        while True:
            batch = list(itertools.islice(it, self.batch_size))
            if not batch or (self.drop_last and len(batch) < self.batch_size):
                return
            yield batch

    def __len__(self) -> int:
        n = len(self.sampler)  # type: ignore[arg-type]
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def state_after(self, consumed: int) -> dict:
        """`consumed` counts indices (not batches), as the loader reports them."""
        return self.sampler.state_after(consumed)  # type: ignore[attr-defined]

    @property
    def pending(self) -> bool:
        return bool(getattr(self.sampler, "pending", False))

    def state_dict(self) -> dict:
        """The inner sampler's state (what it yielded, a batch being built included)."""
        return self.sampler.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)  # type: ignore[attr-defined]


def resumable(sampler: Any) -> bool:
    """True when `sampler` implements the mid-epoch state protocol."""
    try:
        probe = type(sampler).state_after
    except AttributeError:
        return False
    return probe is not Sampler.state_after and not (
        isinstance(sampler, BatchSampler) and not resumable(sampler.sampler))
