"""The `tcp` backend: gloo-like collectives over persistent, authenticated TCP connections.

The group owns a `Mesh` (sockets and control channel), the `Links` its collectives run on
(`collectives`), an `InOrderExecutor` (ordering and Work handles), a `GroupFailure` (how it
fails) and, through `BackendGroup`, the shared op ledger and watchdog. Each collective hook
fingerprints the call, declares which arrays it reads and writes (cupy arrays are staged
through host memory once around the job, `staging.HostStage.around`), and submits a job that
runs one function of `collectives`.

Every failure (a mismatched header, a lost peer, a timeout) fails the whole group once
(`failure`): the first reason is sent to every peer, the connections are broken so blocked
calls return, and every pending and later collective on every rank raises an error naming the
same culprit.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable, Optional

from shoal.collectives import env
from shoal.collectives.api import Work
from shoal.collectives.arrays import describe
from shoal.collectives.arrays import unwrap as arrays_unwrap
from shoal.collectives.backends.api import Verdict
from shoal.collectives.backends.base import BackendGroup
from shoal.collectives.backends.ledger import OpRecord
from shoal.collectives.backends.tcp import algorithms as algos
from shoal.collectives.backends.tcp import collectives as ops
from shoal.collectives.backends.tcp import negotiation, shm_p2p, staging, vm_p2p
from shoal.collectives.backends.tcp import topology as topo
from shoal.collectives.backends.tcp.executor import Handoff, InOrderExecutor, Job, PartWork
from shoal.collectives.backends.tcp.failure import GroupFailure
from shoal.collectives.backends.tcp.links import Links, P2PMismatch
from shoal.collectives.backends.tcp.mesh import Mesh
from shoal.collectives.backends.tcp.spin import SpinPolicy
from shoal.collectives.constants import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_GROUP_NAME,
    SMALL_MAX_BYTES,
    SPIN_S,
)
from shoal.collectives.store.api import Store
from shoal.collectives.types import CollectiveError, GroupDestroyed
from shoal.core.auth import load_token
from shoal.core.timeouts import TimeoutLike

logger = logging.getLogger(__name__)

__all__ = ["ProcessGroupTCP"]

_FIRST = (0,)
_NONE = ()
# How long an eager batch_isend_irecv waits in the caller's thread for its receives before the
# worker thread takes them over: a few of a small exchange's round trips on a busy machine, and
# short enough that a caller overlapping compute with its receives hardly notices it.
_INLINE_RECV_GRACE_S = 1e-3
# The largest isend run in the caller's thread within a host: copying it into the ring takes
# about as long as the worker thread's wake-up it saves (50-100 us).
EAGER_SEND_MAX_BYTES = 1 << 20


def _remember(cache: dict, key, value):
    """Cache `value` (what a call of this shape needs built once) under `key`; returns it."""
    if len(cache) > 4096:  # the shapes are the user's: bound what they can pile up
        cache.clear()
    cache[key] = value
    return value


def _check_peer(rank: int, size: int, is_send: bool, peer) -> None:
    """Raise unless a batch peer is another rank of the group."""
    what = "send" if is_send else "recv"
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < size:
        raise ValueError(f"batch_isend_irecv {what} peer must be a rank in "
                         f"0..{size - 1} of this group, got {peer!r}.")
    if peer == rank:
        raise ValueError(f"Rank {rank} cannot {what} to itself.")


def _p2p_names(cache: dict, op: str, arr, peer: Optional[int], tag: int) -> tuple[bytes, str]:
    """(fingerprint, description) of a send or recv of `arr`, kept in a group's `cache` by
    its shape; the fingerprint names only the array, which both ends must agree on."""
    key = (op, arr.dtype, arr.shape, peer, tag)
    pair = cache.get(key)
    if pair is None:
        side = "dst" if op == "send" else "src"
        where = "any rank" if peer is None else f"{side}={peer}"
        pair = _remember(cache, key, (f"p2p({describe(arr)})".encode(),
                                      f"{op}({describe(arr)}, {where}, tag={tag})"))
    return pair


def _batch_plan(shape: tuple, arrs: list) -> tuple:
    """(send indices, receive indices, peers, tags, fingerprints, description, bytes, whether
    a receive is large enough to offer its array, `vm_p2p`) of a batch of `shape`
    ((is_send, dtype, shape, peer, tag) per operation) on `arrs`."""
    described = [describe(a) for a in arrs]
    recvs = tuple(i for i, e in enumerate(shape) if not e[0])
    return (tuple(i for i, e in enumerate(shape) if e[0]), recvs,
            [e[3] for e in shape], [e[4] for e in shape],
            [f"p2p({d})".encode() for d in described],
            "batch_isend_irecv(" + ", ".join(
                f"{'send' if s else 'recv'}({d}, {'dst' if s else 'src'}={p}, tag={t})"
                for (s, _dt, _sh, p, t), d in zip(shape, described)) + ")",
            sum(a.nbytes for a in arrs),
            any(arrs[i].nbytes >= vm_p2p.MIN_BYTES for i in recvs))


class ProcessGroupTCP(BackendGroup):
    """A process group over TCP; ranks meet through `store` (see `mesh` for the protocol).

    Args:
        store, rank, size, timeout, name, global_ranks: as for `BackendGroup`.
        host: the address to listen on and advertise (default: `collectives.env.bind_host` of
            the store's host or MASTER_ADDR: the local address that routes there).
        token: the job's secret (default: `core.auth.load_token()`).

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
        super().__init__(store, rank, size, timeout, name, global_ranks)
        self._fp_cache: dict = {}
        self._failures = failures = GroupFailure(self, rank, name)
        self._executor = InOrderExecutor(name, self._ledger, failures.run, self._describe)
        self._mesh = failures.mesh = Mesh(
            store=store, rank=rank, size=size, name=name,
            host=host or env.bind_host_for(store),
            token=load_token(token), on_failure=failures.on_mesh_failure,
        )
        try:
            self._mesh.connect(self._timeout)
            self._topology = topo.from_identities(
                self._mesh.host_identities(min(self._timeout, 60.0)), env.hierarchical_leaders())
            shared = (negotiation.shared_memory(self._mesh, name, self._timeout)
                      if self._topology.single_host else None)
            direct = algos.Direct(rank, size, self._mesh.tx, self._mesh.rx, SpinPolicy.for_group(
                size, SPIN_S))
            self._links = Links(rank, size, self._mesh, direct, shared, name, failures.failed)
            # Large point-to-point payloads go through the rings of shared memory too.
            self._mail = shm_p2p.ShmMail(shared) if shared is not None else None
            # ...and the largest straight into the receiving array where the kernel allows.
            usable = shared is not None and env.p2p_direct() and vm_p2p.here().usable
            self._writer = vm_p2p.Writer() if usable else None
            self._offers = vm_p2p.Offers() if usable else None
            if self._topology.hierarchical:
                self._topology, self._links.hier = negotiation.hierarchy(
                    self._topology, self._links, name, self._timeout)
        except BaseException as exc:
            self._mesh.close()
            reason = failures.reason
            if isinstance(exc, CollectiveError) and reason is not None and reason.cause not in str(exc):
                # The setup broke because the group had failed (a peer aborted, or a frame
                # failed its integrity check): say why.
                raise type(exc)(f"{exc} (the group had failed: {reason.cause})") from exc
            raise
        self._start_watchdog()

    # ------------------------------------------------------------------ introspection

    @property
    def topology(self) -> topo.Topology:
        """Which ranks of this group share a host (`topology.hosts`), from the store."""
        return self._topology

    @property
    def hierarchical(self) -> bool:
        """True when large collectives run in two levels (the group spans hosts)."""
        return self._links.hier is not None

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) this rank's backend listens on."""
        return self._mesh.address

    @property
    def transports(self) -> list[str]:
        """How this rank reaches each rank: "self", "unix" or "tcp"."""
        return list(self._mesh.transports)

    @property
    def uses_shared_memory(self) -> bool:
        """True when large collectives go through shared memory: every rank on this host, or
        within each host in the two-level algorithms."""
        hier = self._links.hier
        return self._links.shm is not None or (hier is not None and hier.local is not None)

    @property
    def store_prefix(self) -> str:
        """The prefix of this incarnation of the group's keys in the store."""
        return self._mesh.prefix

    @property
    def failed(self) -> bool:
        """True once the group has failed."""
        return self._failures.reason is not None

    @property
    def failure(self) -> Optional[str]:
        """Why the group failed (a sentence), or None while it is healthy."""
        reason = self._failures.reason
        return None if reason is None else reason.cause

    def __repr__(self) -> str:
        return f"ProcessGroupTCP(name={self.name!r}, rank={self._rank}, size={self._size})"

    def fail_from_watchdog(self, verdict: Verdict) -> None:
        """Called by the watchdog for an overdue operation."""
        self._failures.fail_from_watchdog(verdict)

    def _describe(self, rec: OpRecord) -> str:
        return f"Rank {self._rank}'s {rec.label} of group '{self.name}'"

    # ------------------------------------------------------------------ submitting one operation

    def _fingerprint(self, key, build: Callable[[], str]) -> tuple[bytes, str]:
        """(header fingerprint, description) of a call, cached by its shape."""
        pair = self._fp_cache.get(key)
        if pair is None:
            desc = build()
            pair = _remember(self._fp_cache, key, (desc.encode(), desc))
        return pair

    def _submit(self, op: str, desc: str, job: Job, arrays: tuple, nbytes: int, timeout: float,
                async_op: bool, copy_in=None, copy_out=_NONE, p2p: bool = False,
                eager: bool = False) -> Work:
        """Run `job(record, arrays)` in order; of cupy `arrays`, those in `copy_in` (None: all)
        are copied to the host before it and those in `copy_out` back to the device after it."""
        if self._destroyed:
            raise GroupDestroyed(
                f"{op} was called on process group '{self.name}' after it was destroyed."
            )
        # cupy arrays: staged through host memory once around the job (recorded on the caller's
        # stream here, in the caller's thread); numpy arrays go as they are.
        stage = staging.for_arrays(arrays)
        if stage is not None:
            # Not eager: a job handed off half-way would be copied back before it finished.
            job, eager = stage.around(job, copy_in, copy_out), False
        return self._executor.submit(op, desc, nbytes, timeout, async_op, p2p, job, arrays,
                                     eager)

    # ------------------------------------------------------------------ collectives

    def _all_reduce(self, tensor, arr, op, async_op, timeout):
        fp, desc = self._fingerprint(("all_reduce", arr.dtype, arr.shape, op),
                                     lambda: f"all_reduce({describe(arr)}, op={op.name})")
        links = self._links

        def job(rec, a):
            ops.allreduce_flat(links, a[0].reshape(-1), op, rec.seq, fp)
            return [tensor]

        return self._submit("all_reduce", desc, job, (arr,), arr.nbytes, timeout, async_op,
                            None, _FIRST)

    def _reduce(self, tensor, arr, dst, op, async_op, timeout):
        fp, desc = self._fingerprint(("reduce", arr.dtype, arr.shape, op, dst),
                                     lambda: f"reduce({describe(arr)}, dst={dst}, op={op.name})")
        links = self._links

        def job(rec, a):
            ops.reduce(links, rec.seq, fp, a[0], dst, op)
            return [tensor]

        return self._submit("reduce", desc, job, (arr,), arr.nbytes, timeout, async_op,
                            copy_out=_FIRST if self._rank == dst else _NONE)

    def _broadcast(self, tensor, arr, src, async_op, timeout):
        fp, desc = self._fingerprint(("broadcast", arr.dtype, arr.shape, src),
                                     lambda: f"broadcast({describe(arr)}, src={src})")
        links = self._links

        def job(rec, a):
            ops.broadcast(links, rec.seq, fp, a[0], src)
            return [tensor]

        root = self._rank == src
        return self._submit("broadcast", desc, job, (arr,), arr.nbytes, timeout, async_op,
                            copy_in=_FIRST if root else _NONE, copy_out=_NONE if root else _FIRST)

    def _all_gather(self, outputs, outs, arr, async_op, timeout):
        fp, desc = self._fingerprint(("all_gather", arr.dtype, arr.shape),
                                     lambda: f"all_gather({describe(arr)})")
        links = self._links

        def job(rec, a):
            ops.all_gather(links, rec.seq, fp, a[0], a[1:])
            return outputs

        return self._submit("all_gather", desc, job, (arr, *outs), arr.nbytes, timeout, async_op,
                            copy_in=_FIRST, copy_out=range(1, 1 + self._size))

    def _reduce_scatter(self, output, out, ins, op, async_op, timeout):
        size = self._size
        fp, desc = self._fingerprint(
            ("reduce_scatter", out.dtype, out.shape, op),
            lambda: f"reduce_scatter({describe(out)} x {size}, op={op.name})")
        links = self._links

        def job(rec, a):
            ops.reduce_scatter(links, rec.seq, fp, a[0], a[1:], op)
            return [output]

        return self._submit("reduce_scatter", desc, job, (out, *ins), out.nbytes * size, timeout,
                            async_op, copy_in=range(1, 1 + size), copy_out=_FIRST)

    def _gather(self, outputs, outs, arr, dst, async_op, timeout):
        result = list(outputs) if outputs else []
        return self._rooted("gather", arr, outs, dst, True, result, async_op, timeout)

    def _scatter(self, tensor, out, ins, src, async_op, timeout):
        return self._rooted("scatter", out, ins, src, False, [tensor], async_op, timeout)

    def _rooted(self, op, own, blocks, root, inbound, result, async_op, timeout):
        """gather (`inbound`: every rank's `own` into the root's `blocks`) or scatter (the
        root's `blocks[q]` into rank q's `own`); `blocks` is None except on the root."""
        where = "dst" if inbound else "src"
        fp, desc = self._fingerprint((op, own.dtype, own.shape, root),
                                     lambda: f"{op}({describe(own)}, {where}={root})")
        ack = f"{op}-ack({where}={root})".encode()
        links = self._links
        run = ops.gather if inbound else ops.scatter
        has_blocks = blocks is not None

        def job(rec, a):
            run(links, rec.seq, fp, ack, a[0], a[1:] if has_blocks else None, root)
            return result

        others = range(1, 1 + self._size)
        return self._submit(op, desc, job, (own, *(blocks or ())), own.nbytes, timeout, async_op,
                            copy_in=_FIRST if inbound else others,
                            copy_out=(others if has_blocks else _NONE) if inbound else _FIRST)

    def _all_to_all(self, outputs, outs, ins, async_op, timeout):
        w = self._size
        fp_desc = self._fingerprint(
            ("all_to_all", tuple((o.dtype, o.shape) for o in outs),
             tuple((x.dtype, x.shape) for x in ins)),
            lambda: "all_to_all(in " + ", ".join(describe(x) for x in ins)
            + "; out " + ", ".join(describe(o) for o in outs) + ")")
        key = ("all_to_all-blocks", tuple((o.dtype, o.shape) for o in outs),
               tuple((x.dtype, x.shape) for x in ins))
        blocks = self._fp_cache.get(key)
        if blocks is None:
            peers = [q for q in range(w) if q != self._rank]
            # Each peer checks the header of its own block: the shapes differ from peer to peer.
            blocks = _remember(self._fp_cache, key, (
                {q: f"all_to_all({describe(ins[q])})".encode() for q in peers},
                {q: f"all_to_all({describe(outs[q])})".encode() for q in peers}))
        fps_out, fps_in = blocks
        links = self._links

        def job(rec, a):
            ops.all_to_all(links, rec.seq, fps_out, fps_in, a[:w], a[w:])
            return list(outputs)

        return self._submit("all_to_all", fp_desc[1], job, (*outs, *ins),
                            sum(x.nbytes for x in ins), timeout, async_op,
                            copy_in=range(w, 2 * w), copy_out=range(w))

    def _barrier(self, async_op, timeout):
        links = self._links

        def job(rec, a):
            ops.barrier(links, rec.seq, b"barrier()")
            return []

        return self._submit("barrier", "barrier()", job, (), 0, timeout, async_op)

    def _monitored_barrier(self, timeout, wait_all_ranks):
        links = self._links

        def job(rec, a):
            ops.monitored_barrier(links, rec.seq, b"monitored_barrier()", timeout, wait_all_ranks)
            return []

        # The watchdog gives rank 0 time to name the missing ranks itself.
        self._submit("monitored_barrier", "monitored_barrier()", job, (), 0, timeout + 5.0, False)

    # ------------------------------------------------------------------ point to point

    def _send(self, arr, dst, tag, async_op, timeout):
        fp, desc = _p2p_names(self._fp_cache, "send", arr, dst, tag)
        links, mail, writer = self._links, self._mail, self._writer

        def job(rec, a):
            ops.send(links, fp, a[0], dst, tag, mail, writer)
            return [arr]

        # A small isend runs in the caller's thread when the group is idle, as a batch's sends
        # do: a send never waits for its receive, and handing it to the worker thread cost a
        # thread wake-up (an isend/irecv pair of 4 KiB took 4-6x a batch's time). Only where
        # it takes about as long as that hand-off and cannot block: a payload the sockets'
        # buffers take whole, or up to EAGER_SEND_MAX_BYTES through shared memory. A larger
        # copy stays in the worker thread, where it overlaps the caller's compute.
        eager = arr.nbytes <= (EAGER_SEND_MAX_BYTES if mail is not None else SMALL_MAX_BYTES)
        return self._submit("send", desc, job, (arr,), arr.nbytes, timeout, async_op, p2p=True,
                            eager=eager)

    def _recv(self, tensor, arr, src, tag, async_op, timeout):
        expected, desc = _p2p_names(self._fp_cache, "recv", arr, src, tag)
        links, mail, offers = self._links, self._mail, self._offers

        def job(rec, a):
            number = None
            if offers is not None and src is not None:
                number = offers.make(links.control, src, tag, expected, a[0])
            rec.source = ops.recv(links, expected, a[0], src, tag, mail,
                                  offered=None if number is None else (offers, number))
            return [tensor]

        return self._submit("recv", desc, job, (arr,), arr.nbytes, timeout, async_op,
                            copy_in=_NONE, copy_out=_FIRST, p2p=True)

    def batch_p2p(self, p2p_ops, timeout: TimeoutLike = None) -> list[Work]:
        """Run point-to-point operations, each `(is_send, tensor, group peer, tag)`, as one
        operation: every send (they never wait for their receive), then every receive in
        order. One Work per operation; a receive whose message does not fit fails alone."""
        arrs = []
        for is_send, tensor, peer, tag in p2p_ops:
            arrs.append(arrays_unwrap(tensor, "batch_isend_irecv send tensor" if is_send
                                      else "batch_isend_irecv recv tensor"))
            _check_peer(self._rank, self._size, is_send, peer)
            self._tag(tag)
        # What the batch's shape decides (which entries send, every message's fingerprint, the
        # description), built once per shape: a small exchange's whole cost is tens of
        # microseconds, so a call does one lookup instead.
        key = ("batch_isend_irecv", tuple([(op[0], a.dtype, a.shape, op[2], op[3])
                                           for op, a in zip(p2p_ops, arrs)]))
        plan = self._fp_cache.get(key)
        if plan is None:
            plan = _remember(self._fp_cache, key, _batch_plan(key[1], arrs))
        sends, recvs, peers, tags, fps, desc, nbytes, large = plan
        links, mail, writer, offers = self._links, self._mail, self._writer, self._offers
        outcomes: list = [None] * len(arrs)
        left = collections.deque(recvs)
        offered: dict[int, tuple] = {}
        large = large and offers is not None

        def offer(a):
            # Each large receive offers its array to its source first (`vm_p2p`); the j-th
            # receive from one source under one tag is for the j-th message not yet taken.
            ahead: collections.Counter = collections.Counter()
            for i in recvs:
                number = offers.make(links.control, peers[i], tags[i], fps[i], a[i],
                                     ahead[(peers[i], tags[i])])
                ahead[(peers[i], tags[i])] += 1
                if number is not None:
                    offered[i] = (offers, number)

        def receive(a, until):
            # The receives still to do, in order; False when one did not arrive by `until`.
            while left:
                i = left[0]
                try:
                    got = ops.recv(links, fps[i], a[i], peers[i], tags[i], mail, until,
                                   offered.get(i))
                    if got is None:
                        return False
                    outcomes[i] = got
                except P2PMismatch as exc:
                    outcomes[i] = exc
                left.popleft()
            return True

        def job(rec, a):
            if large:
                offer(a)
            for i in sends:
                ops.send(links, fps[i], a[i], peers[i], tags[i], mail, writer, wait=True)
            # Run inline (eager), the batch waits a moment for its receives in the caller's
            # thread (a peer's reply to a small exchange takes tens of microseconds), then
            # leaves the rest to the worker thread so the caller is free to go on.
            if receive(a, time.monotonic() + _INLINE_RECV_GRACE_S):
                return outcomes
            return Handoff(finish)

        def finish(rec, a):
            receive(a, None)
            return outcomes

        batch = self._submit("batch_isend_irecv", desc, job, arrs, nbytes,
                             self._timeout if timeout is None else self._t(timeout), True,
                             copy_in=sends, copy_out=recvs, p2p=True, eager=True)
        return [PartWork(batch, i, [op[1]]) for i, op in enumerate(p2p_ops)]

    # ------------------------------------------------------------------ lifecycle

    def abort(self) -> None:
        """Fail the group now: every pending and later operation raises, peers learn why."""
        self._failures.abort()

    def shutdown(self) -> None:
        """Leave the group: fail what is queued, say goodbye to every peer, close the links."""
        if not self._leave():
            return
        self._executor.stop(GroupDestroyed(
            f"Process group '{self.name}' was destroyed before this queued collective ran."
        ))
        self._links.close()
        self._failures.close()
        self._mesh.close()
