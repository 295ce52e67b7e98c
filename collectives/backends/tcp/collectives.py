"""The tcp backend's collectives on host (numpy) arrays, as functions of an explicit `Links`.

`ProcessGroupTCP` fingerprints each call, stages cupy arrays through host memory once around
submission, and runs one of these functions in its executor. Each picks a path by where the
ranks are and by size, the same choice on every rank (it depends only on the topology and on
shapes every rank shares):

- every rank on this host (`links.shm`): shared memory above the small-message size
  (`shm` for all_reduce, broadcast and all_gather, `shm_streams` for the rest);
- ranks on several hosts with several ranks on some host (`links.hier`): the two-level
  algorithms of `hierarchical` above the small-message size;
- otherwise, and for small messages, the sockets alone (`over_sockets`).

They raise the internal errors of `algorithms`/`pump` (a header mismatch, a lost link) or
`GroupFailed`; the group turns those into the caller's errors and fails the group.
"""

from __future__ import annotations

import select
import struct
import time
from typing import Optional, Sequence

import numpy as np

from shoal.collectives import arrays
from shoal.collectives.backends.tcp import (hierarchical, over_sockets, shm, shm_p2p, shm_streams,
                                           vm_p2p)
from shoal.collectives.backends.tcp.links import GroupFailed, Links, P2PMismatch
from shoal.collectives.backends.tcp.algorithms import ProtocolError
from shoal.collectives.backends.tcp.pump import LinkDown
from shoal.collectives.backends.tcp.reasons import FailureReason
from shoal.collectives.constants import SHM_SLOT_BYTES, SHM_W2_MIN_CHUNK_BYTES, SMALL_MAX_BYTES
from shoal.collectives.types import ReduceOp

__all__ = [
    "Links", "GroupFailed", "P2PMismatch", "allreduce_flat", "reduce", "broadcast",
    "all_gather", "reduce_scatter", "gather", "scatter", "all_to_all", "barrier",
    "monitored_barrier", "send", "recv",
]


def _u8(arr: np.ndarray) -> np.ndarray:
    return np.frombuffer(arrays.as_bytes(arr), np.uint8)


def _uniform_hier(links: Links) -> Optional[hierarchical.Plan]:
    """The two-level plan when the hosts have equal rank counts (what all_gather and
    reduce_scatter need to split their blocks among the rings), else None."""
    plan = links.hier
    return plan if plan is not None and plan.topology.uniform else None


# ----------------------------------------------------------------------------- reductions

def allreduce_flat(links: Links, flat: np.ndarray, op: ReduceOp, seq: int, fp: bytes) -> None:
    """Reduce the 1-D `flat` across ranks in place: all_reduce itself, and the heart of reduce."""
    size = links.size
    if size > 1:
        nbytes = flat.nbytes
        uf = arrays.ufunc(op)
        if nbytes > SMALL_MAX_BYTES and links.shm is not None:
            if size == 2:
                chunk = shm_streams.step_bytes(nbytes)
            else:
                chunk = SHM_SLOT_BYTES
            shm.all_reduce(flat, uf, links.shm, links.shm_barrier(seq, fp), chunk)
        elif nbytes > SMALL_MAX_BYTES and links.hier is not None:
            hierarchical.all_reduce(links.hier, flat, uf, seq, fp,
                                    avg_over=size if op is ReduceOp.AVG else None)
            return
        else:
            over_sockets.all_reduce(links, flat, uf, seq, fp)
    if op is ReduceOp.AVG:
        arrays.finish_avg(flat, size)


