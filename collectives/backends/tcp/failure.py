"""How a tcp group fails: once, for everyone, with the same culprit on every rank.

`GroupFailure` records the group's first failure, tells every peer through the mesh (which
also breaks the connections so blocked calls return), and runs each operation (`run`, the
executor's runner) so that whatever it hits (a mismatched header, a lost link, a peer's abort)
becomes the caller's error naming that culprit, and every later operation raises it too.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

from shoal.collectives import env, metrics
from shoal.collectives.backends.api import Verdict, WatchedGroup
from shoal.collectives.backends.dump import write_dump
from shoal.collectives.backends.ledger import OpRecord
from shoal.collectives.backends.tcp import algorithms as algos
from shoal.collectives.backends.tcp.executor import Job
from shoal.collectives.backends.tcp.framing import Tampered
from shoal.collectives.backends.tcp.links import GroupFailed, P2PMismatch
from shoal.collectives.backends.tcp.mesh import Mesh
from shoal.collectives.backends.tcp.pump import LinkDown
from shoal.collectives.backends.tcp.reasons import ERROR_CLASSES, FailureReason
from shoal.collectives.backends.watchdog import exit_after_error
from shoal.collectives.constants import LINK_REASON_GRACE_S
from shoal.collectives.types import CollectiveError

logger = logging.getLogger(__name__)

__all__ = ["GroupFailure", "LOST_PEER_GRACE_S"]

# How long a collective in flight may keep running on the bytes of a peer that died (see
# `GroupFailure.on_mesh_failure`) before the group fails anyway; a collective that needs more
# from it fails as soon as its data connection ends.
LOST_PEER_GRACE_S = 5.0


class GroupFailure:
    """The failure state of one rank's tcp group, and the runner of its operations.

    Args:
        group: the group, as the dump sees it (a trace is written when it fails).
        rank, name: this rank and the group's name, for messages.

    The group attaches its `mesh` once it made it (the mesh reports to `on_mesh_failure`).
    """

    def __init__(self, group: WatchedGroup, rank: int, name: str):
        self._group = group
        self._rank = rank
        self._name = name
        self.mesh: Optional[Mesh] = None
        self.reason: Optional[FailureReason] = None  # the first failure; None while healthy
        self._verdict: Optional[Verdict] = None  # the watchdog's, for the overdue op's caller
        self._counted: Optional[OpRecord] = None  # the operation counted with the failure
        self._lock = threading.Lock()
        # A peer whose control connection closed without a goodbye while a collective was in
        # flight: that collective may still finish on the bytes the peer sent before it died.
        self._in_collective = False
        self._lost: Optional[FailureReason] = None
        self._lost_timer: Optional[threading.Timer] = None

    def failed(self) -> bool:
        """True once the group has failed."""
        return self.reason is not None

    # ------------------------------------------------------------------ deciding

    def fail(self, reason: FailureReason) -> bool:
        """Record the group's first failure, tell every peer, break the links. True if first."""
        with self._lock:
            if self.reason is not None:
                return False
            self.reason = reason
        logger.warning("Rank %d: group %r failed: %s", self._rank, self._name, reason.cause)
        # Counted here, once, whether or not a collective is running: a peer killed between two
        # collectives fails the group, and the agent may stop this rank before its next call.
        current = self._group.ledger.current
        self._counted = current if current is not None and current.finished is None else None
        metrics.count_error(current.op if self._counted is not None else metrics.NO_OP,
                            reason.kind)
        if reason.kind == "timeout" and reason.origin != self._rank and reason.dump_path is None:
            # Leave a trace on every rank, not only on the one whose watchdog fired.
            reason.dump_path = write_dump(self._group,
                                          f"Group '{self._name}' failed: {reason.cause}.",
                                          self._group.ledger.current)
        self.mesh.abort(reason)
        return True

    def on_mesh_failure(self, reason: FailureReason) -> None:
        """A failure the control service saw; a lost peer waits for the collective in flight.

        A rank that finishes a collective and dies at once (SIGKILL, os._exit) has already
        handed every byte its peers need to the kernel; failing the group on the closed control
        connection would break collectives that are about to complete. Instead the collective in
        flight runs on: if it needs more from the dead rank its data connection ends (PeerLost
        naming it), and once it ends, or after LOST_PEER_GRACE_S, the group fails as before, so
        the next collective fails naming the dead rank.
        """
        if reason.kind == "peer_lost" and reason.origin == self._rank:
            with self._lock:
                if self.reason is None and self._in_collective:
                    if self._lost is None:
                        self._lost = reason
                        timer = threading.Timer(LOST_PEER_GRACE_S, self._fail_lost)
                        timer.daemon = True
                        self._lost_timer = timer
                        timer.start()
                    return
        self.fail(reason)

    def _fail_lost(self) -> None:
        with self._lock:
            reason, self._lost = self._lost, None
            timer, self._lost_timer = self._lost_timer, None
        if timer is not None:
            timer.cancel()
        if reason is not None:
            self.fail(reason)

    def fail_from_watchdog(self, verdict: Verdict) -> None:
        """Fail for the watchdog's verdict on an overdue operation."""
        self._verdict = verdict
        self.fail(FailureReason(verdict.kind, verdict.cause, self._rank, verdict.culprits,
                                verdict.dump_path))
        if env.async_error_handling():
            exit_after_error(verdict.message)  # the failure was counted by fail()

    def abort(self) -> None:
        """Fail the group because this rank's user called `ProcessGroup.abort()`."""
        self.fail(FailureReason(
            "error", f"rank {self._rank} aborted the group (ProcessGroup.abort())", self._rank,
            (self._rank,)
        ))

    def close(self) -> None:
        """Stop waiting on a lost peer's grace period (the group is being destroyed)."""
        timer = self._lost_timer
        if timer is not None:
            timer.cancel()

    # ------------------------------------------------------------------ the caller's error

    def _error_for(self, rec: OpRecord) -> CollectiveError:
        verdict = self._verdict
        if verdict is not None and verdict.record is rec:
            return ERROR_CLASSES[verdict.kind](verdict.message)
        reason = self.reason
        message = f"Rank {self._rank} failed {rec.label} of group '{self._name}': {reason.cause}."
        if reason.dump_path:
            message += f" Recent collectives of this rank are in {reason.dump_path}."
        return reason.error_class(message)

    def _link_reason(self, exc: LinkDown) -> FailureReason:
        peer = exc.peer
        end = time.monotonic() + LINK_REASON_GRACE_S
        while True:
            if self.reason is not None:
                return self.reason
            lost = self._lost
            if lost is not None and peer in lost.culprits:
                return lost
            if self.mesh.departed[peer]:
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
        if rec is not self._counted:  # the collective in flight at the failure is counted
            metrics.count_error(rec.op, self.reason.kind)
        if env.async_error_handling():
            if self.reason is not None and self.reason.dump_path is None:
                self.reason.dump_path = write_dump(self._group, str(err), rec)
            exit_after_error(str(err))
        if cause is not None:
            raise err from cause
        raise err

    # ------------------------------------------------------------------ running one operation

    def run(self, rec: OpRecord, job: Job, arrays: Any) -> list:
        """The executor's runner: `job` with this group's failure handling around it."""
        if rec.p2p:
            return self._run_op(rec, job, arrays)
        with self._lock:
            self._in_collective = True
        try:
            return self._run_op(rec, job, arrays)
        finally:
            with self._lock:
                self._in_collective = False
            if self._lost is not None:
                self._fail_lost()

    def _run_op(self, rec: OpRecord, job: Job, arrays: Any) -> list:
        if self.reason is not None:
            self._raise_failed(rec)
        t0 = time.perf_counter()
        try:
            result = job(rec, arrays)
        except (P2PMismatch, CollectiveError):  # already the caller's error (and counted)
            raise
        except LinkDown as exc:
            self.fail(self._link_reason(exc))
            self._raise_failed(rec, exc)
        except algos.HeaderMismatch as exc:
            self.fail(FailureReason(
                "mismatch",
                f"rank {self._rank} called {exc.ours} as collective #{rec.seq} but rank "
                f"{exc.peer} called {exc.their_fp} as #{exc.their_seq}; every rank must call the "
                "same collectives in the same order with the same shapes and dtypes",
                self._rank, (self._rank, exc.peer),
            ))
            self._raise_failed(rec, exc)
        except Tampered as exc:
            self.fail(FailureReason(
                "error", f"{exc.what} from rank {exc.peer} failed its integrity check (it was "
                         "altered, injected or replayed between the ranks); the connection "
                         "was dropped",
                self._rank, (exc.peer,),
            ))
            self._raise_failed(rec, exc)
        except algos.ProtocolError as exc:
            self.fail(FailureReason(
                "error", f"rank {exc.peer} sent {exc.detail} (the connection is out of step)",
                self._rank, (exc.peer,),
            ))
            self._raise_failed(rec, exc)
        except GroupFailed as exc:
            if exc.reason is not None:
                self.fail(exc.reason)
            self._raise_failed(rec, None)
        # Wide on purpose: anything else a job raises (a bug, a numpy error) must still fail the
        # group on every rank, or the peers would wait for this rank until their timeout.
        except Exception as exc:  # noqa: BLE001 - turned into the group's failure, not swallowed
            if self.reason is None:
                self.fail(FailureReason(
                    "error", f"rank {self._rank} hit {type(exc).__name__} in {rec.label}: {exc}",
                    self._rank, (self._rank,),
                ))
            self._raise_failed(rec, exc)
        metrics.observe(rec.op, "tcp", time.perf_counter() - t0, rec.nbytes)
        return result
