"""The DataLoader's iterators: one process, or worker processes kept prefetch_factor tasks ahead.

Both count what they handed to the training loop (samples, batches, each worker's shard
position for an iterable dataset), which is what DataLoader.state_dict records, and note when
the loop saw the end of the iteration. The worker processes live in pool.py; the batches they
build cross into this process through shared memory (handover.py).
"""

from __future__ import annotations

import itertools
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import numpy as np

from shoal.core.data import pin as pinning
from shoal.core.data import stream_state
from shoal.core.data.datapipes import sharding
from shoal.core.data.datapipes.iter import IterDataPipe
from shoal.core.data.errors import DataLoaderError
from shoal.core.data.pool import FAILED_JOIN_S, JOIN_S, Failure, WorkerPool
from shoal.core.data.worker import fetch_indexed, take_batch

if TYPE_CHECKING:
    from shoal.core.data.dataloader import DataLoader

_END = object()  # an iterable dataset's worker ran out of items
_iterations = itertools.count()


def pipe_preparer(dataset: Any) -> Optional[Callable]:
    """DataPipes are sharded over (rank, worker) inside each worker; other datasets are not."""
    return sharding.prepare_in_worker if isinstance(dataset, IterDataPipe) else None


class _LoaderIter:
    """What both iterators share: counting what was handed out, pinning, closing."""

    def __init__(self, loader: "DataLoader", base_seed: int,
                 shape: Optional[stream_state.Shape], layout: Optional[tuple]) -> None:
        self.loader = loader
        self.base_seed = base_seed
        # The loader generator's state right after this iteration drew its seed (None without
        # a generator): what a resumed loader's generator continues from.
        self.generator_state: Optional[np.ndarray] = None
        self.samples = 0  # samples handed to the training loop in this iteration
        self.batches = 0
        self.finished = False  # it raised StopIteration: the next iteration is a new one
        # An iterable dataset's: the shape and layout it deals, and per worker the count of its
        # shard's items in the batches handed out so far (its sharding_filter's mark).
        self.shape, self.layout = shape, layout
        workers = max(loader.num_workers, 1)
        self.marks = [0] * workers

    def __iter__(self) -> "_LoaderIter":
        return self

    def _hand_out(self, batch: Any, samples: int) -> Any:
        self.samples += samples
        self.batches += 1
        return pinning.pin(batch) if self.loader.pin_memory else batch

    def skip(self, batches: int) -> None:
        """Discard the first `batches` batches (an iterable dataset's resume)."""
        for _ in range(batches):
            next(self)

    def close(self) -> None:
        """Release what the iteration holds."""


class _SingleProcessIter(_LoaderIter):
    """`indices`: the loader's sampler, started (None for an iterable dataset)."""

    def __init__(self, loader: "DataLoader", base_seed: int,
                 shape: Optional[stream_state.Shape], layout: Optional[tuple],
                 indices: Optional[Iterator]) -> None:
        super().__init__(loader, base_seed, shape, layout)
        prepare = pipe_preparer(loader.dataset)
        if prepare is not None:
            prepare(loader.dataset, 0, 1, base_seed, layout)
        self._indices = indices
        self._items = iter(loader.dataset) if loader.iterable else None

    def __next__(self) -> Any:
        try:
            if self._items is None:
                return self._next_indexed()
            try:
                batch, samples = self._next_streamed()
            finally:  # the shard's count, also at the end of the stream
                mark = sharding.progress(self.loader.dataset)
                if mark is not None:
                    self.marks[0] = mark
            return self._hand_out(batch, samples)
        except StopIteration:
            self.finished = True
            raise

    def _next_streamed(self) -> tuple[Any, int]:
        loader = self.loader
        if not loader.auto_collation:
            return loader.collate_fn(next(self._items)), 1
        items = take_batch(self._items, loader.batch_size, loader.drop_last)
        return loader.collate_fn(items), len(items)

    def _next_indexed(self) -> Any:
        loader = self.loader
        indices = next(self._indices)
        samples = len(indices) if loader.auto_collation else 1
        try:
            batch = fetch_indexed(loader.dataset, indices, loader.auto_collation,
                                  loader.collate_fn)
        except Exception:
            self.samples += samples  # the loop is past this batch: a resume starts after it
            raise
        return self._hand_out(batch, samples)


