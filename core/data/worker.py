"""The loader worker process: its seeding, `get_worker_info()`, and its task loop.

Seeding follows torch: worker `i` of an iterator whose base seed is `b` seeds Python's `random`
and core with `b + i`, and numpy's global generator with four words of a SeedSequence over
(i, b mod 2**32, b >> 32, 0), which is what torch's `_generate_state` computes.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import random
import signal
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import numpy as np

from shoal.core.data.handover import SlotWriter
from shoal.core.ops import random as core_random

# How often an idle worker checks that the process that started it is still there.
PARENT_POLL_S = 1.0


def take_batch(items: Any, batch_size: int, drop_last: bool) -> list:
    """The next `batch_size` items of the iterator `items` (fewer at its end, unless
    `drop_last`), for a batch of an iterable dataset, in a worker or in the loading process.

    Raises:
        StopIteration: nothing is left, or only a short batch that `drop_last` drops.
    """
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == batch_size:
            break
    if not batch or (drop_last and len(batch) < batch_size):
        raise StopIteration
    return batch


def fetch_indexed(dataset: Any, indices: Any, auto_collation: bool, collate_fn: Callable) -> Any:
    """A map-style dataset's batch for a sampler's `indices`, as torch's _MapDatasetFetcher:
    a dataset with `__getitems__` reads the batch's samples in one call."""
    if not auto_collation:
        return collate_fn(dataset[indices])
    getitems = getattr(dataset, "__getitems__", None)
    return collate_fn(getitems(indices) if getitems else [dataset[i] for i in indices])


@dataclass(frozen=True)
class WorkerInfo:
    """What `get_worker_info()` returns inside a worker."""

    id: int
    num_workers: int
    seed: int
    dataset: Any


_info: Optional[WorkerInfo] = None


def get_worker_info() -> Optional[WorkerInfo]:
    """This worker's id, count, seed and dataset copy; None in the main process."""
    return _info


def numpy_seed_words(base_seed: int, worker_id: int) -> np.ndarray:
    """The four words torch seeds a worker's numpy global generator with."""
    entropy = [worker_id, base_seed & 0xFFFFFFFF, base_seed >> 32, 0]
    return np.random.SeedSequence(entropy, pool_size=4).generate_state(4)


def seed_worker(base_seed: int, worker_id: int) -> int:
    """Seed random, numpy and core for worker `worker_id`; returns the worker's seed."""
    seed = base_seed + worker_id
    random.seed(seed)
    core_random.manual_seed(seed)
    np.random.seed(numpy_seed_words(base_seed, worker_id))
    return seed


def _die_with_parent(worker_id: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (a rank killed mid-step), and
    name it `shoal-data-N` (what ps and /proc/PID/comm show)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        libc.prctl(15, f"shoal-data-{worker_id}".encode()[:15])  # PR_SET_NAME
    except (OSError, AttributeError):
        pass  # not Linux: the idle poll below still notices the parent is gone


@dataclass
class WorkerSpec:
    """Everything a worker needs, sent to it once at start (pickled under spawn)."""

    dataset: Any
    worker_id: int
    num_workers: int
    base_seed: int
    collate_fn: Optional[Callable]
    auto_collation: bool
    batch_size: Optional[int]
    drop_last: bool
    iterable: bool
    worker_init_fn: Optional[Callable]
    prepare: Optional[Callable]  # called with the dataset before iterating (DataPipe sharding)
    progress: Optional[Callable] = None  # the dataset's shard count after a batch (a mark)


def _error_message(exc: BaseException, task_id: Optional[int], where: str) -> tuple:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        exc_type = pickle.dumps(type(exc))
    except Exception:  # noqa: BLE001 - a local class: the loader raises WorkerError instead
        exc_type = None
    return ("error", task_id, exc_type, type(exc).__name__, where, text)


def _raising(exc: Exception) -> Iterator:
    """An iterator whose first item raises `exc` and which is exhausted after it."""
    raise exc
    yield  # a generator: the raise waits for the first next()


class _Fetcher:
    """Turns a task into a batch: indices for map-style datasets, the next items for iterables."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self._iterator = None

    def reset(self, seed: Optional[int] = None, layout: Optional[tuple] = None) -> None:
        """Start the stream afresh (a DataPipe re-prepared with the iteration's seed and, for
        a resumed epoch, the layout that passes over what earlier attempts consumed)."""
        spec = self.spec
        try:
            if seed is not None and spec.prepare is not None:
                spec.prepare(spec.dataset, spec.worker_id, spec.num_workers, seed, layout)
            if spec.iterable:
                self._iterator = iter(spec.dataset)
        except Exception as exc:  # noqa: BLE001 - the next batch re-raises it in the loader
            # As torch: the worker lives on, its next batch is this error, and its stream ends
            # after it (torch's later batches fail with UnboundLocalError: it never made them).
            self._iterator = _raising(exc)

    def fetch(self, indices: Optional[list]) -> Any:
        spec = self.spec
        if not spec.iterable:
            return fetch_indexed(spec.dataset, indices, spec.auto_collation, spec.collate_fn)
        if self._iterator is None:
            self.reset()
        if not spec.auto_collation:
            return spec.collate_fn(next(self._iterator))
        return spec.collate_fn(take_batch(self._iterator, spec.batch_size, spec.drop_last))

    def mark(self) -> Optional[int]:
        """How far this worker's shard got (sent with each batch; None for other datasets)."""
        return self.spec.progress(self.spec.dataset) if self.spec.progress is not None else None


def worker_loop(conn: Any, spec: WorkerSpec, parent_pid: int) -> None:
    """Serve tasks from `conn` until told to stop or the parent disappears."""
    global _info
    _die_with_parent(spec.worker_id)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    seed = seed_worker(spec.base_seed, spec.worker_id)
    _info = WorkerInfo(spec.worker_id, spec.num_workers, seed, spec.dataset)
    writer = SlotWriter()
    try:
        if spec.prepare is not None:
            spec.prepare(spec.dataset, spec.worker_id, spec.num_workers, spec.base_seed)
        if spec.worker_init_fn is not None:
            spec.worker_init_fn(spec.worker_id)
    except BaseException as exc:  # noqa: BLE001 - reported to the main process, then exit
        conn.send(_error_message(exc, None, "worker_init_fn"))
        return
    fetcher = _Fetcher(spec)
    try:
        _serve(conn, fetcher, writer, parent_pid)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the main process went away or closed the pipe: nothing left to serve
    finally:
        writer.close()
        conn.close()


def _serve(conn: Any, fetcher: _Fetcher, writer: SlotWriter, parent_pid: int) -> None:
    while True:
        if not conn.poll(PARENT_POLL_S):
            if os.getppid() != parent_pid:
                return
            continue
        task = conn.recv()
        kind = task[0]
        if kind == "stop":
            return
        if kind == "reset":  # a new iteration: its seed and layout
            fetcher.reset(task[1], task[2])
            continue
        _, task_id, indices, slot = task
        try:
            data = fetcher.fetch(indices)
        except StopIteration:
            conn.send(("end", task_id, fetcher.mark()))
            continue
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main process
            conn.send(_error_message(exc, task_id, "fetching a batch"))
            continue
        try:
            header, path, layout, size = writer.pack(data, slot)
        except Exception as exc:  # noqa: BLE001 - e.g. a batch holding an unpicklable object
            conn.send(_error_message(exc, task_id, "sending a batch to the main process"))
            continue
        conn.send(("batch", task_id, slot, header, path, layout, size, fetcher.mark()))

