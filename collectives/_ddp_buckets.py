"""Gradient buckets for DistributedDataParallel: assignment by size, flat buffers and views.

A bucket is one flat array holding several parameters' gradients end to end, so that one
collective reduces them all. Parameters enter buckets in the order their gradients are expected
(reverse parameter order at first, the observed arrival order after one iteration), and the
first bucket is kept small so that its collective starts as early as possible in backward.
"""

from __future__ import annotations

from typing import Any, Sequence

from core import backend

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


class Bucket:
    """One flat gradient buffer and the parameters whose gradients live in it, in order."""

    __slots__ = (
        "index", "param_indices", "params", "offsets", "numels", "buffer", "views",
        "pending", "is_last", "work", "launched_at", "done_at",
    )

    def __init__(self, index: int, param_indices: list[int], params: Sequence[Any]) -> None:
        self.index = index
        self.param_indices = list(param_indices)
        self.params = [params[i] for i in self.param_indices]
        first = self.params[0].data
        xp = backend.array_module(first)
        self.numels = [int(p.data.size) for p in self.params]
        self.offsets = []
        offset = 0
        for n in self.numels:
            self.offsets.append(offset)
            offset += n
        self.buffer = xp.zeros(offset, dtype=first.dtype)
        self.views = self._make_views(self.buffer)
        self.pending = len(self.params)
        self.is_last = False
        self.work = None
        self.launched_at = 0.0
        self.done_at: float | None = None

    def _make_views(self, buffer: Any) -> list:
        return [
            buffer[o : o + n].reshape(p.data.shape)
            for o, n, p in zip(self.offsets, self.numels, self.params)
        ]

    def set_buffer(self, buffer: Any) -> None:
        """Point the bucket at a new flat buffer of the same size (the views follow)."""
        if buffer.shape != self.buffer.shape or buffer.dtype != self.buffer.dtype:
            raise ValueError(
                f"Bucket {self.index} holds {self.buffer.size} elements of "
                f"{self.buffer.dtype}; a replacement buffer of shape {tuple(buffer.shape)} "
                f"and dtype {buffer.dtype} does not fit."
            )
        self.buffer = buffer
        self.views = self._make_views(buffer)

    @property
    def nbytes(self) -> int:
        """Size of the flat buffer in bytes."""
        return int(self.buffer.nbytes)

    def reset(self) -> None:
        """Forget the last iteration's readiness and communication."""
        self.pending = len(self.params)
        self.work = None
        self.done_at = None