class _MultiProcessIter(_LoaderIter):
    """Keeps prefetch_factor tasks in flight per worker and yields results in task order.

    `pool`: the loader's workers (kept by the loader across epochs when they persist);
    `indices`: its sampler, started (None for an iterable dataset).
    """

    def __init__(self, loader: "DataLoader", base_seed: int,
                 shape: Optional[stream_state.Shape], layout: Optional[tuple],
                 indices: Optional[Iterator], pool: WorkerPool) -> None:
        super().__init__(loader, base_seed, shape, layout)
        self.pool = pool
        if not loader.persistent_workers:
            # A finalizer rather than __del__: the loader and this iterator refer to each other,
            # and when the garbage collector frees such a cycle it may run the pool's
            # Connections' __del__ first, which closes their descriptors without marking them
            # closed; a finalizer keeps the pool out of the cycle, so it shuts down intact.
            weakref.finalize(self, pool.shutdown)
        self._indices = indices
        self._tasks: dict[int, tuple[int, int]] = {}  # task -> (worker, samples)
        self._done: dict[int, tuple[Any, Any]] = {}  # task -> (batch, END or Failure; mark)
        self._exhausted = [False] * self.pool.size
        self._held = [0] * self.pool.size  # received from each worker, not yet handed out
        self._send, self._next, self._turn = 0, 0, 0
        self._sampler_done = False
        self._fatal: Optional[BaseException] = None  # what ended the workers mid-iteration
        self._fatal_text = ""
        self._epoch = next(_iterations)  # tags this iteration's tasks (a reused pool's stale ones)
        if loader.iterable:
            for w in range(self.pool.size):
                self.pool.send(w, ("reset", base_seed, layout))
        try:
            while self._dispatch():
                pass
        except BaseException:
            self.close()
            raise

    def _dispatch(self) -> bool:
        """Send one more task if a worker has a free slot and there is work; True if sent."""
        pool = self.pool
        for k in range(pool.size):
            w = (self._turn + k) % pool.size
            # torch's bound: prefetch_factor batches per worker not yet handed out, whether
            # still in the worker (ours or an abandoned iteration's) or received and waiting.
            room = pool.outstanding[w] + self._held[w] < pool.prefetch_factor
            if room and not self._exhausted[w]:
                break
        else:
            return False
        samples = 1
        indices = None
        if self._indices is not None:
            if self._sampler_done:
                return False
            try:
                indices = next(self._indices)
            except StopIteration:
                self._sampler_done = True
                return False
            samples = len(indices) if self.loader.auto_collation else 1
        self._turn = (w + 1) % pool.size
        task = self._send
        self._send += 1
        self._tasks[task] = (w, samples)
        pool.submit(w, (self._epoch, task), indices)
        return True

    def _finished(self) -> bool:
        """No task of ours is out and none can be sent (the sampler or every stream ran dry)."""
        if self._indices is not None:
            return self._sampler_done
        return all(self._exhausted)

    def __next__(self) -> Any:
        if self._fatal is not None:
            raise DataLoaderError(
                f"this DataLoader iterator stopped at an earlier error ({self._fatal_text}); "
                "iter(loader) starts a new iteration") from self._fatal
        try:
            item, samples = self._next_batch()
        except StopIteration:
            self.finished = True
            self.close()
            raise
        except BaseException as exc:  # the workers cannot go on (died, timed out, Ctrl-C)
            self._fatal = exc
            self._fatal_text = ": ".join([type(exc).__name__, *str(exc).splitlines()[:1]])
            self.close(error=True)
            raise
        if isinstance(item, Failure):
            # The dataset's error in this one batch: as torch, it is raised here and the
            # workers go on with the next batches.
            if self._indices is not None:
                self.samples += samples  # the loop is past this batch: a resume starts after it
            raise item.exception()
        return self._hand_out(item, samples)

    def _next_batch(self) -> tuple[Any, int]:
        """The next batch (or the Failure in its place) and its sample count."""
        timeout = self.loader.timeout
        # One deadline per batch asked for, however many other batches arrive meanwhile.
        deadline = time.monotonic() + timeout if timeout > 0 else None
        while True:
            if self._next in self._done:
                item, mark = self._done.pop(self._next)
                worker, samples = self._tasks.pop(self._next)
                if mark is not None:
                    self.marks[worker] = mark
                self._held[worker] -= 1
                self._next += 1
                self._dispatch()
                if item is _END:
                    continue
                return item, samples
            if self._next >= self._send and not self._dispatch():
                if self._finished():
                    raise StopIteration
                # Every worker's tasks are an abandoned iteration's (persistent workers): their
                # answers make room.
                blame = list(range(self.pool.size))
                what = "an abandoned iteration's batches"
            else:
                blame = [self._tasks[self._next][0]]
                what = f"batch {self._next}"
            for w, message in self.pool.receive(deadline, timeout, what, blame):
                self._accept(w, message)

    def _accept(self, worker: int, message: tuple) -> None:
        kind, tag = message[0], message[1]
        if kind == "error" and tag is None:  # worker_init_fn failed: the worker is gone
            raise message[2].exception()
        epoch, task = tag
        if epoch != self._epoch:
            return  # an abandoned iteration's batch (persistent workers): its slot is free
        self._held[worker] += 1
        if kind == "batch":
            self._done[task] = (message[3], message[4])
        elif kind == "error":
            self._done[task] = (message[2], None)
        elif kind == "end":
            self._exhausted[worker] = True
            self._done[task] = (_END, message[2])

    def close(self, error: bool = False) -> None:
        if error or not self.loader.persistent_workers:
            # A persistent pool shut down here stays with the loader, closed: its next
            # iteration starts a fresh one (DataLoader._worker_pool skips a closed pool).
            self.pool.shutdown(grace=FAILED_JOIN_S if error else JOIN_S)
