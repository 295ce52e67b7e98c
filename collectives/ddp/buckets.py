"""Gradient buckets for DistributedDataParallel: assignment by size, flat buffers and views.

A bucket is one flat array holding several parameters' gradients end to end, so that one
collective reduces them all. Parameters enter buckets in the order their gradients are expected
(reverse parameter order at first, the observed arrival order after one iteration), and the
first bucket is kept small so that its collective starts as early as possible in backward.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import numpy as np

from shoal.core import backend
from shoal.core.tensor import Tensor

MIB = 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB  # torch's _DEFAULT_FIRST_BUCKET_BYTES


def compute_bucket_assignment(
    numels: Sequence[int],
    dtypes: Sequence[Any],
    order: Sequence[int],
    limits: Sequence[int],
) -> list[list[int]]:
    """Group parameter indices, taken in `order`, into buckets of one dtype each.

    A bucket closes as soon as it holds at least its byte limit (so one large parameter makes
    a bucket of its own rather than being split); the k-th bucket of a dtype uses `limits[k]`,
    the last limit repeating. Buckets come back ordered by the position of their first member
    in `order`, which is the order their collectives are launched in.
    """
    if not limits or any(limit <= 0 for limit in limits):
        raise ValueError(f"Bucket size limits must be positive byte counts, got {list(limits)}.")
    position = {index: pos for pos, index in enumerate(order)}
    if len(position) != len(order):
        raise ValueError(f"Bucket order lists a parameter twice: {list(order)}.")
    open_buckets: dict[Any, list] = {}  # dtype -> [indices, bytes, how many closed so far]
    closed: list[list[int]] = []
    for index in order:
        dtype = dtypes[index]
        entry = open_buckets.get(dtype)
        if entry is None:
            entry = open_buckets[dtype] = [[], 0, 0]
        entry[0].append(index)
        entry[1] += int(numels[index]) * dtype.itemsize
        if entry[1] >= limits[min(entry[2], len(limits) - 1)]:
            closed.append(entry[0])
            open_buckets[dtype] = [[], 0, entry[2] + 1]
    closed.extend(entry[0] for entry in open_buckets.values() if entry[0])
    closed.sort(key=lambda bucket: position[bucket[0]])
    return closed


def _alias(buffer: Any) -> Any:
    """A second array over `buffer`'s memory whose views count against it, not against `buffer`.

    numpy collapses a view's base to the array that owns the memory, so views of a plain view
    would keep `buffer` itself alive, as does the process group's record of a collective. An
    array built over a memoryview is a base of its own: its reference count tells how many of
    the gradients handed out as its views are still alive.
    """
    if isinstance(buffer, np.ndarray):
        return np.frombuffer(memoryview(buffer), dtype=buffer.dtype)
    return buffer  # cupy: fresh buffers come cheaply from cupy's memory pool


class Bucket:
    """One flat gradient buffer and the parameters whose gradients live in it, in order."""

    __slots__ = (
        "index", "param_indices", "params", "offsets", "numels", "buffer", "alias", "views",
        "pending", "is_last", "work", "launched_at", "done_at", "spare", "first_ready_at",
    )

    def __init__(self, index: int, param_indices: list[int], params: Sequence[Any]) -> None:
        self.index = index
        self.param_indices = list(param_indices)
        self.params = [params[i] for i in self.param_indices]
        first = self.params[0].array
        xp = backend.array_module(first)
        self.numels = [int(p.array.size) for p in self.params]
        self.offsets = []
        offset = 0
        for n in self.numels:
            self.offsets.append(offset)
            offset += n
        self.spare: Any = None
        self.set_buffer(xp.zeros(offset, dtype=first.dtype))
        self.pending = len(self.params)
        self.is_last = False
        self.work = None
        self.launched_at = 0.0
        self.first_ready_at = 0.0  # when this round's first gradient of the bucket arrived
        self.done_at: float | None = None

    def set_buffer(self, buffer: Any) -> None:
        """Point the bucket at a flat buffer (the views, handed out as gradients, follow)."""
        if hasattr(self, "buffer") and (
            buffer.shape != self.buffer.shape or buffer.dtype != self.buffer.dtype
        ):
            raise ValueError(
                f"Bucket {self.index} holds {self.buffer.size} elements of "
                f"{self.buffer.dtype}; a replacement buffer of shape {tuple(buffer.shape)} "
                f"and dtype {buffer.dtype} does not fit."
            )
        self.buffer = buffer
        self.alias = _alias(buffer)
        self.views = [
            self.alias[o : o + n].reshape(p.array.shape)
            for o, n, p in zip(self.offsets, self.numels, self.params)
        ]

    def swap_buffers(self) -> None:
        """Reduce into the other of two buffers, so the last round's stays the parameters' .grad.

        The averaged gradients of a round are handed out as views of its buffer instead of
        being copied out; the next round writes into a second buffer, and the round after
        reuses the first only when no view of it is alive any more (the optimizer's zero_grad
        dropped them); otherwise it allocates a new one, so a gradient someone kept is never
        overwritten. Reusing buffers avoids the page faults of fresh multi-MiB allocations.
        """
        spare = self.spare
        self.spare = None
        # References to the alias: the `spare` tuple's and getrefcount's argument; any more
        # are views someone still holds.
        if spare is None or spare[1] is spare[0] or sys.getrefcount(spare[1]) > 2:
            buffer = backend.array_module(self.buffer).empty_like(self.buffer)
        else:
            buffer = spare[0]
        self.spare = (self.buffer, self.alias)
        self.views = []  # drop this round's views before they are handed out again
        self.set_buffer(buffer)

    @property
    def nbytes(self) -> int:
        """Size of the flat buffer in bytes."""
        return int(self.buffer.nbytes)

    def reset(self) -> None:
        """Forget the last iteration's readiness and communication."""
        self.pending = len(self.params)
        self.work = None
        self.done_at = None


class GradBucket:
    """What a communication hook receives: one bucket's flat gradient buffer and its members."""

    def __init__(self, bucket: Bucket, is_last: bool) -> None:
        self._bucket = bucket
        self._is_last = is_last

    def index(self) -> int:
        """The bucket's position in launch order (0 is launched first)."""
        return self._bucket.index

    def buffer(self) -> Tensor:
        """The flat gradient buffer (a Tensor sharing the bucket's memory)."""
        return Tensor(self._bucket.buffer)

    def gradients(self) -> list[Tensor]:
        """One Tensor per parameter, each a view into the buffer."""
        return [Tensor(v) for v in self._bucket.views]

    def parameters(self) -> list[Tensor]:
        """The parameters whose gradients this bucket holds, in buffer order."""
        return list(self._bucket.params)

    def is_last(self) -> bool:
        """True for the last bucket of the iteration."""
        return self._is_last

    def set_buffer(self, buffer: Any) -> None:
        """Replace the bucket's flat buffer with an array (or Tensor) of the same size."""
        self._bucket.set_buffer(buffer.array if isinstance(buffer, Tensor) else buffer)
