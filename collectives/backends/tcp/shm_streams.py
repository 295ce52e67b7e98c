"""Shared-memory relay and reduce-scatter of *streams*: the building blocks of every collective
among ranks that share a host, and of the within-host phases of the hierarchical ones.

A stream is a list of 1-D arrays read (or written) one after the other as if they were one
array: the blocks of a scatter, the segments a rank forwards for its peers on other hosts.
Working on streams lets one pipelined loop serve broadcast, gather, scatter, all_gather,
all_to_all and reduce_scatter without first copying blocks into one contiguous buffer.

Both functions run the same number of steps on every rank (it depends only on lengths every
rank knows), with one barrier between steps, over the three rotating buffers of each rank's
region (see `shm`): a buffer is written again only three steps later, after every peer passed
the barrier that follows its last read of it. Every output element is written by one rank
only (its owner reduces it, readers copy it), so all ranks agree bitwise.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from shoal.collectives.backends.tcp.shm import BUFFERS, SharedSlots
from shoal.collectives.constants import SHM_SLOT_BYTES, SHM_W2_MIN_CHUNK_BYTES

__all__ = ["relay", "reduce_scatter", "stream_length", "step_bytes"]


def step_bytes(nbytes: int) -> int:
    """Bytes per shared-memory step for a message of `nbytes`: at least four steps (so that
    publishing one overlaps the copies out of the previous one), within 256 KiB .. a slot."""
    return min(SHM_SLOT_BYTES, max(SHM_W2_MIN_CHUNK_BYTES, nbytes // 4))


def stream_length(parts: Sequence[np.ndarray]) -> int:
    """Elements in the stream that `parts` make end to end."""
    return sum(p.size for p in parts)


def _windows(parts: Sequence[np.ndarray], lo: int, hi: int):
    """(part, start, stop, position) for the pieces of the stream's elements [lo, hi):
    part[start:stop] is the stream's [position, position + stop - start)."""
    pos = 0
    for part in parts:
        end = pos + part.size
        if end > lo and pos < hi:
            a, b = max(lo, pos), min(hi, end)
            yield part, a - pos, b - pos, a
        if end >= hi:
            break
        pos = end


def _write_window(parts, lo: int, hi: int, dst: np.ndarray) -> None:
    """dst[:hi - lo] := stream[lo:hi]."""
    for part, a, b, pos in _windows(parts, lo, hi):
        np.copyto(dst[pos - lo:pos - lo + b - a], part[a:b])


def relay(slots: SharedSlots, barrier: Callable[[], object], lengths: Sequence[int],
          publish: Optional[Sequence[np.ndarray]], wants: dict, chunk_bytes: int) -> None:
    """Owners publish byte streams; readers copy the ranges they want.

    Args:
        lengths: the byte length of each local rank's published stream (the same list on every
            rank; 0 for a rank that publishes nothing).
        publish: this rank's stream (uint8 arrays), None or empty when its length is 0.
        wants: owner -> [(offset in the owner's stream, uint8 destination array)].
        chunk_bytes: bytes published per step (at most the slot size).
    """
    step_bytes = max(1, min(chunk_bytes, slots.slot_bytes))
    longest = max(lengths) if lengths else 0
    n_steps = -(-longest // step_bytes)
    if n_steps == 0:
        return
    first = slots.claim(n_steps)
    me = slots.rank
    mine = lengths[me]
    for step in range(n_steps + 1):
        if step < n_steps and publish:
            lo = step * step_bytes
            hi = min(lo + step_bytes, mine)
            if hi > lo:
                slot = slots.slot(me, (first + step) % BUFFERS, np.uint8, hi - lo)
                _write_window(publish, lo, hi, slot)
        if step >= 1:
            k = step - 1
            wlo = k * step_bytes
            buf = (first + k) % BUFFERS
            for owner, ranges in wants.items():
                whi = min(wlo + step_bytes, lengths[owner])
                if whi <= wlo:
                    continue
                region = slots.slot(owner, buf, np.uint8, whi - wlo)
                for offset, dst in ranges:
                    a, b = max(wlo, offset), min(whi, offset + dst.size)
                    if b > a:
                        np.copyto(dst[a - offset:b - offset], region[a - wlo:b - wlo])
        if step < n_steps:
            barrier()


def reduce_scatter(slots: SharedSlots, barrier: Callable[[], object], uf, dtype,
                   lengths: Sequence[int], sends: dict, acc: Sequence[np.ndarray]) -> None:
    """Each local rank j ends with the reduction, over the local ranks, of their stream for j.

    Args:
        lengths: elements of owner j's stream (the same list on every rank; 0: owns nothing).
        sends: owner j -> this rank's stream for j (arrays of `dtype`), for every other owner
            with a non-zero length.
        acc: this rank's own stream, holding its own contribution on entry and the reduction
            on return (it may alias the caller's data: only its owner ever writes it).
    """
    size, me = slots.size, slots.rank
    itemsize = np.dtype(dtype).itemsize
    # Each buffer is cut into one sub-slot per local rank: sub-slot j carries the piece of
    # owner j's stream that this step moves.
    piece = max(1, (slots.slot_bytes // size) // itemsize)
    longest = max(lengths) if lengths else 0
    n_steps = -(-longest // piece)
    if n_steps == 0:
        return
    first = slots.claim(n_steps)
    own = lengths[me]
    for step in range(n_steps + 1):
        if step < n_steps:
            buf = (first + step) % BUFFERS
            lo = step * piece
            region = slots.slot(me, buf, dtype, size * piece)
            for owner, parts in sends.items():
                hi = min(lo + piece, lengths[owner])
                if hi > lo:
                    _write_window(parts, lo, hi, region[owner * piece:owner * piece + hi - lo])
        if step >= 1:
            k = step - 1
            lo = k * piece
            hi = min(lo + piece, own)
            if hi > lo:
                buf = (first + k) % BUFFERS
                for q in range(size):
                    if q == me:
                        continue
                    theirs = slots.slot(q, buf, dtype, size * piece)[me * piece:me * piece + hi - lo]
                    for part, a, b, pos in _windows(acc, lo, hi):
                        target = part[a:b]
                        uf(target, theirs[pos - lo:pos - lo + b - a], out=target)
        if step < n_steps:
            barrier()