def reduce(links: Links, seq: int, fp: bytes, arr: np.ndarray, dst: int, op: ReduceOp) -> None:
    """`arr` := its reduction over ranks, on rank `dst` only."""
    size, me = links.size, links.rank
    if links.shm is not None and arr.nbytes > SMALL_MAX_BYTES:
        # One host: rank q reduces segment q in its own copy, and only dst copies the
        # results out; the others' arrays stay untouched, as torch leaves them.
        flat = arr.reshape(-1) if me == dst else arr.reshape(-1).copy()
        b = [(flat.size * i) // size for i in range(size + 1)]
        uf = arrays.ufunc(op)
        barrier = links.shm_barrier(seq, fp)
        shm_streams.reduce_scatter(
            links.shm, barrier, uf, flat.dtype, [b[j + 1] - b[j] for j in range(size)],
            {j: [flat[b[j]:b[j + 1]]] for j in range(size) if j != me}, [flat[b[me]:b[me + 1]]])
        segment = flat[b[me]:b[me + 1]]
        if op is ReduceOp.AVG:
            arrays.finish_avg(segment, size)
        wants = ({j: [(0, _u8(flat[b[j]:b[j + 1]]))] for j in range(size) if j != me}
                 if me == dst else {})
        shm_streams.relay(links.shm, barrier, [(b[j + 1] - b[j]) * flat.itemsize for j in range(size)],
                          [_u8(segment)], wants, shm_streams.step_bytes(flat.nbytes // size))
        return
    # Other ranks reduce a copy: torch leaves their tensors untouched.
    flat = arr.reshape(-1) if me == dst else arr.reshape(-1).copy()
    allreduce_flat(links, flat, op, seq, fp)


def reduce_scatter(links: Links, seq: int, fp: bytes, out: np.ndarray,
                   ins: Sequence[np.ndarray], op: ReduceOp) -> None:
    """`out` := the reduction over ranks of every rank's `ins[rank]`."""
    size, me = links.size, links.rank
    uf = arrays.ufunc(op)
    flat_out = out.reshape(-1)
    large = size > 1 and out.nbytes > SMALL_MAX_BYTES
    plan = _uniform_hier(links)
    if large and links.shm is not None:
        np.copyto(flat_out, ins[me].reshape(-1))
        shm_streams.reduce_scatter(
            links.shm, links.shm_barrier(seq, fp), uf, out.dtype, [out.size] * size,
            {j: [ins[j].reshape(-1)] for j in range(size) if j != me}, [flat_out])
    elif large and plan is not None:
        hierarchical.reduce_scatter(plan, seq, fp, flat_out, ins, uf)
    else:
        over_sockets.reduce_scatter(links, seq, fp, out, ins, uf)
    if op is ReduceOp.AVG:
        arrays.finish_avg(flat_out, size)


# ----------------------------------------------------------------------------- data movement

def broadcast(links: Links, seq: int, fp: bytes, arr: np.ndarray, src: int) -> None:
    """`arr` := rank `src`'s `arr`."""
    if links.size == 1:
        return
    raw = arrays.as_bytes(arr)
    if len(raw) > SMALL_MAX_BYTES and links.shm is not None:
        u8 = np.frombuffer(raw, np.uint8)
        mine = links.rank == src
        shm_streams.relay(links.shm, links.shm_barrier(seq, fp),
                          [u8.size if q == src else 0 for q in range(links.size)],
                          [u8] if mine else None, {} if mine else {src: [(0, u8)]},
                          shm_streams.step_bytes(u8.size))
    elif len(raw) > SMALL_MAX_BYTES and links.hier is not None:
        hierarchical.broadcast(links.hier, seq, fp, np.frombuffer(raw, np.uint8), src)
    else:
        over_sockets.broadcast(links, seq, fp, raw, src)


def all_gather(links: Links, seq: int, fp: bytes, arr: np.ndarray,
               outs: Sequence[np.ndarray]) -> None:
    """`outs[q]` := rank q's `arr`, on every rank."""
    mine = outs[links.rank]
    if not np.shares_memory(mine, arr):
        np.copyto(mine, arr)
    if links.size == 1:
        return
    plan = _uniform_hier(links)
    if links.shm is not None and arr.nbytes > SMALL_MAX_BYTES:
        me = links.rank
        shm_streams.relay(links.shm, links.shm_barrier(seq, fp), [arr.nbytes] * links.size,
                          [_u8(arr)], {q: [(0, _u8(outs[q]))] for q in range(links.size) if q != me},
                          _gather_step_bytes(arr.nbytes))
    elif plan is not None and arr.nbytes > SMALL_MAX_BYTES:
        hierarchical.all_gather(plan, seq, fp, [_u8(o) for o in outs])
    else:
        over_sockets.all_gather(links, seq, fp, [arrays.as_bytes(o) for o in outs])


def _gather_step_bytes(nbytes: int) -> int:
    """all_gather's bytes per shared-memory step: the whole block in one step up to two of
    the smallest steps, where a second step's barrier costs more than its overlap saves (W=2
    on 2 cores, median of 130 calls: 512 KiB 0.075 against 0.088 ms, and 15% less CPU in
    fully_shard's gathers; at 1 MiB four steps still win, 0.153 against 0.189 ms)."""
    if nbytes <= 2 * SHM_W2_MIN_CHUNK_BYTES:
        return SHM_SLOT_BYTES
    return shm_streams.step_bytes(nbytes)


def gather(links: Links, seq: int, fp: bytes, ack: bytes, arr: np.ndarray,
           outs: Optional[Sequence[np.ndarray]], dst: int) -> None:
    """On rank `dst`, `outs[q]` := rank q's `arr`; the others send theirs and wait for an ack."""
    me, size = links.rank, links.size
    if links.shm is not None and arr.nbytes > SMALL_MAX_BYTES:
        # Every rank but dst publishes its block; dst copies them out.
        lengths = [0 if q == dst else arr.nbytes for q in range(size)]
        wants = {q: [(0, _u8(outs[q]))] for q in range(size) if q != dst} if me == dst else {}
        shm_streams.relay(links.shm, links.shm_barrier(seq, fp), lengths,
                          None if me == dst else [_u8(arr)], wants, shm_streams.step_bytes(arr.nbytes))
    else:
        over_sockets.rooted(links, seq, fp, ack, dst, arr, outs, inbound=True)
    if me == dst:
        np.copyto(outs[dst], arr)


def scatter(links: Links, seq: int, fp: bytes, ack: bytes, out: np.ndarray,
            ins: Optional[Sequence[np.ndarray]], src: int) -> None:
    """`out` := rank `src`'s `ins[rank]`."""
    me, size = links.rank, links.size
    if links.shm is not None and out.nbytes > SMALL_MAX_BYTES:
        # src publishes every other rank's block in rank order; rank q copies its own out.
        others = [q for q in range(size) if q != src]
        lengths = [out.nbytes * len(others) if q == src else 0 for q in range(size)]
        wants = {} if me == src else {src: [(others.index(me) * out.nbytes, _u8(out))]}
        shm_streams.relay(links.shm, links.shm_barrier(seq, fp), lengths,
                          [_u8(ins[q]) for q in others] if me == src else None, wants,
                          shm_streams.step_bytes(out.nbytes))
    else:
        over_sockets.rooted(links, seq, fp, ack, src, out, ins, inbound=False)
    if me == src:
        np.copyto(out, ins[src])


_SIZES = struct.Struct("<Q")


def all_to_all(links: Links, seq: int, fps_out: dict, fps_in: dict,
               outs: Sequence[np.ndarray], ins: Sequence[np.ndarray]) -> None:
    """`outs[q]` := rank q's `ins[rank]`."""
    me, size = links.rank, links.size
    if size > 1 and links.shm is not None:
        _all_to_all_shared(links, seq, fps_out, fps_in, outs, ins)
    elif size > 1:
        over_sockets.all_to_all(links, seq, fps_out, fps_in, outs, ins)
    if outs[me].shape != ins[me].shape:
        raise GroupFailed(FailureReason(
            "mismatch",
            f"rank {me}'s all_to_all input_list[{me}] is {arrays.describe(ins[me])} but its "
            f"output_list[{me}] is {arrays.describe(outs[me])}",
            me, (me,),
        ))
    np.copyto(outs[me], ins[me])


_A2A_FP = b"all_to_all(sizes)"


def _all_to_all_shared(links: Links, seq: int, fps_out: dict, fps_in: dict, outs, ins) -> None:
    """all_to_all on one host. The ranks swap how many bytes each sends to and expects from
    every other (the blocks' sizes differ from rank to rank, and every rank must run the same
    relay steps) and check that every pair agrees; with its table each rank sends every peer
    its block when that is at most the small-message size, so small blocks take one round
    trip. Then, only when some block anywhere is larger, each rank publishes its large
    blocks in rank order in shared memory and copies its incoming ones out of their senders'
    regions."""
    me, size = links.rank, links.size
    table = np.zeros((2, size), dtype="<u8")
    table[0] = [0 if q == me else ins[q].nbytes for q in range(size)]
    table[1] = [0 if q == me else outs[q].nbytes for q in range(size)]
    raw_table = table.tobytes()
    tl = len(raw_table)
    d = links.direct
    for q in d.peers:
        small = ins[q].nbytes <= SMALL_MAX_BYTES
        d.send_to(q, seq, _A2A_FP, raw_table + arrays.as_bytes(ins[q]) if small else raw_table)
    tables = {me: table}
    for q in d.peers:
        inline = outs[q].nbytes if outs[q].nbytes <= SMALL_MAX_BYTES else 0
        try:
            got = d.recv_from(q, seq, _A2A_FP, tl + inline)
        except ProtocolError as exc:
            # Checked, but not the length we expect: rank q's block for us has another size.
            raise GroupFailed(FailureReason(
                "mismatch",
                f"rank {q}'s all_to_all input_list[{me}] does not have the {outs[q].nbytes} "
                f"bytes of rank {me}'s output_list[{q}]; every block must match the "
                "receiver's output block", me, tuple(sorted((q, me))),
            )) from exc
        tables[q] = np.frombuffer(got[:tl], dtype="<u8").reshape(2, size).copy()
        if inline:
            _u8(outs[q])[:] = np.frombuffer(got[tl:], np.uint8)
    _check_all_to_all_tables(tables, size, me)
    big = [[int(n) if n > SMALL_MAX_BYTES else 0 for n in tables[p][0]] for p in range(size)]
    lengths = [sum(row) for row in big]
    if not any(lengths):
        return
    wants = {p: [(sum(big[p][:me]), _u8(outs[p]))] for p in range(size) if p != me and big[p][me]}
    publish = [_u8(ins[q]) for q in range(size) if q != me and big[me][q]]
    # Whole slots per step: each step costs a barrier with every rank, and with the ranks
    # already busy on every core, finer steps overlap nothing (4 MiB at W=2 on 2 cores, the
    # fastest tenth of 200 calls: 1.2-2.1 ms against 1.8-4.4 ms at the quarter-size steps).
    shm_streams.relay(links.shm, links.shm_barrier(seq, b"all_to_all"), lengths, publish, wants,
                      SHM_SLOT_BYTES)


def _check_all_to_all_tables(tables: dict, size: int, me: int) -> None:
    """Raise GroupFailed unless every rank's block for every other has the size that one
    expects (every rank checks every pair, so all fail alike)."""
    for p in range(size):
        for q in range(size):
            if p != q and tables[p][0][q] != tables[q][1][p]:
                lo, hi = sorted((p, q))
                raise GroupFailed(FailureReason(
                    "mismatch",
                    f"rank {p}'s all_to_all input_list[{q}] has {int(tables[p][0][q])} bytes but "
                    f"rank {q}'s output_list[{p}] has {int(tables[q][1][p])}; every block must "
                    "match the receiver's output block",
                    me, (lo, hi),
                ))


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

# How long a receive without a deadline reads its source's connection before it checks that
# the group still stands (as `ControlChannel.take_p2p` polls its stop test).
_READING_SLICE_S = 0.25


def send(links: Links, fp: bytes, arr: np.ndarray, dst: int, tag: int,
         mail: Optional[shm_p2p.ShmMail] = None, writer: Optional[vm_p2p.Writer] = None,
         wait: bool = False) -> None:
    """Send `arr` to rank `dst`: with a `writer`, from `vm_p2p.MIN_BYTES` up, straight into
    the array `dst` offered for it (`wait`: give the offer a moment to come); above the
    small-message size through the ring for `dst` in shared memory when `mail` is given and
    it fits (a descriptor on the control channel); else whole on the control channel."""
    raw = arrays.as_bytes(arr)
    try:
        if writer is not None and len(raw) >= vm_p2p.MIN_BYTES and writer.enabled(dst):
            control = links.control
            number = control.sent[(dst, tag)]
            got = vm_p2p.take_offer(control, dst, tag, number, time.monotonic() + (
                vm_p2p.wait_for(len(raw)) if wait else 0.0))
            if got is not None and writer.write(dst, fp, raw, *got):
                control.send_p2p(dst, tag, vm_p2p.MARK + fp, vm_p2p.NOTE.pack(number))
                return
        if mail is not None and len(raw) > SMALL_MAX_BYTES:
            descriptor = mail.post(dst, np.frombuffer(raw, np.uint8))
            if descriptor is not None:
                links.control.send_p2p(dst, tag, shm_p2p.MARK + fp, descriptor)
                return
        links.control.send_p2p(dst, tag, fp, raw)
    except OSError as exc:
        raise LinkDown(dst, exc) from exc


def recv(links: Links, expected: bytes, arr: np.ndarray, src: Optional[int], tag: int,
         mail: Optional[shm_p2p.ShmMail] = None, until: Optional[float] = None,
         offered: Optional[tuple[vm_p2p.Offers, int]] = None) -> Optional[int]:
    """Receive into `arr` from rank `src` (None: any); returns the sender's rank, or None when
    no message came by the `time.monotonic()` deadline `until` (None: wait for it).
    `offered`: (offers, number) when `arr` was offered to `src` for message `number`.

    Raises:
        P2PMismatch: the message does not fit `arr` (dropped; the group survives).
        GroupFailed: the group failed while waiting, or a peer sent a bad descriptor.
    """
    if src is None:
        got = links.control.take_p2p(src, tag, links.failed, until=until)
    elif until is not None:
        got = links.control.take_p2p_reading(src, tag, links.failed, until, links.p2p_spin)
    else:
        # No deadline: read the source's connection in this thread (one wake-up when the
        # message comes, not the service thread's and then this one's), a slice at a time so
        # a failed group ends the wait as `take_p2p`'s polling does.
        while True:
            got = links.control.take_p2p_reading(src, tag, links.failed,
                                                 time.monotonic() + _READING_SLICE_S,
                                                 links.p2p_spin)
            if got is not None or links.failed():
                break
    if got is None:
        if until is not None and not links.failed():
            return None
        raise GroupFailed()
    q, fp, payload = got
    if offered is not None:
        offered[0].release(q, tag, offered[1])
    if fp[:1] == vm_p2p.MARK:
        if (offered is None or fp[1:] != expected or len(payload) != vm_p2p.NOTE.size
                or vm_p2p.NOTE.unpack(payload)[0] != offered[1]):
            raise GroupFailed(FailureReason(
                "error", f"rank {q} told rank {links.rank} it wrote a message into an array "
                         "that was not offered for it", links.rank, (q,)))
        return q  # written in place already
    shared = fp[:1] == shm_p2p.MARK
    if shared:
        fp = fp[1:]
        if mail is None:
            raise GroupFailed(FailureReason(
                "error", f"rank {q} sent a shared-memory message to rank {links.rank}, which "
                         "shares no memory with it", links.rank, (q,)))
    nbytes = mail.length(payload) if shared else len(payload)
    fits = fp == expected and nbytes == arr.nbytes
    if shared:
        try:
            mail.take(q, payload, np.frombuffer(arrays.as_bytes(arr), np.uint8) if fits else None)
        except shm_p2p.BadDescriptor as exc:
            raise GroupFailed(FailureReason(
                "error", f"rank {q} sent {exc} to rank {links.rank}", links.rank, (q,))) from exc
    if not fits:
        raise P2PMismatch(
            f"Rank {links.rank} posted recv of {expected.decode()} with tag {tag} but rank "
            f"{q} sent {fp.decode(errors='replace')}; the message was dropped."
        )
    if not shared:
        arrays.as_bytes(arr)[:] = payload
    return q
