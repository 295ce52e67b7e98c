"""`DataLoader`: torch's loader (arguments, defaults, errors), with resumable state.

Map-style datasets are read through a sampler (sequential, random, or the user's, e.g.
collectives.DistributedSampler) grouped by a BatchSampler; iterable datasets are read as
streams, each worker its own copy. With `num_workers > 0` the batches are built in worker
processes (pool.py) and cross into this process through shared memory (handover.py); the
iterators that drive either way are in loader_iter.py.

`state_dict()` records where the training loop is, not where the workers are: the sampler's
state after the samples already handed out, so a loader resumed with `load_state_dict` yields
exactly the batches an uninterrupted one would have yielded next. A loader over an iterable
dataset records its shards' positions instead (stream_state.py), so one over a sharded
DataPipe also resumes at another world size or worker count.

Each iteration draws its base seed (the workers' seeds, a DataPipe's shuffles) from the
loader's generator, so the state also carries that generator as it stands after the saved
iteration's draw: the epochs after a resumed one draw the seeds an uninterrupted run draws,
instead of starting the generator's sequence over.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Iterator, Optional

import numpy as np

from shoal.core.data import stream_state
from shoal.core.data.collate import default_collate, default_convert
from shoal.core.data.dataset import IterableDataset
from shoal.core.data.datapipes import sharding
from shoal.core.data.datapipes.iter import IterDataPipe, Shuffler, apply_shuffle_settings
from shoal.core.data.errors import DataLoaderError
from shoal.core.data.loader_iter import (
    _LoaderIter,
    _MultiProcessIter,
    _SingleProcessIter,
    pipe_preparer,
)
from shoal.core.data.pool import WorkerPool
from shoal.core.data.random import Generator, default_seed, state_words
from shoal.core.data.sampler import (
    BatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    resumable,
)
from shoal.core.data.worker import WorkerSpec


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


class DataLoader:
    """Batches from a dataset, optionally built by worker processes (torch's DataLoader)."""

    def __init__(self, dataset: Any, batch_size: Optional[int] = 1, shuffle: Optional[bool] = None,
                 sampler: Optional[Sampler] = None, batch_sampler: Optional[Sampler] = None,
                 num_workers: int = 0, collate_fn: Optional[Callable] = None,
                 pin_memory: bool = False, drop_last: bool = False, timeout: float = 0,
                 worker_init_fn: Optional[Callable] = None, multiprocessing_context: Any = None,
                 generator: Optional[Generator] = None, *, prefetch_factor: Optional[int] = None,
                 persistent_workers: bool = False) -> None:
        _check(isinstance(num_workers, int) and num_workers >= 0,
               "num_workers option should be non-negative; use num_workers=0 to disable "
               "multiprocessing.")
        _check(timeout >= 0, "timeout option should be non-negative")
        if num_workers == 0:
            _check(prefetch_factor is None,
                   "prefetch_factor option could only be specified in multiprocessing.let "
                   "num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor "
                   "to None.")
            _check(not persistent_workers, "persistent_workers option needs num_workers > 0")
        elif prefetch_factor is None:
            prefetch_factor = 2
        _check(prefetch_factor is None or prefetch_factor >= 1,
               f"prefetch_factor must be at least 1, got {prefetch_factor}")
        self.dataset = dataset
        self.iterable = isinstance(dataset, IterableDataset)
        if self.iterable:
            checked = (("sampler", sampler), ("batch_sampler", batch_sampler))
            if isinstance(dataset, IterDataPipe):
                _shuffle_pipe(dataset, shuffle)
            else:
                checked = (("shuffle", shuffle),) + checked
            for name, value in checked:
                _check(value in (None, False), "DataLoader with IterableDataset: expected "
                                               f"unspecified {name} option, but got {name}={value}")
        _check(sampler is None or not shuffle, "sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            _check(batch_size == 1 and not shuffle and sampler is None and not drop_last,
                   "batch_sampler option is mutually exclusive with batch_size, shuffle, "
                   "sampler, and drop_last")
            batch_size, drop_last = None, False
        elif batch_size is None:
            _check(not drop_last, "batch_size=None option disables auto-batching and is "
                                  "mutually exclusive with drop_last")
        if sampler is None and not self.iterable:
            sampler = (RandomSampler(dataset, generator=generator) if shuffle
                       else SequentialSampler(dataset))
        if batch_size is not None and batch_sampler is None and not self.iterable:
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)
        self.batch_size, self.drop_last = batch_size, bool(drop_last)
        self.sampler, self.batch_sampler = sampler, batch_sampler
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.auto_collation = (batch_sampler is not None
                               or (self.iterable and batch_size is not None))
        self.collate_fn = collate_fn or (default_collate if self.auto_collation
                                         else default_convert)
        self.pin_memory, self.timeout = bool(pin_memory), float(timeout)
        self.worker_init_fn, self.multiprocessing_context = worker_init_fn, multiprocessing_context
        self.generator, self.persistent_workers = generator, bool(persistent_workers)
        self._pool: Optional[WorkerPool] = None
        self._iterator: Optional[_LoaderIter] = None
        self._resume: Optional[dict] = None

    @property
    def _index_sampler(self) -> Any:
        return self.batch_sampler if self.batch_sampler is not None else self.sampler

    def __len__(self) -> int:
        """The batches `iter(loader)` would yield now: after load_state_dict, what is left of
        the saved epoch (for a sampler-driven loader; an iterable dataset's length is its
        whole stream's, as in torch)."""
        if self.iterable:
            n = len(self.dataset)
            if self.batch_size is None:
                return n
            return n // self.batch_size if self.drop_last else -(-n // self.batch_size)
        return len(self._index_sampler)

    def __iter__(self) -> Iterator:
        resume = self._resume
        shape = self._shape() if self.iterable else None
        continues = resume is not None and self._continues(resume)
        plan = stream_state.FRESH
        if continues and self.iterable:
            # Raises (keeping the state for another try) when this shape cannot resume it.
            plan = stream_state.plan(resume, shape, sharding.resharding(self.dataset))
        self._resume = None
        if continues:
            base_seed = int(resume["base_seed"])
        else:  # a new iteration, also after a resume whose iteration had ended or moved on
            base_seed = (self.generator.random_int64() if self.generator is not None
                         else default_seed())
        # Taken before the iterator starts the sampler, which may draw from the same generator.
        generator_state = self._generator_state()
        if self._iterator is not None:
            self._iterator.close()
        if self.num_workers == 0:
            it: _LoaderIter = _SingleProcessIter(self, base_seed, shape, plan.layout,
                                                 self._start_sampler())
        else:
            pool = self._worker_pool(base_seed)  # workers start before the sampler does
            it = _MultiProcessIter(self, base_seed, shape, plan.layout, self._start_sampler(),
                                   pool)
        it.generator_state = generator_state
        if plan.replay_batches:
            it.skip(plan.replay_batches)
        self._iterator = it
        return it

    def _start_sampler(self) -> Optional[Iterator]:
        return None if self.iterable else iter(self._index_sampler)

    def _at_loaded_position(self, resume: dict) -> bool:
        """False when set_epoch moved the sampler off the position `resume` loaded."""
        return self.iterable or _same_state(self._index_sampler.state_after(0),
                                            resume["sampler"])

    def _continues(self, resume: dict) -> bool:
        """Whether the next iteration is the one `resume` was saved in (and reuses its seed):
        not when it was saved before its iteration drew a seed or after it ended, nor when
        set_epoch has since moved the sampler (another epoch starts afresh, as in torch)."""
        return (resume["base_seed"] is not None and not resume.get("finished")
                and self._at_loaded_position(resume))

    def _generator_state(self) -> Optional[np.ndarray]:
        return self.generator.get_state() if self.generator is not None else None

    def _shape(self) -> stream_state.Shape:
        rank, world = sharding.distributed_info()
        return stream_state.Shape(world, rank, self.num_workers)

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where the training loop stands: resume with load_state_dict to continue from here.

        For a sampler-driven loader: the sampler's state after the samples handed out so far
        (ints, None and arrays only, so checkpoints admit it). For an iterable dataset: the
        batches handed out and the shape (world size, rank, workers), and for a DataPipe with
        one sharding_filter each of this rank's shards' positions (stream_state.py). Both
        hold the running iteration's base seed (None when the next iteration draws its own)
        and the loader generator's state after that draw (None without a generator).
        """
        it = self._iterator
        if it is None and self._resume is not None and self.iterable:
            return self._resume
        if self.iterable:
            return self._stream_state(it)
        if not resumable(self._index_sampler):
            raise DataLoaderError(
                f"DataLoader.state_dict needs a sampler with state_after/load_state_dict; "
                f"{type(self._index_sampler).__name__} has none")
        sampler = self._index_sampler
        consumed = it.samples if it is not None else 0
        position = sampler.state_after(consumed)
        if it is None and self._resume is not None and self._at_loaded_position(self._resume):
            resume = self._resume  # loaded, not iterated yet: still that state
            seed, generator = resume["base_seed"], resume.get("generator")
            finished = bool(resume.get("finished"))
        elif it is not None and not getattr(sampler, "pending", False):
            seed, generator, finished = it.base_seed, it.generator_state, it.finished
        else:  # nothing iterated, or set_epoch moved the sampler on: the next one draws
            seed, generator, finished = None, self._generator_state(), False
        return {"sampler": position, "base_seed": seed, "generator": _copy(generator),
                "finished": finished, "batches": it.batches if it is not None else 0}

    def _stream_state(self, it: Optional["_LoaderIter"]) -> dict:
        shape = it.shape if it is not None else self._shape()
        shards = None
        if len(sharding.sharding_filters(self.dataset)) == 1:
            start, skip = it.layout if it is not None else (0, ())
            workers = max(shape.num_workers, 1)
            taken = {shape.rank * workers + w: it.marks[w] if it is not None else 0
                     for w in range(workers)}
            how = sharding.resharding(self.dataset)
            per_batch = (how.items_per_output * (self.batch_size or 1)
                         if how.blocker is None and how.items_per_output is not None else None)
            shards = {"start": start, "skip": list(skip), "taken": taken, "per_batch": per_batch}
        seed, generator = ((it.base_seed, it.generator_state) if it is not None
                           else (None, self._generator_state()))
        return {"base_seed": seed, "generator": _copy(generator),
                "finished": it.finished if it is not None else False,
                "batches": it.batches if it is not None else 0,
                "world_size": shape.world_size, "rank": shape.rank,
                "num_workers": shape.num_workers, "shards": shards}

    def load_state_dict(self, state: dict) -> None:
        """Make the next `iter(loader)` continue from `state` (from state_dict).

        A sampler-driven loader hands the sampler its position now, so a `set_epoch` after
        this behaves as in torch: the saved epoch continues where it stopped, another epoch
        starts from its beginning. An iterable loader decides at `iter()` (where the world
        size and rank are known) whether it replays the saved shape or re-deals the rest of
        the epoch, and raises DataLoaderError there when neither can be exact.

        The loader's generator takes the saved generator state now, so the iterations after
        the resumed one draw what an uninterrupted loader's would (a loader built without a
        generator draws from core's global generator, and a state saved without one leaves
        the generator as it is). A state saved after its iteration ended (the loop saw
        StopIteration) makes the next iteration a new one, as it would have been.
        """
        if not isinstance(state, dict) or "base_seed" not in state:
            raise ValueError(f"not a DataLoader state: {state!r}")
        if self.iterable:
            stream_state.check(state)
        elif "sampler" not in state:
            raise ValueError(f"not the state of a sampler-driven DataLoader (no 'sampler'): "
                             f"{state!r}")
        generator = state.get("generator")
        if generator is not None:
            generator = state_words(generator)  # a malformed one raises before anything changes
        if self._iterator is not None:
            self._iterator.close()
            self._iterator = None
        if not self.iterable:
            self._index_sampler.load_state_dict(state["sampler"])
        if generator is not None and self.generator is not None:
            self.generator.set_state(generator)
        if state.get("finished") and not self.iterable:
            # Saved after its iteration ended: run the sampler through the rest of it (none is
            # left) as the uninterrupted loader's sampler ran, so the next iteration starts
            # afresh and a generator the sampler shares stands where it stood.
            for _ in self._index_sampler:
                pass
        self._resume = dict(state)

    def _worker_pool(self, base_seed: int) -> WorkerPool:
        if self._pool is not None and not self._pool.closed:
            return self._pool
        prepare = pipe_preparer(self.dataset)
        progress = sharding.progress if prepare is not None else None
        specs = [WorkerSpec(self.dataset, wid, self.num_workers, base_seed, self.collate_fn,
                            self.auto_collation, self.batch_size, self.drop_last, self.iterable,
                            self.worker_init_fn, prepare, progress)
                 for wid in range(self.num_workers)]
        pool = WorkerPool(specs, self.prefetch_factor, self.multiprocessing_context)
        if self.persistent_workers:
            self._pool = pool
            # Not __del__: see _MultiProcessIter (the loader sits in a cycle with its iterator).
            weakref.finalize(self, pool.shutdown)
        return pool


def _shuffle_pipe(pipe: IterDataPipe, shuffle: Optional[bool]) -> None:
    """shuffle=True/False turns the pipe's Shufflers on/off, as torch's DataLoader does.

    torch 2.13 also builds a shuffled copy of a pipe that has no Shuffler, but goes on with the
    pipe it was given, so its items come in order: shoal yields what torch yields, and says so.
    """
    if shuffle and not any(isinstance(p, Shuffler) for p in pipe.graph()):
        warnings.warn("`shuffle=True` was set, but the datapipe does not contain a `Shuffler`, "
                      "so its items come in order (as torch 2.13's DataLoader yields them); "
                      "add .shuffle() to the pipe to shuffle it.", UserWarning, stacklevel=3)
        return
    apply_shuffle_settings(pipe, shuffle)


def _copy(array: Optional[np.ndarray]) -> Optional[np.ndarray]:
    return None if array is None else np.array(array, copy=True)


def _same_state(a: Any, b: Any) -> bool:
    """Whether two sampler states are equal (they may hold arrays, e.g. a generator's)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return a is not None and b is not None and np.array_equal(a, b)
    return bool(a == b)
