"""The `tcp` backend: gloo-like collectives over persistent, authenticated TCP connections.

The group owns a `Mesh` (sockets and control service), the `Links` its collectives run on
(`collectives`), an `InOrderExecutor` (ordering and Work handles) and, through `BackendGroup`,
the shared op ledger and watchdog. Each collective hook fingerprints the call, declares which
arrays it reads and writes (cupy arrays are staged through host memory once around the job,
`staging.HostStage.around`), and submits a job that runs one function of `collectives`.

Every failure (a mismatched header, a lost peer, a timeout) fails the whole group once: the
first reason is sent to every peer, the connections are broken so blocked calls return, and
every pending and later collective on every rank raises an error naming the same culprit.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any, Callable, Optional

from shoal.collectives import env
from shoal.collectives import metrics
from shoal.collectives.api import Work
from shoal.collectives.arrays import describe
from shoal.collectives.backends.api import Verdict
from shoal.collectives.backends.base import BackendGroup
from shoal.collectives.backends.dump import write_dump
from shoal.collectives.backends.ledger import OpRecord
from shoal.collectives.backends.tcp import algorithms as algos
from shoal.collectives.backends.tcp import collectives as ops
from shoal.collectives.backends.tcp import shm
from shoal.collectives.backends.tcp import staging
from shoal.collectives.backends.tcp import hierarchical
from shoal.collectives.backends.tcp import topology as topo
from shoal.collectives.backends.tcp.links import GroupFailed, Links, P2PMismatch
from shoal.collectives.backends.tcp.executor import InOrderExecutor, Job
from shoal.collectives.backends.tcp.mesh import ERROR_CLASSES, FailureReason, Mesh
from shoal.collectives.backends.tcp.pump import LinkDown
from shoal.collectives.backends.watchdog import exit_after_error
from shoal.collectives.constants import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_GROUP_NAME,
    LINK_REASON_GRACE_S,
    SHM_SLOT_BYTES,
    SPIN_S,
)
from shoal.collectives.store.api import Store
from shoal.collectives.types import CollectiveError, GroupDestroyed
from shoal.core.auth import load_token
from shoal.core.timeouts import TimeoutLike

logger = logging.getLogger(__name__)

__all__ = ["ProcessGroupTCP"]

# How long a collective in flight may keep running on the bytes of a peer that died (see
# `_mesh_failure`) before the group fails anyway; a collective that needs more from it fails
# as soon as its data connection ends.
LOST_PEER_GRACE_S = 5.0
# The watchdog ticks every WATCHDOG_TICK_S; the spin decision is revisited every this many.
_ADAPT_EVERY_TICKS = 10
_FIRST = (0,)
_NONE = ()
try:
    _CPUS = len(os.sched_getaffinity(0))
except (AttributeError, OSError):
    _CPUS = os.cpu_count() or 1


def _leaders_proposal(topology: topo.Topology, local_size: int) -> int:
    """How many ranks per host this rank proposes to carry traffic between hosts.

    SHOAL_HIER_LEADERS when set; else the host's cores per local rank, within 1 and the
    smallest host's rank count: each leader's ring needs CPU for its socket copies on top of
    what the host's ranks use. Measured on 2 cores, 2 hosts x 2 ranks, 64 MiB (quiet, under
    SCHED_FIFO): one leader per host 62 ms, two 74 ms (their rings' copies compete for the
    same cores).
    """
    configured = env.hierarchical_leaders()
    if configured is not None:
        return configured
    return max(1, min(min(len(h) for h in topology.hosts), _CPUS // max(1, local_size)))


def _pipeline_proposal(local_size: int) -> bool:
    """Whether this rank proposes to pipeline two-level all_reduces: SHOAL_HIER_PIPELINE when
    set, else when the host has two cores per local rank (a leader's courier thread then has a
    core of its own). Overlap needs spare cores: on 2 cores with 2 ranks per host the pipeline
    measured 79 ms against 62 ms unpipelined (2 hosts x 2 ranks, 64 MiB), since the leaders
    already keep both cores busy and the pipeline adds barriers and thread hand-offs."""
    configured = env.hierarchical_pipeline()
    if configured is not None:
        return configured
    return _CPUS >= 2 * local_size


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
        self._failure: Optional[FailureReason] = None
        self._verdict: Optional[Verdict] = None  # the watchdog's, for the overdue op's caller
        self._fail_lock = threading.Lock()
        # A peer whose control connection closed without a goodbye while a collective was in
        # flight: that collective may still finish on the bytes the peer sent before it died.
        self._in_collective = False
        self._lost: Optional[FailureReason] = None
        self._lost_timer: Optional[threading.Timer] = None
        self._ticks = 0
        self._fp_cache: dict = {}
        self._executor = InOrderExecutor(name, self._ledger, self._run, self._describe)
        self._mesh = Mesh(
            store=store, rank=rank, size=size, name=name,
            host=host or env.bind_host_for(store),
            token=load_token(token), on_failure=self._mesh_failure,
        )
        try:
            self._mesh.connect(self._timeout)
            self._topology = topo.from_identities(
                self._mesh.host_identities(min(self._timeout, 60.0)), env.hierarchical_leaders())
            shared = self._setup_shared_memory() if self._topology.single_host else None
            direct = algos.Direct(rank, size, self._mesh.tx, self._mesh.rx,
                                  env.spin_seconds(size, SPIN_S))
            self._links = Links(rank, size, self._mesh, direct, shared, name,
                                lambda: self.failed)
            if self._topology.hierarchical:
                self._links.hier = self._setup_hierarchy()
        except BaseException:
            self._mesh.close()
            raise
        self._adapt_to_load()
        self._start_watchdog()

    def _setup_shared_memory(self) -> Optional[shm.SharedSlots]:
        """Shared memory for large all_reduces when every rank of the group shares our host."""
        mesh = self._mesh
        if self._size < 2 or any(t != "unix" for q, t in enumerate(mesh.transports)
                                 if q != self._rank):
            return None
        # Every all-Unix group runs the setup, offering nothing unless this rank's mode is
        # "shm": ranks started with different SHOAL_LOCAL_TRANSPORT values then agree on
        # sockets instead of one side waiting for offers the other never sends.
        try:
            return shm.SharedSlots.establish(
                self._rank, self._size, mesh.tx, mesh.rx, SHM_SLOT_BYTES, min(self._timeout, 60.0),
                offer=env.local_transport() == "shm",
            )
        except shm.ShmSetupError as exc:
            raise CollectiveError(
                f"Rank {self._rank} of group '{self.name}' could not set up shared memory with "
                f"{exc}; set SHOAL_LOCAL_TRANSPORT=unix to use sockets only."
            ) from exc

    def _setup_hierarchy(self) -> Optional[hierarchical.Plan]:
        """The two-level plan for a group that spans hosts: shared memory among this host's
        ranks, and links to the ranks with our local index on the other hosts. Every rank of
        the group agrees on using it, or nobody does (a host whose shared memory failed, or a
        rank run with SHOAL_LOCAL_TRANSPORT=unix or SHOAL_HIERARCHICAL=0, means flat
        algorithms everywhere)."""
        topology, links = self._topology, self._links
        local_members = topology.local_ranks(self._rank)
        index = local_members.index(self._rank)
        willing = env.local_transport() == "shm" and env.hierarchical_collectives()
        local = None
        if len(local_members) > 1:
            local = links.subset(list(local_members), label="host")
            try:
                local.shm = shm.SharedSlots.establish(
                    local.rank, local.size, local.tx, local.rx, SHM_SLOT_BYTES,
                    min(self._timeout, 60.0), offer=willing,
                )
            except shm.ShmSetupError as exc:
                peer = local_members[exc.peer]
                raise CollectiveError(
                    f"Rank {self._rank} of group '{self.name}' could not set up shared memory "
                    f"with rank {peer}: {exc.detail}; set SHOAL_LOCAL_TRANSPORT=unix to use "
                    "sockets only."
                ) from exc
            willing = willing and local.shm is not None
        # Every rank must take the same path with the same leaders: each says whether it can
        # and how many leaders per host it proposes; the smallest proposal wins.
        # Likewise whether all_reduce pipelines its pieces (every rank must cut the same).
        ours = bytes([int(willing), min(255, _leaders_proposal(topology, len(local_members))),
                      int(_pipeline_proposal(len(local_members)))])
        verdicts = [ours] + [bytes(v) for v in links.direct.exchange(0, b"hierarchy", ours).values()]
        topology = dataclasses.replace(topology, max_leaders=min(v[1] for v in verdicts))
        pipelined = all(v[2] == 1 for v in verdicts)
        self._topology = topology
        if not all(v[0] == 1 for v in verdicts):
            if local is not None:
                local.shm = None
            logger.info("Group %r spans hosts (%s) but runs flat collectives: a rank cannot use "
                        "shared memory", self.name, topology.describe())
            return None
        k = topology.leaders_per_host
        cross = (links.subset(list(topology.cross_ranks(index)), label=f"ring{index}")
                 if index < k else None)
        return hierarchical.Plan(topology, topology.host_of(self._rank), index, local, cross,
                                 pipelined)

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
        return self._mesh.prefix

    @property
    def failed(self) -> bool:
        return self._failure is not None

    @property
    def failure(self) -> Optional[str]:
        """Why the group failed (a sentence), or None while it is healthy."""
        return None if self._failure is None else self._failure.cause

    def __repr__(self) -> str:
        return f"ProcessGroupTCP(name={self.name!r}, rank={self._rank}, size={self._size})"

    def watchdog_tick(self) -> None:
        self._ticks += 1
        if self._ticks % _ADAPT_EVERY_TICKS == 0:
            self._adapt_to_load()

    def _adapt_to_load(self) -> None:
        """Poll small receives only while the machine has a spare CPU (about every second)."""
        d = self._links.direct
        if d.spin_s:
            try:
                # Our own ranks count towards the load; other work beyond that means no spare CPU.
                busy = os.getloadavg()[0] > 1.5 * _CPUS
            except OSError:
                busy = False
            self._links.allow_spin(not busy)

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
                                          self._ledger.current)
        self._mesh.abort(reason)
        return True

    def _mesh_failure(self, reason: FailureReason) -> None:
        """A failure the control service saw; a lost peer waits for the collective in flight.

        A rank that finishes a collective and dies at once (SIGKILL, os._exit) has already
        handed every byte its peers need to the kernel; failing the group on the closed control
        connection would break collectives that are about to complete. Instead the collective in
        flight runs on: if it needs more from the dead rank its data connection ends (PeerLost
        naming it), and once it ends, or after LOST_PEER_GRACE_S, the group fails as before, so
        the next collective fails naming the dead rank.
        """
        if reason.kind == "peer_lost" and reason.origin == self._rank:
            with self._fail_lock:
                if self._failure is None and self._in_collective:
                    if self._lost is None:
                        self._lost = reason
                        timer = threading.Timer(LOST_PEER_GRACE_S, self._fail_lost)
                        timer.daemon = True
                        self._lost_timer = timer
                        timer.start()
                    return
        self._fail(reason)

    def _fail_lost(self) -> None:
        with self._fail_lock:
            reason, self._lost = self._lost, None
            timer, self._lost_timer = self._lost_timer, None
        if timer is not None:
            timer.cancel()
        if reason is not None:
            self._fail(reason)

    def fail_from_watchdog(self, verdict: Verdict) -> None:
        """Called by the watchdog for an overdue operation."""
        self._verdict = verdict
        self._fail(FailureReason(verdict.kind, verdict.cause, self._rank, verdict.culprits,
                                 verdict.dump_path))
        if env.async_error_handling():
            if verdict.record is not None:
                metrics.count_error(verdict.record.op, verdict.kind)
            exit_after_error(verdict.message)

    def _error_for(self, rec: OpRecord) -> CollectiveError:
        verdict = self._verdict
        if verdict is not None and verdict.record is rec:
            return ERROR_CLASSES[verdict.kind](verdict.message)
        reason = self._failure
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
            lost = self._lost
            if lost is not None and peer in lost.culprits:
                return lost
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

    # ------------------------------------------------------------------ running one operation

    def _run(self, rec: OpRecord, job: Job, arrays: Any) -> list:
        """The executor's runner: `job` with this group's failure handling around it."""
        if rec.p2p:
            return self._run_op(rec, job, arrays)
        with self._fail_lock:
            self._in_collective = True
        try:
            return self._run_op(rec, job, arrays)
        finally:
            with self._fail_lock:
                self._in_collective = False
            if self._lost is not None:
                self._fail_lost()

    def _run_op(self, rec: OpRecord, job: Job, arrays: Any) -> list:
        if self._failure is not None:
            self._raise_failed(rec)
        t0 = time.perf_counter()
        try:
            result = job(rec, arrays)
        except (P2PMismatch, CollectiveError):  # already the caller's error (and counted)
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
        except GroupFailed as exc:
            if exc.reason is not None:
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

    def _fingerprint(self, key, build: Callable[[], str]) -> tuple[bytes, str]:
        """(header fingerprint, description) of a call, cached by its shape."""
        pair = self._fp_cache.get(key)
        if pair is None:
            desc = build()
            pair = (desc.encode(), desc)
            if len(self._fp_cache) > 4096:
                self._fp_cache.clear()
            self._fp_cache[key] = pair
        return pair

    def _submit(self, op: str, desc: str, job: Job, arrays: tuple, nbytes: int, timeout: float,
                async_op: bool, copy_in=None, copy_out=_NONE, p2p: bool = False) -> Work:
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
            job = stage.around(job, copy_in, copy_out)
        return self._executor.submit(op, desc, nbytes, timeout, async_op, p2p, job, arrays)

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
        peers = [q for q in range(w) if q != self._rank]
        # Each peer checks the header of its own block: the shapes differ from peer to peer.
        fps_out = {q: f"all_to_all({describe(ins[q])})".encode() for q in peers}
        fps_in = {q: f"all_to_all({describe(outs[q])})".encode() for q in peers}
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
        fp = f"p2p({describe(arr)})".encode()
        links = self._links

        def job(rec, a):
            ops.send(links, fp, a[0], dst, tag)
            return [arr]

        return self._submit("send", f"send({describe(arr)}, dst={dst}, tag={tag})", job, (arr,),
                            arr.nbytes, timeout, async_op, p2p=True)

    def _recv(self, tensor, arr, src, tag, async_op, timeout):
        expected = f"p2p({describe(arr)})".encode()
        links = self._links

        def job(rec, a):
            rec.source = ops.recv(links, expected, a[0], src, tag)
            return [tensor]

        where = "any rank" if src is None else f"src={src}"
        return self._submit("recv", f"recv({describe(arr)}, {where}, tag={tag})", job, (arr,),
                            arr.nbytes, timeout, async_op, copy_in=_NONE, copy_out=_FIRST,
                            p2p=True)

    # ------------------------------------------------------------------ lifecycle

    def abort(self) -> None:
        self._fail(FailureReason(
            "error", f"rank {self._rank} aborted the group (ProcessGroup.abort())", self._rank,
            (self._rank,)
        ))

    def shutdown(self) -> None:
        if not self._leave():
            return
        self._executor.stop(GroupDestroyed(
            f"Process group '{self.name}' was destroyed before this queued collective ran."
        ))
        self._links.close()
        timer = self._lost_timer
        if timer is not None:
            timer.cancel()
        self._mesh.close()
