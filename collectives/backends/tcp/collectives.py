"""The collectives of the tcp backend: each hook fingerprints the call, then submits a closure
that runs one of `_pg_algos`' algorithms on the group's links.

`TCPCollectives` is mixed into `ProcessGroupTCP`, which supplies the links (`_tx`, `_rx`,
`_direct`, `_mesh`), scratch space, the sender thread, `_submit` and failure handling.
"""

from __future__ import annotations

import functools
import select
import time

import numpy as np

from shoal.collectives.backends.tcp import algorithms as algos
from shoal.collectives import arrays
from shoal.collectives.backends.tcp import shm
from shoal.collectives.backends.tcp import staging
from shoal.collectives.backends.tcp.mesh import FailureReason
from shoal.collectives.backends.tcp.pump import LinkDown, pump, pump_threaded
from shoal.collectives.types import CollectiveMismatch, ReduceOp
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


def _shm_copy_chunk(nbytes: int) -> int:
    """Chunk size of shared-memory broadcast/all_gather: four steps or more, so that publishing
    one chunk overlaps the copies out of the previous one."""
    return min(SHM_SLOT_BYTES, max(SHM_W2_MIN_CHUNK_BYTES, nbytes // 4))


class P2PMismatch(CollectiveMismatch):
    """A received point-to-point message does not fit the receiving array (the group survives)."""



class GroupFailed(Exception):
    """Raised inside an operation that decided the group has failed (internal)."""

    def __init__(self, reason: FailureReason):
        super().__init__(reason.cause)
        self.reason = reason


class TCPCollectives:
    """The collective hooks of `ProcessGroupTCP` (see the module docstring)."""

    def _shm_barrier(self, seq: int, fp: bytes):
        """A barrier for the shared-memory algorithms: an empty exchange of this op's header
        with every peer, so each step still checks the sequence number and fingerprint."""
        return functools.partial(self._direct.exchange, seq, fp, b"")

    # ------------------------------------------------------------------ all_reduce and friends

    def _allreduce_flat(self, flat: np.ndarray, op: ReduceOp, seq: int, fp: bytes) -> None:
        size = self._size
        if size > 1:
            nbytes = flat.nbytes
            uf = arrays.ufunc(op)
            if nbytes <= SMALL_MAX_BYTES:
                data = self._direct.exchange(seq, fp, arrays.as_bytes(flat))
                algos.reduce_in_rank_order(flat, self._rank, data, uf)
            elif self._shm is not None:
                if size == 2:
                    chunk = min(SHM_SLOT_BYTES, max(SHM_W2_MIN_CHUNK_BYTES, nbytes // 4))
                else:
                    chunk = SHM_SLOT_BYTES
                shm.all_reduce(flat, uf, self._shm, self._shm_barrier(seq, fp), chunk)
            else:
                threaded = nbytes >= THREADED_MIN_BYTES
                if threaded:
                    chunk = min(THREADED_CHUNK_MAX_BYTES, max(
                        THREADED_CHUNK_MIN_BYTES, nbytes // (size * THREADED_CHUNKS_PER_SEGMENT)))
                else:
                    chunk = PUMP_CHUNK_BYTES
                chunk_elems = max(1, chunk // flat.itemsize)
                plan = algos.ring_allreduce_plan(
                    self._rank, size, self._rx, seq, fp, flat,
                    self._scratch(chunk_elems * flat.itemsize), uf, chunk_elems,
                )
                if threaded:
                    pump_threaded(plan, self._tx, self._rx, self._sender_thread())
                else:
                    pump(plan, self._tx, self._rx)
        if op is ReduceOp.AVG:
            arrays.finish_avg(flat, size)

    def _all_reduce(self, tensor, arr, op, async_op, timeout):
        key = ("all_reduce", arr.dtype, arr.shape, op)
        fpd = self._fingerprint(key, lambda: f"all_reduce({arrays.describe(arr)}, op={op.name})")

        st = staging.for_arrays([arr])  # None for numpy: cupy arrays go through pinned memory

        def fn(rec):
            host = arr if st is None else st.host(0)
            self._allreduce_flat(host.reshape(-1), op, rec.seq, fpd[0])
            if st is not None:
                st.write_back(0)
            return [tensor]

        return self._submit("all_reduce", fpd, fn, arr.nbytes, timeout, async_op)

    def _reduce(self, tensor, arr, dst, op, async_op, timeout):
        key = ("reduce", arr.dtype, arr.shape, op, dst)
        fpd = self._fingerprint(key, lambda: f"reduce({arrays.describe(arr)}, dst={dst}, op={op.name})")

        st = staging.for_arrays([arr])

        def fn(rec):
            host = arr if st is None else st.host(0)
            # Non-destination ranks reduce a copy: torch leaves their tensors untouched.
            flat = host.reshape(-1) if self._rank == dst else host.reshape(-1).copy()
            self._allreduce_flat(flat, op, rec.seq, fpd[0])
            if st is not None and self._rank == dst:
                st.write_back(0)
            return [tensor]

        return self._submit("reduce", fpd, fn, arr.nbytes, timeout, async_op)

    def _broadcast(self, tensor, arr, src, async_op, timeout):
        key = ("broadcast", arr.dtype, arr.shape, src)
        fpd = self._fingerprint(key, lambda: f"broadcast({arrays.describe(arr)}, src={src})")

        st = staging.for_arrays([arr])

        def fn(rec):
            host = arr if st is None else st.host(0, copy_in=self._rank == src)
            raw = arrays.as_bytes(host)
            fp = fpd[0]
            seq = rec.seq
            if self._size > 1:
                d = self._direct
                if self._shm is not None and len(raw) > SMALL_MAX_BYTES:
                    shm.broadcast(np.frombuffer(raw, np.uint8), src, self._shm,
                                  self._shm_barrier(seq, fp), _shm_copy_chunk(len(raw)))
                elif len(raw) <= SMALL_MAX_BYTES:
                    if self._rank == src:
                        for q in d.peers:
                            d.send_to(q, seq, fp, raw)
                        for q in d.peers:
                            d.recv_from(q, seq, fp, 0)
                    else:
                        raw[:] = d.recv_from(src, seq, fp, len(raw))
                        d.send_to(src, seq, fp)
                else:
                    plan = algos.chain_broadcast_plan(
                        self._rank, self._size, self._rx, seq, fp, src, raw, PUMP_CHUNK_BYTES
                    )
                    pump(plan, self._tx, self._rx)
            if st is not None and self._rank != src:
                st.write_back(0)
            return [tensor]

        return self._submit("broadcast", fpd, fn, arr.nbytes, timeout, async_op)

    def _all_gather(self, outputs, outs, arr, async_op, timeout):
        key = ("all_gather", arr.dtype, arr.shape)
        fpd = self._fingerprint(key, lambda: f"all_gather({arrays.describe(arr)})")
        st = staging.for_arrays([arr, *outs])

        def fn(rec):
            if st is None:
                _all_gather_host(rec, arr, outs)
            else:
                _all_gather_host(rec, st.host(0),
                                 [st.host(1 + q, copy_in=False) for q in range(self._size)])
                st.write_back(*range(1, 1 + self._size))
            return outputs

        def _all_gather_host(rec, arr, outs):
            mine = outs[self._rank]
            if not np.shares_memory(mine, arr):
                np.copyto(mine, arr)
            if self._size > 1:
                if self._shm is not None and arr.nbytes > SMALL_MAX_BYTES:
                    shm.all_gather(
                        np.frombuffer(arrays.as_bytes(arr), np.uint8),
                        [np.frombuffer(arrays.as_bytes(o), np.uint8) for o in outs], self._shm,
                        self._shm_barrier(rec.seq, fpd[0]), _shm_copy_chunk(arr.nbytes),
                    )
                elif arr.nbytes <= SMALL_MAX_BYTES:
                    data = self._direct.exchange(rec.seq, fpd[0], arrays.as_bytes(arr))
                    for q, view in data.items():
                        arrays.as_bytes(outs[q])[:] = view
                else:
                    plan = algos.ring_allgather_plan(
                        self._rank, self._size, self._rx, rec.seq, fpd[0],
                        [arrays.as_bytes(o) for o in outs], PUMP_CHUNK_BYTES,
                    )
                    pump(plan, self._tx, self._rx)

        return self._submit("all_gather", fpd, fn, arr.nbytes, timeout, async_op)

    def _reduce_scatter(self, output, out, ins, op, async_op, timeout):
        key = ("reduce_scatter", out.dtype, out.shape, op)
        fpd = self._fingerprint(
            key, lambda: f"reduce_scatter({arrays.describe(out)} x {self._size}, op={op.name})"
        )
        st = staging.for_arrays([out, *ins])

        def fn(rec):
            if st is None:
                return _reduce_scatter_host(rec, out, ins)
            result = _reduce_scatter_host(
                rec, st.host(0, copy_in=False), [st.host(1 + q) for q in range(self._size)]
            )
            st.write_back(0)
            return result

        def _reduce_scatter_host(rec, out, ins):
            size, me = self._size, self._rank
            uf = arrays.ufunc(op)
            flat_out = out.reshape(-1)
            if size == 1:
                np.copyto(flat_out, ins[0].reshape(-1))
            elif out.nbytes <= SMALL_MAX_BYTES:
                payload = {q: arrays.as_bytes(ins[q]) for q in self._direct.peers}
                data = self._direct.exchange(rec.seq, fpd[0], payload)
                np.copyto(flat_out, ins[me].reshape(-1))
                algos.reduce_in_rank_order(flat_out, me, data, uf)
            else:
                work = np.concatenate([x.reshape(-1) for x in ins])
                chunk_elems = max(1, PUMP_CHUNK_BYTES // work.itemsize)
                plan = algos.ring_allreduce_plan(
                    me, size, self._rx, rec.seq, fpd[0], work,
                    self._scratch(chunk_elems * work.itemsize), uf, chunk_elems,
                    shift=-1, gather=False,
                )
                pump(plan, self._tx, self._rx)
                n = out.size
                np.copyto(flat_out, work[me * n:(me + 1) * n])
            if op is ReduceOp.AVG:
                arrays.finish_avg(flat_out, size)
            return [output]

        return self._submit("reduce_scatter", fpd, fn, out.nbytes * self._size, timeout, async_op)

    # ------------------------------------------------------------------ rooted and pairwise

    def _gather(self, outputs, outs, arr, dst, async_op, timeout):
        key = ("gather", arr.dtype, arr.shape, dst)
        fpd = self._fingerprint(key, lambda: f"gather({arrays.describe(arr)}, dst={dst})")
        st = staging.for_arrays([arr, *(outs or [])])
        ack = f"gather-ack(dst={dst})".encode()

        def fn(rec):
            if st is None:
                _gather_host(rec, arr, outs)
            else:
                outs_h = None if outs is None else [
                    st.host(1 + q, copy_in=False) for q in range(self._size)
                ]
                _gather_host(rec, st.host(0), outs_h)
                if outs is not None:
                    st.write_back(*range(1, 1 + self._size))
            return list(outputs) if outputs else []

        def _gather_host(rec, arr, outs):
            if self._size > 1:
                fp = fpd[0]
                peers = self._direct.peers
                if self._rank == dst:
                    plan = algos.star_plan(
                        self._rank, self._size, self._rx, rec.seq, {}, dict.fromkeys(peers, fp),
                        {}, {q: arrays.as_bytes(outs[q]) for q in peers}, PUMP_CHUNK_BYTES,
                        acks=peers, ack_fp=ack,
                    )
                else:
                    plan = algos.star_plan(
                        self._rank, self._size, self._rx, rec.seq, {dst: fp}, {},
                        {dst: arrays.as_bytes(arr)}, {}, PUMP_CHUNK_BYTES,
                        ack_from=[dst], ack_fp=ack,
                    )
                pump(plan, self._tx, self._rx)
            if self._rank == dst:
                np.copyto(outs[dst], arr)

        return self._submit("gather", fpd, fn, arr.nbytes, timeout, async_op)

    def _scatter(self, tensor, out, ins, src, async_op, timeout):
        key = ("scatter", out.dtype, out.shape, src)
        fpd = self._fingerprint(key, lambda: f"scatter({arrays.describe(out)}, src={src})")
        st = staging.for_arrays([out, *(ins or [])])
        ack = f"scatter-ack(src={src})".encode()

        def fn(rec):
            if st is None:
                _scatter_host(rec, out, ins)
            else:
                ins_h = None if ins is None else [st.host(1 + q) for q in range(self._size)]
                _scatter_host(rec, st.host(0, copy_in=False), ins_h)
                st.write_back(0)
            return [tensor]

        def _scatter_host(rec, out, ins):
            if self._size > 1:
                fp = fpd[0]
                peers = self._direct.peers
                if self._rank == src:
                    plan = algos.star_plan(
                        self._rank, self._size, self._rx, rec.seq, dict.fromkeys(peers, fp), {},
                        {q: arrays.as_bytes(ins[q]) for q in peers}, {}, PUMP_CHUNK_BYTES,
                        ack_from=peers, ack_fp=ack,
                    )
                else:
                    plan = algos.star_plan(
                        self._rank, self._size, self._rx, rec.seq, {}, {src: fp},
                        {}, {src: arrays.as_bytes(out)}, PUMP_CHUNK_BYTES,
                        acks=[src], ack_fp=ack,
                    )
                pump(plan, self._tx, self._rx)
            if self._rank == src:
                np.copyto(out, ins[src])

        return self._submit("scatter", fpd, fn, out.nbytes, timeout, async_op)

    def _all_to_all(self, outputs, outs, ins, async_op, timeout):
        key = ("all_to_all", tuple((o.dtype, o.shape) for o in outs), tuple((x.dtype, x.shape) for x in ins))
        st = staging.for_arrays([*outs, *ins])
        peers = [q for q in range(self._size) if q != self._rank]
        fps_out = {q: f"all_to_all({arrays.describe(ins[q])})".encode() for q in peers}
        fps_in = {q: f"all_to_all({arrays.describe(outs[q])})".encode() for q in peers}
        fpd = self._fingerprint(
            key, lambda: "all_to_all(in " + ", ".join(arrays.describe(x) for x in ins)
            + "; out " + ", ".join(arrays.describe(o) for o in outs) + ")"
        )

        def fn(rec):
            if st is None:
                _all_to_all_host(rec, outs, ins)
            else:
                w = self._size
                _all_to_all_host(rec, [st.host(q, copy_in=False) for q in range(w)],
                                 [st.host(w + q) for q in range(w)])
                st.write_back(*range(w))
            return list(outputs)

        def _all_to_all_host(rec, outs, ins):
            if self._size > 1:
                plan = algos.star_plan(
                    self._rank, self._size, self._rx, rec.seq, fps_out, fps_in,
                    {q: arrays.as_bytes(ins[q]) for q in peers},
                    {q: arrays.as_bytes(outs[q]) for q in peers}, PUMP_CHUNK_BYTES,
                )
                pump(plan, self._tx, self._rx)
            if outs[self._rank].shape != ins[self._rank].shape:
                raise GroupFailed(FailureReason(
                    "mismatch",
                    f"rank {self._rank}'s all_to_all input_list[{self._rank}] is "
                    f"{arrays.describe(ins[self._rank])} but its output_list[{self._rank}] is "
                    f"{arrays.describe(outs[self._rank])}",
                    self._rank, (self._rank,),
                ))
            np.copyto(outs[self._rank], ins[self._rank])

        nbytes = sum(x.nbytes for x in ins)
        return self._submit("all_to_all", fpd, fn, nbytes, timeout, async_op)

    def _barrier(self, async_op, timeout):
        fpd = (b"barrier()", "barrier()")

        def fn(rec):
            if self._size > 1:
                self._direct.exchange(rec.seq, fpd[0], b"")
            return []

        return self._submit("barrier", fpd, fn, 0, timeout, async_op)

    def _monitored_barrier(self, timeout, wait_all_ranks):
        fpd = (b"monitored_barrier()", "monitored_barrier()")

        def fn(rec):
            if self._size == 1:
                return []
            d = self._direct
            if self._rank != 0:
                d.send_to(0, rec.seq, fpd[0])
                d.recv_from(0, rec.seq, fpd[0])
                return []
            missing = _await_headers(self, d, rec.seq, fpd[0], timeout)
            if missing:
                shown = missing if wait_all_ranks else missing[:1]
                word = "rank" if len(shown) == 1 else "ranks"
                raise GroupFailed(FailureReason(
                    "timeout",
                    f"{word} {', '.join(map(str, shown))} did not reach monitored_barrier "
                    f"#{rec.seq} within {timeout:g}s",
                    self._rank, shown,
                ))
            for q in d.peers:
                d.send_to(q, rec.seq, fpd[0])
            return []

        # The watchdog gives rank 0 time to name the missing ranks itself.
        self._submit("monitored_barrier", fpd, fn, 0, timeout + 5.0, False)

    # ------------------------------------------------------------------ point to point

    def _send(self, arr, dst, tag, async_op, timeout):
        st = staging.for_arrays([arr])
        desc = f"p2p({arrays.describe(arr)})"
        fp = desc.encode()

        def fn(rec):
            host = arr if st is None else st.host(0)
            try:
                self._mesh.send_p2p(dst, tag, fp, arrays.as_bytes(host))
            except OSError as exc:
                raise LinkDown(dst, exc) from exc
            return [arr]

        return self._submit("send", (fp, f"send({arrays.describe(arr)}, dst={dst}, tag={tag})"),
                            fn, arr.nbytes, timeout, async_op, p2p=True)

    def _recv(self, tensor, arr, src, tag, async_op, timeout):
        st = staging.for_arrays([arr])
        expected = f"p2p({arrays.describe(arr)})".encode()
        work_box: list = []

        def fn(rec):
            got = self._mesh.take_p2p(src, tag, lambda: self._failure is not None)
            if got is None:
                self._raise_failed(rec)
            q, fp, payload = got
            if fp != expected or len(payload) != arr.nbytes:
                raise P2PMismatch(
                    f"Rank {self._rank} posted recv of {expected.decode()} with tag {tag} but rank "
                    f"{q} sent {fp.decode(errors='replace')}; the message was dropped."
                )
            if st is None:
                arrays.as_bytes(arr)[:] = payload
            else:
                arrays.as_bytes(st.host(0, copy_in=False))[:] = payload
                st.write_back(0)
            rec.source = q
            return [tensor]

        where = "any rank" if src is None else f"src={src}"
        return self._submit("recv", (expected, f"recv({arrays.describe(arr)}, {where}, tag={tag})"),
                            fn, arr.nbytes, timeout, async_op, p2p=True)


def _await_headers(pg, d: algos.Direct, seq: int, fp: bytes, timeout: float) -> list[int]:
    """Rank 0 of monitored_barrier: read each peer's header until the deadline; return the missing."""
    deadline = time.monotonic() + timeout
    waiting = {pg._rx[q]: q for q in d.peers}
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select(list(waiting), [], [], left)
        for sock in ready:
            q = waiting.pop(sock)
            d.recv_from(q, seq, fp)
    return sorted(waiting.values())
