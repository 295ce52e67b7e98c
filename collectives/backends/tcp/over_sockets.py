"""The tcp backend's collectives over its sockets alone: the flat algorithms, for ranks on
different hosts (and for every group when shared memory is off), and the cross-host phase of
the hierarchical ones, which run them on a `Links.subset`.

Each picks its algorithm by size (see `algorithms`): a direct exchange while a message fits
the socket buffers, a pumped ring or chain above that, a ring with a sender thread for the
largest all_reduces. Reductions take the ufunc of the op and never divide: the caller finishes
an AVG once, over the whole group.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from shoal.collectives import arrays
from shoal.collectives.backends.tcp import algorithms as algos
from shoal.collectives.backends.tcp.links import Links
from shoal.collectives.backends.tcp.pump import pump, pump_threaded
from shoal.collectives.constants import (
    DIRECT_MAX_RANKS,
    PUMP_CHUNK_BYTES,
    SMALL_MAX_BYTES,
    THREADED_CHUNK_MAX_BYTES,
    THREADED_CHUNK_MIN_BYTES,
    THREADED_CHUNKS_PER_SEGMENT,
    THREADED_MIN_BYTES,
)

__all__ = ["all_reduce", "reduce_scatter", "broadcast", "all_gather", "rooted", "all_to_all"]

# The threaded ring's smallest chunk. Each chunk is a tagged frame, and with the tags a frame
# costs its ranks CPU beyond its GMAC bytes: 4 MiB all_reduces over loopback TCP at W=2 spent
# 0.25 ms less CPU per rank (1.30 against 1.55 ms; 1.55 against 1.76 ms wall) in 1 MiB chunks
# than in collectives.constants' 512 KiB floor, while the tree before the tags gained nothing
# from larger chunks; 2 MiB at W=2 and 4 MiB at W=4 spent less too. The pumped ring between
# hosts keeps that floor (not measured with the tags).
TAGGED_CHUNK_MIN_BYTES = 1024 * 1024


def all_reduce(links: Links, flat: np.ndarray, uf, seq: int, fp: bytes) -> None:
    """flat (1-D) := its reduction over the ranks of `links`, in place."""
    size = links.size
    if size < 2:
        return
    nbytes = flat.nbytes
    if nbytes <= SMALL_MAX_BYTES:
        if size > DIRECT_MAX_RANKS:
            recursive_doubling(links, flat, uf, seq, fp)
        else:
            data = links.direct.exchange(seq, fp, arrays.as_bytes(flat))
            algos.reduce_in_rank_order(flat, links.rank, data, uf)
        return
    large = nbytes >= THREADED_MIN_BYTES
    # The ring's two peers: the next rank (we send to it) and the previous (we receive).
    threaded = large and not links.reaches_another_host(
        [(links.rank + 1) % size, (links.rank - 1) % size])
    if large:
        floor = TAGGED_CHUNK_MIN_BYTES if threaded else THREADED_CHUNK_MIN_BYTES
        chunk = min(THREADED_CHUNK_MAX_BYTES, max(
            floor, nbytes // (size * THREADED_CHUNKS_PER_SEGMENT)))
    else:
        chunk = PUMP_CHUNK_BYTES
    chunk_elems = max(1, chunk // flat.itemsize)
    plan = algos.ring_allreduce_plan(
        links.rank, size, links.rx, seq, fp, flat,
        links.scratch(chunk_elems * flat.itemsize), uf, chunk_elems,
    )
    if threaded:
        pump_threaded(plan, links.tx, links.rx, links.sender_thread())
    else:
        pump(plan, links.tx, links.rx)


def recursive_doubling(links: Links, flat: np.ndarray, uf, seq: int, fp: bytes) -> None:
    """Small all_reduce in ceil(log2 W) exchanges with one peer each, instead of the direct
    exchange's W-1 messages per rank (the tree of gloo's and MPI's small-message choice).

    For W not a power of two, the ranks beyond the largest power p first fold into rank r-p
    and get the result back at the end. Ranks are numbered host by host, so in a group that
    spans hosts the first log2(L) exchanges stay within each host and only the later ones
    cross: the tree is hierarchical by construction (bench/scale_model.py found it faster
    than a direct exchange within hosts, a leaders' tree and a fan-out). At each step both partners combine the same two
    partial results with the lower ranks' operand first, so every rank ends bitwise equal.
    """
    n, r = links.size, links.rank
    d = links.direct
    raw = arrays.as_bytes(flat)
    nb = flat.nbytes
    p = 1 << (n.bit_length() - 1)
    if r >= p:
        d.send_to(r - p, seq, fp, raw)
        raw[:] = d.recv_from(r - p, seq, fp, nb)
        return
    if r + p < n:
        extra = np.frombuffer(d.recv_from(r + p, seq, fp, nb), dtype=flat.dtype)
        algos.combine_pair(flat, extra, 0, uf)
    mask = 1
    while mask < p:
        q = r ^ mask
        d.send_to(q, seq, fp, raw)
        theirs = np.frombuffer(d.recv_from(q, seq, fp, nb), dtype=flat.dtype)
        algos.combine_pair(flat, theirs, 0 if r < q else 1, uf)
        mask <<= 1
    if r + p < n:
        d.send_to(r + p, seq, fp, raw)


def reduce_scatter(links: Links, seq: int, fp: bytes, out: np.ndarray,
                   ins: Sequence[np.ndarray], uf) -> None:
    """`out` := the reduction over ranks of every rank's `ins[rank]`."""
    size, me = links.size, links.rank
    flat_out = out.reshape(-1)
    if size == 1:
        np.copyto(flat_out, ins[0].reshape(-1))
    elif out.nbytes <= SMALL_MAX_BYTES:
        payload = {q: arrays.as_bytes(ins[q]) for q in links.direct.peers}
        data = links.direct.exchange(seq, fp, payload)
        np.copyto(flat_out, ins[me].reshape(-1))
        algos.reduce_in_rank_order(flat_out, me, data, uf)
    else:
        work = np.concatenate([x.reshape(-1) for x in ins])
        chunk_elems = max(1, PUMP_CHUNK_BYTES // work.itemsize)
        plan = algos.ring_allreduce_plan(
            me, size, links.rx, seq, fp, work, links.scratch(chunk_elems * work.itemsize), uf,
            chunk_elems, shift=-1, gather=False,
        )
        pump(plan, links.tx, links.rx)
        n = out.size
        np.copyto(flat_out, work[me * n:(me + 1) * n])


def broadcast(links: Links, seq: int, fp: bytes, raw: memoryview, src: int) -> None:
    """`raw` (bytes) := rank `src`'s."""
    if links.size == 1:
        return
    d = links.direct
    if len(raw) <= SMALL_MAX_BYTES:
        if links.rank == src:
            for q in d.peers:
                d.send_to(q, seq, fp, raw)
            for q in d.peers:
                d.recv_from(q, seq, fp, 0)
        else:
            raw[:] = d.recv_from(src, seq, fp, len(raw))
            d.send_to(src, seq, fp)
    else:
        plan = algos.chain_broadcast_plan(links.rank, links.size, links.rx, seq, fp, src, raw,
                                          PUMP_CHUNK_BYTES)
        pump(plan, links.tx, links.rx)


def all_gather(links: Links, seq: int, fp: bytes, segments: Sequence[memoryview]) -> None:
    """segments[q] (bytes) := rank q's segments[q], on every rank."""
    if links.size == 1:
        return
    mine = segments[links.rank]
    if len(mine) <= SMALL_MAX_BYTES and all(len(s) == len(mine) for s in segments):
        data = links.direct.exchange(seq, fp, mine)
        for q, view in data.items():
            segments[q][:] = view
    else:
        plan = algos.ring_allgather_plan(links.rank, links.size, links.rx, seq, fp, segments,
                                         PUMP_CHUNK_BYTES)
        pump(plan, links.tx, links.rx)


def rooted(links: Links, seq: int, fp: bytes, ack: bytes, root: int, own: np.ndarray,
           blocks: Optional[Sequence[np.ndarray]], inbound: bool) -> None:
    """Move one block between `root` and each other rank: towards the root (`inbound`, gather:
    rank q's `own` into the root's `blocks[q]`) or away from it (scatter: the root's `blocks[q]`
    into rank q's `own`). The receiver of each block acknowledges it, so the sender learns of a
    receiver that disagrees about the call before it moves on."""
    me = links.rank
    if links.size == 1:
        return
    if me == root:
        legs = {q: arrays.as_bytes(blocks[q]) for q in links.direct.peers}
    else:
        legs = {root: arrays.as_bytes(own)}
    fps = dict.fromkeys(legs, fp)
    if (me == root) == inbound:  # this rank receives
        plan = algos.star_plan(me, links.size, links.rx, seq, {}, fps, {}, legs, PUMP_CHUNK_BYTES,
                               acks=list(legs), ack_fp=ack)
    else:
        plan = algos.star_plan(me, links.size, links.rx, seq, fps, {}, legs, {}, PUMP_CHUNK_BYTES,
                               ack_from=list(legs), ack_fp=ack)
    pump(plan, links.tx, links.rx)


def all_to_all(links: Links, seq: int, fps_out: dict, fps_in: dict,
               outs: Sequence[np.ndarray], ins: Sequence[np.ndarray]) -> None:
    """`outs[q]` := rank q's `ins[rank]`, for every peer q (the caller copies its own block)."""
    peers = links.direct.peers
    plan = algos.star_plan(
        links.rank, links.size, links.rx, seq, fps_out, fps_in,
        {q: arrays.as_bytes(ins[q]) for q in peers},
        {q: arrays.as_bytes(outs[q]) for q in peers}, PUMP_CHUNK_BYTES,
    )
    pump(plan, links.tx, links.rx)
