"""The tcp backend's collectives on host (numpy) arrays, as functions of an explicit `Links`.

`ProcessGroupTCP` fingerprints each call, stages cupy arrays through host memory once around
submission, and runs one of these functions in its executor. Each picks an algorithm by size
(`algorithms` and `shm`) and runs it on the group's links. They raise the internal errors of
`algorithms`/`pump` (a header mismatch, a lost link) or `GroupFailed`; the group turns those into
the caller's errors and fails the group.
"""

from __future__ import annotations

import functools
import select
import time
from typing import Callable, Optional, Sequence

import numpy as np

from shoal.collectives import arrays
from shoal.collectives.backends.tcp import algorithms as algos
from shoal.collectives.backends.tcp import shm
from shoal.collectives.backends.tcp.mesh import FailureReason, Mesh
from shoal.collectives.backends.tcp.pump import LinkDown, SenderThread, pump, pump_threaded
from shoal.collectives.constants import (
    PUMP_CHUNK_BYTES,
    SHM_SLOT_BYTES,
    SHM_W2_MIN_CHUNK_BYTES,
    SMALL_MAX_BYTES,
    THREADED_CHUNK_MAX_BYTES,
    THREADED_CHUNK_MIN_BYTES,
    THREADED_CHUNKS_PER_SEGMENT,
    THREADED_MIN_BYTES,
)
from shoal.collectives.types import CollectiveMismatch, ReduceOp

__all__ = [
    "Links", "GroupFailed", "P2PMismatch", "allreduce_flat", "reduce", "broadcast",
    "all_gather", "reduce_scatter", "gather", "scatter", "all_to_all", "barrier",
    "monitored_barrier", "send", "recv",
]


class P2PMismatch(CollectiveMismatch):
    """A received point-to-point message does not fit the receiving array (the group survives)."""


class GroupFailed(Exception):
    """Raised inside an operation that found the group failed (internal).

    `reason` is the failure it decided on, or None when the group had failed already.
    """

    def __init__(self, reason: Optional[FailureReason] = None):
        super().__init__(reason.cause if reason is not None else "the group failed")
        self.reason = reason


class Links:
    """What a tcp collective runs on: this rank's place in the group, its connections to every
    peer (`mesh`, with `tx`/`rx` sockets and the small-message `direct` path), the shared-memory
    slots when every rank is on this host, and reusable scratch space and sender thread."""

    def __init__(self, rank: int, size: int, mesh: Mesh, direct: algos.Direct,
                 shared: Optional[shm.SharedSlots], name: str, failed: Callable[[], bool]):
        self.rank = rank
        self.size = size
        self.mesh = mesh
        self.tx = mesh.tx
        self.rx = mesh.rx
        self.direct = direct
        self.shm = shared
        self.failed = failed  # True once the group failed (a p2p receive stops waiting then)
        self._name = name
        self._scratch: Optional[bytearray] = None
        self._sender: Optional[SenderThread] = None

    def scratch(self, nbytes: int) -> memoryview:
        """A reusable buffer of `nbytes` (operations run one at a time)."""
        buf = self._scratch
        if buf is None or len(buf) < nbytes:
            buf = self._scratch = bytearray(nbytes)
        return memoryview(buf)[:nbytes]

    def sender_thread(self) -> SenderThread:
        """The sender thread of the largest ring all_reduces, started on first use."""
        if self._sender is None:
            self._sender = SenderThread(f"shoal-pg-{self._name}-sender")
        return self._sender

    def shm_barrier(self, seq: int, fp: bytes) -> Callable[[], object]:
        """A barrier for the shared-memory algorithms: an empty exchange of this op's header
        with every peer, so each step still checks the sequence number and fingerprint."""
        return functools.partial(self.direct.exchange, seq, fp, b"")

    def close(self) -> None:
        """Stop the sender thread and drop the shared memory (its mappings go with the last
        array that views them: a collective aborted in another thread may still be reading)."""
        if self._sender is not None:
            self._sender.stop()
        self.shm = None


