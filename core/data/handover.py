"""Batch hand-over from a loader worker to the main process through shared memory.

A worker pickles its batch with protocol 5, so every contiguous array travels out of band as a
raw buffer; the buffers are copied into one of the worker's slots (a file in /dev/shm mapped
by both processes) and only the small pickle and the buffers' offsets go through the pipe.
The main process maps a slot the first time it sees it and unlinks the file at once, so the
memory disappears with the last process that maps it, even after a SIGKILL. The batch's arrays
are views of the slot (no copy on either side after the worker's one): the slot returns to the
worker's free list only when the last of those arrays is garbage collected, so a batch the
training loop keeps stays valid, and the loader opens another slot meanwhile. Batches under
INLINE_BYTES go through the pipe whole: a slot's round trip costs more than a small copy.
"""

from __future__ import annotations

import glob
import itertools
import mmap
import os
import pickle
import weakref
from typing import Any, Callable, Optional

import numpy as np

INLINE_BYTES = 64 * 1024
ALIGN = 64
SHM_DIR = "/dev/shm"
_PREFIX = "shoal-data"
_counter = itertools.count()


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _map(path: str, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)  # the mapping keeps the memory; the descriptor is not needed


def stale_paths(worker_pid: int) -> list[str]:
    """Slot files a (dead) worker created that no main process has unlinked yet."""
    return glob.glob(os.path.join(SHM_DIR, f"{_PREFIX}-{worker_pid}-*"))


class SlotWriter:
    """The worker's side: its slots, grown on demand, and the packing of one batch."""

    def __init__(self) -> None:
        self._slots: dict[int, tuple[str, mmap.mmap]] = {}

    def pack(self, data: Any, slot: int) -> tuple:
        """The message for `data`: (pickle, layout, slot path or None, slot size)."""
        buffers: list[pickle.PickleBuffer] = []
        header = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
        raws = [b.raw() for b in buffers]
        total = sum(_aligned(r.nbytes) for r in raws)
        if total < INLINE_BYTES:
            return header, None, [bytearray(r) for r in raws], 0  # writable arrays
        path, region = self._slot(slot, total)
        layout, offset = [], 0
        dest = np.frombuffer(region, dtype=np.uint8)
        for raw in raws:
            dest[offset:offset + raw.nbytes] = np.frombuffer(raw, dtype=np.uint8)
            layout.append((offset, raw.nbytes))
            offset += _aligned(raw.nbytes)
        del dest  # an exported buffer would keep the mapping from being closed
        for b in buffers:
            b.release()
        return header, path, layout, len(region)

    def _slot(self, slot: int, need: int) -> tuple[str, mmap.mmap]:
        current = self._slots.get(slot)
        if current is not None and len(current[1]) >= need:
            return current
        if current is not None:
            current[1].close()
            _unlink_quietly(current[0])  # the main process unlinked it already unless it died
        size = max(need, 1 << 20)
        size = 1 << (size - 1).bit_length()  # powers of two: a growing batch remaps rarely
        path = os.path.join(SHM_DIR, f"{_PREFIX}-{os.getpid()}-{slot}-{next(_counter)}")
        self._slots[slot] = (path, _map(path, size, create=True))
        return self._slots[slot]

    def close(self) -> None:
        """Unmap every slot (and unlink any the main process never opened)."""
        for path, region in self._slots.values():
            region.close()
            _unlink_quietly(path)
        self._slots.clear()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SlotReader:
    """The main process's side: the slots it mapped, keyed by (worker, slot)."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], tuple[str, mmap.mmap]] = {}

    def unpack(self, worker: int, slot: int, header: bytes, path: Optional[str],
               layout: list, size: int, release: Callable[[], None]) -> Any:
        """Rebuild the batch over the slot; `release()` runs once no array of it is left.

        Inline batches need no slot, so `release` runs at once for them.
        """
        if path is None:
            release()
            return pickle.loads(header, buffers=layout)
        region = self._region(worker, slot, path, size)
        end = layout[-1][0] + layout[-1][1] if layout else 0
        # One array per delivery: every rebuilt array is a view of it (numpy keeps the chain),
        # so its finalizer runs when the training loop has dropped the whole batch.
        lease = np.frombuffer(region, dtype=np.uint8, count=end)
        weakref.finalize(lease, release)
        return pickle.loads(header, buffers=[lease[o:o + n] for o, n in layout])

    def _region(self, worker: int, slot: int, path: str, size: int) -> mmap.mmap:
        current = self._maps.get((worker, slot))
        if current is not None and current[0] == path:
            return current[1]
        # A grown slot replaces the old mapping, which lives on while arrays still view it.
        region = _map(path, size, create=False)
        _unlink_quietly(path)  # mapped on both sides: the name is no longer needed
        self._maps[(worker, slot)] = (path, region)
        return region

    def close(self) -> None:
        """Drop the mappings (a mapping still viewed by batches closes when they are freed)."""
        for _, region in self._maps.values():
            try:
                region.close()
            except BufferError:
                pass  # arrays of a batch still view it: it is unmapped when they are collected
        self._maps.clear()
