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

from shoal.collectives.backends.tcp import algorithms as algos
from shoal.collectives.backends.tcp import shm
from shoal.collectives import env
from shoal.collectives import metrics
from shoal.collectives.backends.ledger import Engine, OpRecord
from shoal.collectives.backends.tcp.mesh import FailureReason, Mesh
from shoal.collectives.backends.tcp.pump import LinkDown, SenderThread
from shoal.collectives.backends.tcp.collectives import GroupFailed, P2PMismatch, TCPCollectives
from shoal.collectives.api import ProcessGroup, Work
from shoal.collectives.store.api import Store
from shoal.collectives.types import CollectiveError, CollectiveTimeout, GroupDestroyed
from shoal.collectives.constants import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_GROUP_NAME,
    LINK_REASON_GRACE_S,
    SHM_SLOT_BYTES,
    SPIN_S,
)
from shoal.collectives.backends.watchdog import Watchdog, exit_after_error, write_dump
from shoal.core.auth import load_token
from shoal.core.timeouts import TimeoutLike

logger = logging.getLogger(__name__)

__all__ = ["ProcessGroupTCP"]

# Groups still open in this process: closed with a goodbye at interpreter exit, so that a script
# that ends without destroy_process_group does not look like a crash to its peers.
_LIVE: "weakref.WeakSet[ProcessGroupTCP]" = weakref.WeakSet()
# How long a collective in flight may keep running on the bytes of a peer that died (see
# `_mesh_failure`) before the group fails anyway; a collective that needs more from it fails
# as soon as its data connection ends.
LOST_PEER_GRACE_S = 5.0
try:
    _CPUS = len(os.sched_getaffinity(0))
except (AttributeError, OSError):
    _CPUS = os.cpu_count() or 1


class ProcessGroupTCP(TCPCollectives, ProcessGroup):
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
        # A peer whose control connection closed without a goodbye while a collective was in
        # flight: that collective may still finish on the bytes the peer sent before it died.
        self._in_collective = False
        self._lost: Optional[FailureReason] = None
        self._lost_timer: Optional[threading.Timer] = None
        self._destroyed = False
        self._engine = Engine(name, self._run, self._describe)
        self._mesh = Mesh(
            store=store, rank=rank, size=size, name=name, host=host or env.bind_host(None),
            token=load_token(token), on_failure=self._mesh_failure,
        )
        try:
            self._mesh.connect(self._timeout)
            self._shm = self._setup_shared_memory()
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

    def _setup_shared_memory(self) -> Optional[shm.SharedSlots]:
        """Shared memory for large all_reduces when every rank of the group shares our host."""
        mesh = self._mesh
        if self._size < 2 or any(t != "unix" for q, t in enumerate(mesh.transports) if q != self._rank):
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

    def _run(self, rec: OpRecord) -> list:
        if rec.p2p:
            return self._run_op(rec)
        with self._fail_lock:
            self._in_collective = True
        try:
            return self._run_op(rec)
        finally:
            with self._fail_lock:
                self._in_collective = False
            if self._lost is not None:
                self._fail_lost()

    def _run_op(self, rec: OpRecord) -> list:
        if self._failure is not None:
            self._raise_failed(rec)
        t0 = time.perf_counter()
        try:
            result = rec.fn(rec)
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
        timer = self._lost_timer
        if timer is not None:
            timer.cancel()
        self._mesh.close()
        # Never unmapped explicitly: a collective aborted in another thread may still be
        # reading; the mappings go with the last array that views them.
        self._shm = None


def _close_all_at_exit() -> None:
    for pg in list(_LIVE):
        try:
            pg.shutdown()
        except Exception:  # exiting anyway
            pass


import atexit  # noqa: E402  (registered once, when the backend is first imported)

atexit.register(_close_all_at_exit)