def _shm_copy_chunk(nbytes: int) -> int:
    """Chunk size of shared-memory broadcast/all_gather: four steps or more, so that publishing
    one chunk overlaps the copies out of the previous one."""
    return min(SHM_SLOT_BYTES, max(SHM_W2_MIN_CHUNK_BYTES, nbytes // 4))


# ----------------------------------------------------------------------------- reductions

def allreduce_flat(links: Links, flat: np.ndarray, op: ReduceOp, seq: int, fp: bytes) -> None:
    """Reduce the 1-D `flat` across ranks in place: all_reduce itself, and the heart of reduce."""
    size = links.size
    if size > 1:
        nbytes = flat.nbytes
        uf = arrays.ufunc(op)
        if nbytes <= SMALL_MAX_BYTES:
            data = links.direct.exchange(seq, fp, arrays.as_bytes(flat))
            algos.reduce_in_rank_order(flat, links.rank, data, uf)
        elif links.shm is not None:
            if size == 2:
                chunk = min(SHM_SLOT_BYTES, max(SHM_W2_MIN_CHUNK_BYTES, nbytes // 4))
            else:
                chunk = SHM_SLOT_BYTES
            shm.all_reduce(flat, uf, links.shm, links.shm_barrier(seq, fp), chunk)
        else:
            threaded = nbytes >= THREADED_MIN_BYTES
            if threaded:
                chunk = min(THREADED_CHUNK_MAX_BYTES, max(
                    THREADED_CHUNK_MIN_BYTES, nbytes // (size * THREADED_CHUNKS_PER_SEGMENT)))
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
    if op is ReduceOp.AVG:
        arrays.finish_avg(flat, size)


def reduce(links: Links, seq: int, fp: bytes, arr: np.ndarray, dst: int, op: ReduceOp) -> None:
    """`arr` := its reduction over ranks, on rank `dst` only."""
    # Other ranks reduce a copy: torch leaves their tensors untouched.
    flat = arr.reshape(-1) if links.rank == dst else arr.reshape(-1).copy()
    allreduce_flat(links, flat, op, seq, fp)


def reduce_scatter(links: Links, seq: int, fp: bytes, out: np.ndarray,
                   ins: Sequence[np.ndarray], op: ReduceOp) -> None:
    """`out` := the reduction over ranks of every rank's `ins[rank]`."""
    size, me = links.size, links.rank
    uf = arrays.ufunc(op)
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
    if op is ReduceOp.AVG:
        arrays.finish_avg(flat_out, size)


# ----------------------------------------------------------------------------- data movement

def broadcast(links: Links, seq: int, fp: bytes, arr: np.ndarray, src: int) -> None:
    """`arr` := rank `src`'s `arr`."""
    if links.size == 1:
        return
    raw = arrays.as_bytes(arr)
    d = links.direct
    if links.shm is not None and len(raw) > SMALL_MAX_BYTES:
        shm.broadcast(np.frombuffer(raw, np.uint8), src, links.shm, links.shm_barrier(seq, fp),
                      _shm_copy_chunk(len(raw)))
    elif len(raw) <= SMALL_MAX_BYTES:
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


def all_gather(links: Links, seq: int, fp: bytes, arr: np.ndarray,
               outs: Sequence[np.ndarray]) -> None:
    """`outs[q]` := rank q's `arr`, on every rank."""
    mine = outs[links.rank]
    if not np.shares_memory(mine, arr):
        np.copyto(mine, arr)
    if links.size == 1:
        return
    if links.shm is not None and arr.nbytes > SMALL_MAX_BYTES:
        shm.all_gather(
            np.frombuffer(arrays.as_bytes(arr), np.uint8),
            [np.frombuffer(arrays.as_bytes(o), np.uint8) for o in outs], links.shm,
            links.shm_barrier(seq, fp), _shm_copy_chunk(arr.nbytes),
        )
    elif arr.nbytes <= SMALL_MAX_BYTES:
        data = links.direct.exchange(seq, fp, arrays.as_bytes(arr))
        for q, view in data.items():
            arrays.as_bytes(outs[q])[:] = view
    else:
        plan = algos.ring_allgather_plan(links.rank, links.size, links.rx, seq, fp,
                                         [arrays.as_bytes(o) for o in outs], PUMP_CHUNK_BYTES)
        pump(plan, links.tx, links.rx)


def gather(links: Links, seq: int, fp: bytes, ack: bytes, arr: np.ndarray,
           outs: Optional[Sequence[np.ndarray]], dst: int) -> None:
    """On rank `dst`, `outs[q]` := rank q's `arr`; the others send theirs and wait for an ack."""
    _rooted(links, seq, fp, ack, dst, arr, outs, inbound=True)
    if links.rank == dst:
        np.copyto(outs[dst], arr)


def scatter(links: Links, seq: int, fp: bytes, ack: bytes, out: np.ndarray,
            ins: Optional[Sequence[np.ndarray]], src: int) -> None:
    """`out` := rank `src`'s `ins[rank]`."""
    _rooted(links, seq, fp, ack, src, out, ins, inbound=False)
    if links.rank == src:
        np.copyto(out, ins[src])


def _rooted(links: Links, seq: int, fp: bytes, ack: bytes, root: int, own: np.ndarray,
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
    """`outs[q]` := rank q's `ins[rank]`."""
    me = links.rank
    if links.size > 1:
        peers = links.direct.peers
        plan = algos.star_plan(
            me, links.size, links.rx, seq, fps_out, fps_in,
            {q: arrays.as_bytes(ins[q]) for q in peers},
            {q: arrays.as_bytes(outs[q]) for q in peers}, PUMP_CHUNK_BYTES,
        )
        pump(plan, links.tx, links.rx)
    if outs[me].shape != ins[me].shape:
        raise GroupFailed(FailureReason(
            "mismatch",
            f"rank {me}'s all_to_all input_list[{me}] is {arrays.describe(ins[me])} but its "
            f"output_list[{me}] is {arrays.describe(outs[me])}",
            me, (me,),
        ))
    np.copyto(outs[me], ins[me])


# ----------------------------------------------------------------------------- barriers

def barrier(links: Links, seq: int, fp: bytes) -> None:
    """Return once every rank reached this barrier."""
    if links.size > 1:
        links.direct.exchange(seq, fp, b"")


def monitored_barrier(links: Links, seq: int, fp: bytes, timeout: float, wait_all: bool) -> None:
    """A barrier through rank 0, which names the ranks missing after `timeout`."""
    if links.size == 1:
        return
    d = links.direct
    if links.rank != 0:
        d.send_to(0, seq, fp)
        d.recv_from(0, seq, fp)
        return
    missing = _await_headers(links, seq, fp, timeout)
    if missing:
        shown = missing if wait_all else missing[:1]
        word = "rank" if len(shown) == 1 else "ranks"
        raise GroupFailed(FailureReason(
            "timeout",
            f"{word} {', '.join(map(str, shown))} did not reach monitored_barrier #{seq} within "
            f"{timeout:g}s",
            links.rank, shown,
        ))
    for q in d.peers:
        d.send_to(q, seq, fp)


def _await_headers(links: Links, seq: int, fp: bytes, timeout: float) -> list[int]:
    """Rank 0 of monitored_barrier: read each peer's header until the deadline; return the
    ranks still missing."""
    deadline = time.monotonic() + timeout
    d = links.direct
    waiting = {links.rx[q]: q for q in d.peers}
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select(list(waiting), [], [], left)
        for sock in ready:
            q = waiting.pop(sock)
            d.recv_from(q, seq, fp)
    return sorted(waiting.values())


# ----------------------------------------------------------------------------- point to point

def send(links: Links, fp: bytes, arr: np.ndarray, dst: int, tag: int) -> None:
    """Send `arr` to rank `dst` on the control channel."""
    try:
        links.mesh.send_p2p(dst, tag, fp, arrays.as_bytes(arr))
    except OSError as exc:
        raise LinkDown(dst, exc) from exc


def recv(links: Links, expected: bytes, arr: np.ndarray, src: Optional[int], tag: int) -> int:
    """Receive into `arr` from rank `src` (None: any); returns the sender's rank.

    Raises:
        P2PMismatch: the message does not fit `arr` (dropped; the group survives).
        GroupFailed: the group failed while waiting.
    """
    got = links.mesh.take_p2p(src, tag, links.failed)
    if got is None:
        raise GroupFailed()
    q, fp, payload = got
    if fp != expected or len(payload) != arr.nbytes:
        raise P2PMismatch(
            f"Rank {links.rank} posted recv of {expected.decode()} with tag {tag} but rank "
            f"{q} sent {fp.decode(errors='replace')}; the message was dropped."
        )
    arrays.as_bytes(arr)[:] = payload
    return q
