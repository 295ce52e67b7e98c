"""The `tcp` backend: gloo-like collectives over persistent, authenticated TCP connections.

The group owns a `Mesh` (sockets and control service), an `Engine` (ordering, records, Work),
a `Watchdog`, and the algorithms of `_pg_algos`. Every failure (a mismatched header, a lost
peer, a timeout) fails the whole group once: the first reason is sent to every peer, the
connections are broken so blocked calls return, and every pending and later collective on
every rank raises an error naming the same culprit.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Optional

import numpy as np

from collectives import _pg_algos as algos
from collectives import _pg_arrays as arrays
from collectives import env, metrics
from collectives._pg_engine import Engine, OpRecord
from collectives._pg_mesh import FailureReason, Mesh
from collectives._pg_pump import LinkDown, SenderThread, pump, pump_threaded
from collectives.api import (
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    GroupDestroyed,
    ProcessGroup,
    ReduceOp,
    Store,
    Work,
)
from collectives.constants import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_GROUP_NAME,
    LINK_REASON_GRACE_S,
    PUMP_CHUNK_BYTES,
    SMALL_MAX_BYTES,
    SPIN_S,
    THREADED_CHUNK_BYTES,
    THREADED_MIN_BYTES,
)
from collectives.watchdog import Watchdog, exit_after_error, write_dump
from core.auth import load_token
from core.timeouts import TimeoutLike

logger = logging.getLogger(__name__)

__all__ = ["ProcessGroupTCP"]

# Groups still open in this process: closed with a goodbye at interpreter exit, so that a script
# that ends without destroy_process_group does not look like a crash to its peers.
_LIVE: "weakref.WeakSet[ProcessGroupTCP]" = weakref.WeakSet()
try:
    _CPUS = len(os.sched_getaffinity(0))
except (AttributeError, OSError):
    _CPUS = os.cpu_count() or 1


class _P2PMismatch(CollectiveMismatch):
    """A received point-to-point message does not fit the receiving array (the group survives)."""


class ProcessGroupTCP(ProcessGroup):
    """A process group over TCP; ranks meet through `store` (see `_pg_mesh` for the protocol).

    Args:
        store: where ranks publish their addresses and progress (shared by all ranks).
        rank: this process's rank in the group.
        size: the number of ranks.
        timeout: default timeout of every collective (and of forming the group).
        name: the group's name, unique per concurrently existing group.
        host: the address to listen on (default: from `collectives.env.bind_host`).
        token: the job's secret (default: `core.auth.load_token()`).
        global_ranks: the world ranks of this group's members, for messages and dumps.

    Raises:
        CollectiveTimeout: a peer did not join within `timeout`.
        CollectiveError: a peer could not be reached or failed the handshake.
    """

    backend_name = "tcp"

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        timeout: TimeoutLike = DEFAULT_COLLECTIVE_TIMEOUT_S,
        name: str = DEFAULT_GROUP_NAME,
        host: Optional[str] = None,
        token: Optional[bytes | str] = None,
        global_ranks: Optional[list[int]] = None,
    ):
        super().__init__(rank, size, name, timeout)
        if not isinstance(store, Store):
            raise TypeError(f"ProcessGroupTCP needs a collectives.Store, got {type(store).__name__}.")
        self._store = store
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(size))
        if len(self.global_ranks) != size:
            raise ValueError(f"global_ranks has {len(self.global_ranks)} entries for a group of {size}.")
        self.global_rank = self.global_ranks[rank]
        self._failure: Optional[FailureReason] = None
        self._timeout_local: Optional[tuple[OpRecord, str]] = None
        self._fail_lock = threading.Lock()
        self._destroyed = False
        self._engine = Engine(name, self._run, self._describe)
        self._mesh = Mesh(
            store=store, rank=rank, size=size, name=name, host=host or env.bind_host(None),
            token=load_token(token), on_failure=self._fail,
        )
        try:
            self._mesh.connect(self._timeout)
        except BaseException:
            self._mesh.close()
            raise
        self._tx = self._mesh.tx
        self._rx = self._mesh.rx
        self._direct = algos.Direct(rank, size, self._tx, self._rx, env.spin_seconds(size, SPIN_S))
        self._adapt_to_load()
        self._scratch_buf: Optional[bytearray] = None
        self._sender: Optional[SenderThread] = None
        self._fp_cache: dict = {}
        self._watchdog = Watchdog(self).start()
        _LIVE.add(self)

    # ------------------------------------------------------------------ introspection

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) this rank's backend listens on."""
        return self._mesh.address

    @property
    def failure(self) -> Optional[str]:
        """Why the group failed (a sentence), or None while it is healthy."""
        return None if self._failure is None else self._failure.cause

    def __repr__(self) -> str:
        return f"ProcessGroupTCP(name={self.name!r}, rank={self._rank}, size={self._size})"

    def _adapt_to_load(self) -> None:
        """Poll small receives only while the machine has a spare CPU (called every second)."""
        d = self._direct
        if d.spin_s:
            try:
                # Our own ranks count towards the load; other work beyond that means no spare CPU.
                busy = os.getloadavg()[0] > 1.5 * _CPUS
            except OSError:
                busy = False
            d.spin_allowed = not busy

    def _describe(self, rec: OpRecord) -> str:
        return f"Rank {self._rank}'s {rec.label} of group '{self.name}'"

    # ------------------------------------------------------------------ failure handling

    def _fail(self, reason: FailureReason) -> bool:
        """Record the group's first failure, tell every peer, break the links. True if first."""
        with self._fail_lock:
            if self._failure is not None:
                return False
            self._failure = reason
        logger.warning("Rank %d: group %r failed: %s", self._rank, self.name, reason.cause)
        if reason.kind == "timeout" and reason.origin != self._rank and reason.dump_path is None:
            # Leave a trace on every rank, not only on the one whose watchdog fired.
            reason.dump_path = write_dump(self, f"Group '{self.name}' failed: {reason.cause}.",
                                          self._engine.current)
        self._mesh.abort(reason)
        return True

    def _fail_timeout(self, cause: str, message: str, culprits, path, rec: OpRecord) -> None:
        """Called by the watchdog for an overdue operation."""
        self._timeout_local = (rec, message)
        self._fail(FailureReason("timeout", cause, self._rank, culprits, path))
        if env.async_error_handling():
            metrics.count_error(rec.op, "timeout")
            exit_after_error(message)

    def _error_for(self, rec: OpRecord) -> CollectiveError:
        reason = self._failure
        local = self._timeout_local
        if local is not None and local[0] is rec:
            return CollectiveTimeout(local[1])
        message = f"Rank {self._rank} failed {rec.label} of group '{self.name}': {reason.cause}."
        if reason.dump_path:
            message += f" Recent collectives of this rank are in {reason.dump_path}."
        return reason.error_class(message)

    def _link_reason(self, exc: LinkDown) -> FailureReason:
        peer = exc.peer
        end = time.monotonic() + LINK_REASON_GRACE_S
        while True:
            if self._failure is not None:
                return self._failure
            if self._mesh.departed[peer]:
                return FailureReason(
                    "peer_lost",
                    f"rank {peer} left the group (it destroyed its process group) while this rank "
                    "still expected data from it",
                    self._rank, (peer,),
                )
            if time.monotonic() >= end:
                break
            time.sleep(0.01)
        what = f"failed ({exc.exc})" if exc.exc is not None else "closed"
        return FailureReason(
            "peer_lost", f"rank {peer}'s data connection {what}; the process died or was killed",
            self._rank, (peer,),
        )

    def _raise_failed(self, rec: OpRecord, cause: Optional[BaseException] = None):
        err = self._error_for(rec)
        metrics.count_error(rec.op, self._failure.kind)
        if env.async_error_handling():
            if self._failure is not None and self._failure.dump_path is None:
                self._failure.dump_path = write_dump(self, str(err), rec)
            exit_after_error(str(err))
        if cause is not None:
            raise err from cause
        raise err

    def _run(self, rec: OpRecord) -> list:
        if self._failure is not None:
            self._raise_failed(rec)
        t0 = time.perf_counter()
        try:
            result = rec.fn(rec)
        except _P2PMismatch:
            raise
        except LinkDown as exc:
            self._fail(self._link_reason(exc))
            self._raise_failed(rec, exc)
        except algos.HeaderMismatch as exc:
            self._fail(FailureReason(
                "mismatch",
                f"rank {self._rank} called {exc.ours} as collective #{rec.seq} but rank "
                f"{exc.peer} called {exc.their_fp} as #{exc.their_seq}; every rank must call the "
                "same collectives in the same order with the same shapes and dtypes",
                self._rank, (self._rank, exc.peer),
            ))
            self._raise_failed(rec, exc)
        except algos.ProtocolError as exc:
            self._fail(FailureReason(
                "error", f"rank {exc.peer} sent {exc.detail} (the connection is out of step)",
                self._rank, (exc.peer,),
            ))
            self._raise_failed(rec, exc)
        except _GroupFailed as exc:
            self._fail(exc.reason)
            self._raise_failed(rec, None)
        except Exception as exc:
            if self._failure is None:
                self._fail(FailureReason(
                    "error", f"rank {self._rank} hit {type(exc).__name__} in {rec.label}: {exc}",
                    self._rank, (self._rank,),
                ))
            self._raise_failed(rec, exc)
        metrics.observe(rec.op, "tcp", time.perf_counter() - t0, rec.nbytes)
        return result

    # ------------------------------------------------------------------ helpers

    def _fingerprint(self, key, build) -> tuple[bytes, str]:
        pair = self._fp_cache.get(key)
        if pair is None:
            desc = build()
            pair = (desc.encode(), desc)
            if len(self._fp_cache) > 4096:
                self._fp_cache.clear()
            self._fp_cache[key] = pair
        return pair

    def _scratch(self, nbytes: int) -> memoryview:
        buf = self._scratch_buf
        if buf is None or len(buf) < nbytes:
            buf = self._scratch_buf = bytearray(nbytes)
        return memoryview(buf)[:nbytes]

    def _sender_thread(self) -> SenderThread:
        if self._sender is None:
            self._sender = SenderThread(f"shoal-pg-{self.name}-sender")
        return self._sender

    def _submit(self, op: str, fp_desc: tuple[bytes, str], fn, nbytes: int, timeout: float,
                async_op: bool, p2p: bool = False) -> Work:
        if self._destroyed:
            raise GroupDestroyed(f"{op} was called on process group '{self.name}' after it was destroyed.")
        return self._engine.submit(op, fp_desc[1], fn, nbytes, timeout, async_op, p2p)

    # ------------------------------------------------------------------ all_reduce and friends

    def _allreduce_flat(self, flat: np.ndarray, op: ReduceOp, seq: int, fp: bytes) -> None:
        size = self._size
        if size > 1:
            nbytes = flat.nbytes
            uf = arrays.ufunc(op)
            if nbytes <= SMALL_MAX_BYTES:
                data = self._direct.exchange(seq, fp, arrays.as_bytes(flat))
                if size == 2:
                    # Two operands: IEEE add/mul/min/max commute, so both ranks agree bitwise.
                    (other,) = data.values()
                    uf(flat, np.frombuffer(other, dtype=flat.dtype), out=flat)
                else:
                    algos.reduce_in_rank_order(flat, self._rank, data, uf)
            else:
                threaded = nbytes >= THREADED_MIN_BYTES
                chunk = THREADED_CHUNK_BYTES if threaded else PUMP_CHUNK_BYTES
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

        def fn(rec):
            host, writeback = _host(arr)  # cupy arrays are staged when the op runs
            self._allreduce_flat(host.reshape(-1), op, rec.seq, fpd[0])
            if writeback is not None:
                writeback()
            return [tensor]

        return self._submit("all_reduce", fpd, fn, arr.nbytes, timeout, async_op)

    def _reduce(self, tensor, arr, dst, op, async_op, timeout):
        key = ("reduce", arr.dtype, arr.shape, op, dst)
        fpd = self._fingerprint(key, lambda: f"reduce({arrays.describe(arr)}, dst={dst}, op={op.name})")

        def fn(rec):
            host, writeback = _host(arr)
            # Non-destination ranks reduce a copy: torch leaves their tensors untouched.
            flat = host.reshape(-1) if self._rank == dst else host.reshape(-1).copy()
            self._allreduce_flat(flat, op, rec.seq, fpd[0])
            if writeback is not None and self._rank == dst:
                writeback()
            return [tensor]

        return self._submit("reduce", fpd, fn, arr.nbytes, timeout, async_op)

    def _broadcast(self, tensor, arr, src, async_op, timeout):
        key = ("broadcast", arr.dtype, arr.shape, src)
        fpd = self._fingerprint(key, lambda: f"broadcast({arrays.describe(arr)}, src={src})")

        def fn(rec):
            host, writeback = _host(arr)
            raw = arrays.as_bytes(host)
            fp = fpd[0]
            seq = rec.seq
            if self._size > 1:
                d = self._direct
                if len(raw) <= SMALL_MAX_BYTES:
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
            if writeback is not None and self._rank != src:
                writeback()
            return [tensor]

        return self._submit("broadcast", fpd, fn, arr.nbytes, timeout, async_op)

    def _all_gather(self, outputs, outs, arr, async_op, timeout):
        key = ("all_gather", arr.dtype, arr.shape)
        fpd = self._fingerprint(key, lambda: f"all_gather({arrays.describe(arr)})")
        _no_cupy([arr, *outs], "all_gather")

        def fn(rec):
            mine = outs[self._rank]
            if not np.shares_memory(mine, arr):
                np.copyto(mine, arr)
            if self._size > 1:
                if arr.nbytes <= SMALL_MAX_BYTES:
                    data = self._direct.exchange(rec.seq, fpd[0], arrays.as_bytes(arr))
                    for q, view in data.items():
                        arrays.as_bytes(outs[q])[:] = view
                else:
                    plan = algos.ring_allgather_plan(
                        self._rank, self._size, self._rx, rec.seq, fpd[0],
                        [arrays.as_bytes(o) for o in outs], PUMP_CHUNK_BYTES,
                    )
                    pump(plan, self._tx, self._rx)
            return outputs

        return self._submit("all_gather", fpd, fn, arr.nbytes, timeout, async_op)

    def _reduce_scatter(self, output, out, ins, op, async_op, timeout):
        key = ("reduce_scatter", out.dtype, out.shape, op)
        fpd = self._fingerprint(
            key, lambda: f"reduce_scatter({arrays.describe(out)} x {self._size}, op={op.name})"
        )
        _no_cupy([out, *ins], "reduce_scatter")

        def fn(rec):
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
        _no_cupy([arr, *(outs or [])], "gather")
        ack = f"gather-ack(dst={dst})".encode()

        def fn(rec):
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
            return list(outputs) if outputs else []

        return self._submit("gather", fpd, fn, arr.nbytes, timeout, async_op)

    def _scatter(self, tensor, out, ins, src, async_op, timeout):
        key = ("scatter", out.dtype, out.shape, src)
        fpd = self._fingerprint(key, lambda: f"scatter({arrays.describe(out)}, src={src})")
        _no_cupy([out, *(ins or [])], "scatter")
        ack = f"scatter-ack(src={src})".encode()

        def fn(rec):
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
            return [tensor]

        return self._submit("scatter", fpd, fn, out.nbytes, timeout, async_op)

    def _all_to_all(self, outputs, outs, ins, async_op, timeout):
        key = ("all_to_all", tuple((o.dtype, o.shape) for o in outs), tuple((x.dtype, x.shape) for x in ins))
        _no_cupy([*outs, *ins], "all_to_all")
        peers = [q for q in range(self._size) if q != self._rank]
        fps_out = {q: f"all_to_all({arrays.describe(ins[q])})".encode() for q in peers}
        fps_in = {q: f"all_to_all({arrays.describe(outs[q])})".encode() for q in peers}
        fpd = self._fingerprint(
            key, lambda: "all_to_all(in " + ", ".join(arrays.describe(x) for x in ins)
            + "; out " + ", ".join(arrays.describe(o) for o in outs) + ")"
        )

        def fn(rec):
            if self._size > 1:
                plan = algos.star_plan(
                    self._rank, self._size, self._rx, rec.seq, fps_out, fps_in,
                    {q: arrays.as_bytes(ins[q]) for q in peers},
                    {q: arrays.as_bytes(outs[q]) for q in peers}, PUMP_CHUNK_BYTES,
                )
                pump(plan, self._tx, self._rx)
            if outs[self._rank].shape != ins[self._rank].shape:
                raise _GroupFailed(FailureReason(
                    "mismatch",
                    f"rank {self._rank}'s all_to_all input_list[{self._rank}] is "
                    f"{arrays.describe(ins[self._rank])} but its output_list[{self._rank}] is "
                    f"{arrays.describe(outs[self._rank])}",
                    self._rank, (self._rank,),
                ))
            np.copyto(outs[self._rank], ins[self._rank])
            return list(outputs)

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
                raise _GroupFailed(FailureReason(
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
        _no_cupy([arr], "send")
        desc = f"p2p({arrays.describe(arr)})"
        fp = desc.encode()

        def fn(rec):
            try:
                self._mesh.send_p2p(dst, tag, fp, arrays.as_bytes(arr))
            except OSError as exc:
                raise LinkDown(dst, exc) from exc
            return [arr]

        return self._submit("send", (fp, f"send({arrays.describe(arr)}, dst={dst}, tag={tag})"),
                            fn, arr.nbytes, timeout, async_op, p2p=True)

    def _recv(self, tensor, arr, src, tag, async_op, timeout):
        _no_cupy([arr], "recv")
        expected = f"p2p({arrays.describe(arr)})".encode()
        work_box: list = []

        def fn(rec):
            got = self._mesh.take_p2p(src, tag, lambda: self._failure is not None)
            if got is None:
                self._raise_failed(rec)
            q, fp, payload = got
            if fp != expected or len(payload) != arr.nbytes:
                raise _P2PMismatch(
                    f"Rank {self._rank} posted recv of {expected.decode()} with tag {tag} but rank "
                    f"{q} sent {fp.decode(errors='replace')}; the message was dropped."
                )
            arrays.as_bytes(arr)[:] = payload
            rec.source = q
            return [tensor]

        where = "any rank" if src is None else f"src={src}"
        return self._submit("recv", (expected, f"recv({arrays.describe(arr)}, {where}, tag={tag})"),
                            fn, arr.nbytes, timeout, async_op, p2p=True)

    # ------------------------------------------------------------------ lifecycle

    def abort(self) -> None:
        self._fail(FailureReason(
            "error", f"rank {self._rank} aborted the group (ProcessGroup.abort())", self._rank, (self._rank,)
        ))

    def shutdown(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        _LIVE.discard(self)
        self._watchdog.stop()
        self._engine.stop(GroupDestroyed(
            f"Process group '{self.name}' was destroyed before this queued collective ran."
        ))
        if self._sender is not None:
            self._sender.stop()
        self._mesh.close()


class _GroupFailed(Exception):
    """Raised inside an operation that decided the group has failed (internal)."""

    def __init__(self, reason: FailureReason):
        super().__init__(reason.cause)
        self.reason = reason


def _await_headers(pg: ProcessGroupTCP, d: algos.Direct, seq: int, fp: bytes, timeout: float) -> list[int]:
    """Rank 0 of monitored_barrier: read each peer's header until the deadline; return the missing."""
    import select

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


def _host(arr):
    """(numpy array to work on, write-back callable or None): cupy arrays are staged on the host."""
    if isinstance(arr, np.ndarray):
        return arr, None
    host = arr.get()

    def writeback():
        arr.set(host)

    return host, writeback


def _no_cupy(arrs, op: str) -> None:
    for a in arrs:
        if not isinstance(a, np.ndarray):
            raise TypeError(
                f"The tcp backend's {op} takes host (numpy) arrays; got {type(a).__module__}."
                f"{type(a).__name__}. Copy to the host first or use the nccl backend."
            )


def _close_all_at_exit() -> None:
    for pg in list(_LIVE):
        try:
            pg.shutdown()
        except Exception:  # exiting anyway
            pass


import atexit  # noqa: E402  (registered once, when the backend is first imported)

atexit.register(_close_all_at_exit)
