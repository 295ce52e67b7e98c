"""The rendezvous state machine (`RendezvousHandler`) over any `RendezvousBackend`.

The handler only syncs. Each operation reads the state, asks its decision in `decisions`
(which holds the rules of a round), applies the decided changes to a copy (`transitions`) and
writes the copy by compare-and-set; on a conflict it decides again on the newer state, and a
backend error is retried until the operation's deadline. The heartbeat thread (`heartbeat`)
and the timing of other nodes' heartbeats (`liveness`) live beside it, as do the bounds of a
join on an unreachable backend (`join_outage`) and the messages for operators (`reports`).

- A participant calling `next_rendezvous()` on its own complete round opens the next round,
  which every other participant sees through `restart_requested()`; a node that arrives while
  a round runs waits, and `num_nodes_waiting()` tells the agents, who then join again.
- A node whose heartbeat lapsed is dropped from a forming round, or marked dead in a running
  one (`dead_nodes()`), which must then restart.
- A joining node gives an unreachable backend `join_outage_timeout` seconds (counted from its
  last answer, or from the start of the join), then gives up with a
  RendezvousUnreachableError (see `join_outage`). A join after a round starts when the agent
  says the round is over (`meet_again()`), so its calls on the way there share the budget.
  Outside a join nothing gives up on an unreachable backend.
- Which job of the run the node belongs to (the state's generation) and the store keys scoped
  to it are `job_scope`'s; a state that vanished is written again under the job's generation.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from shoal.collectives.store.api import Store
from shoal.core.timeouts import TimeoutLike, to_seconds
from shoal.elastic.api import (
    DEFAULT_BACKEND_TIMEOUT_S,
    RendezvousBackend,
    RendezvousClosedError,
    RendezvousError,
    RendezvousInfo,
    RendezvousSettings,
    RendezvousTimeoutError,
    Token,
)
from shoal.elastic.rendezvous import decisions, reports, transitions
from shoal.elastic.rendezvous.decisions import Action, ActionKind, Context
from shoal.elastic.rendezvous.heartbeat import HeartbeatThread
from shoal.elastic.rendezvous.job_scope import JobScope
from shoal.elastic.rendezvous.join_outage import JoinOutage
from shoal.elastic.rendezvous.liveness import LivenessTracker
from shoal.elastic.rendezvous.sealing import ForgedValueError, Seal, job_secret
from shoal.elastic.rendezvous.state import RendezvousState

logger = logging.getLogger(__name__)

__all__ = ["RendezvousHandler"]

Decide = Callable[[Context], Action]

# The longest a node spends trying to leave (after a timed-out join, or on shutdown) or to
# write one heartbeat: leaving is a courtesy, and the next beat retries.
_LEAVE_S = 5.0


class RendezvousHandler:
    """One node's view of a run's rendezvous: join rounds, heartbeat, see restarts.

    Args:
        backend: where the state lives.
        settings: node counts and timeouts.
        node_id: this node's unique, stable id (e.g. "host-pid").
        store: the run's key-value store; each round gets a PrefixStore inside it.
        owns: close `backend` and `store` on `shutdown()`.
        backend_timeout: how long one operation retries an unreachable backend.
        secret: the job's secret (bytes), which MACs the rendezvous state and the job's store
            values (see `sealing`): every node of a job must be given the same one. Default:
            the process's SHOAL_AUTH_TOKEN or SHOAL_AUTH_TOKEN_FILE (`shoal run` sets the
            token); without either, shoal's development token, which is fit only for a job on
            one host's loopback, since anyone who can write to etcd could then forge what the
            job reads.
    """

    def __init__(
        self,
        backend: RendezvousBackend,
        settings: RendezvousSettings,
        node_id: str,
        store: Store,
        *,
        owns: bool = False,
        backend_timeout: TimeoutLike = DEFAULT_BACKEND_TIMEOUT_S,
        secret: Optional[bytes] = None,
    ):
        if not isinstance(backend, RendezvousBackend):
            raise TypeError(f"RendezvousHandler needs a RendezvousBackend, got {backend!r}.")
        if not isinstance(settings, RendezvousSettings):
            raise TypeError(f"RendezvousHandler needs RendezvousSettings, got {settings!r}.")
        if not isinstance(node_id, str) or not node_id or "/" in node_id:
            raise ValueError(f"node_id must be a non-empty string without '/', got {node_id!r}.")
        if not isinstance(store, Store):
            raise TypeError(f"RendezvousHandler needs a collectives Store, got {store!r}.")
        self.backend = backend
        self.settings = settings
        self.node_id = node_id
        self.store = store
        self._owns = owns
        self._backend_timeout = to_seconds(backend_timeout, DEFAULT_BACKEND_TIMEOUT_S)
        # The round this node last ran in and its participants. Written by the caller's thread
        # only (next_rendezvous); the heartbeat thread just reads the round number.
        self._round: Optional[int] = None
        self._participants: tuple[str, ...] = ()
        self._waiting_log = reports.WaitingLog(node_id, settings)
        self._liveness = LivenessTracker(node_id, settings.heartbeat_timeout)
        self._stop = threading.Event()
        self._heartbeat_thread = HeartbeatThread(
            node_id, self._keep_alive, settings.heartbeat_interval, self._stop,
            aborted=lambda: self._aborted is not None)
        self._shut = False
        self._aborted: Optional[RendezvousError] = None
        self._until: Optional[float] = None  # set by limit(): every retry loop ends by then
        self._outage = JoinOutage(backend, node_id, settings.join_outage_timeout, store)
        self._last_state: Optional[RendezvousState] = None  # the last state read
        self._seal = Seal(job_secret(secret), settings.run_id)
        # The job this node belongs to (the state's generation) and its keys.
        self._job = JobScope(store, settings.run_id, self._seal, self._forged)
        self._where = getattr(backend, "state_key", None) or f"the {backend.name} backend"

    # ------------------------------------------------------------------ public API

    @property
    def round(self) -> Optional[int]:
        """The round this node last joined, or None before the first."""
        return self._round

    @property
    def job_store(self) -> Store:
        """The run's store, scoped to the job this node joined (its generation), so that keys of
        an earlier job under the same run id are never seen; the whole store before a join."""
        return self._job.store()

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round and wait until it completes; return this node's place in it.

        Raises:
            RendezvousClosedError: the rendezvous is closed.
            RendezvousTimeoutError: no round with this node completed within join_timeout.
            RendezvousUnreachableError: the backend stayed unreachable for join_outage_timeout
                (the handler is aborted then: every later call raises it too).
            RendezvousError: the backend stayed unreachable.
        """
        if self._shut:
            raise RendezvousError(f"Node {self.node_id} already shut its rendezvous handler down.")
        self._raise_if_aborted()
        self._start_heartbeats()
        started = time.monotonic()
        self._outage.begin_join()
        try:
            return self._join(started)
        finally:
            self._outage.end_join()

    def _join(self, started: float) -> RendezvousInfo:
        deadline = started + self.settings.join_timeout
        while True:
            timed_out = time.monotonic() >= deadline
            state, token, outcome = self._update(
                lambda ctx: decisions.decide_join(ctx, timed_out), deadline)
            if outcome.kind is ActionKind.ERROR_CLOSED:
                if self._round is None:
                    self._job.generation = state.generation
                    raise RendezvousClosedError(
                        f"Run id {self.settings.run_id!r} belongs to a job that already ended "
                        f"(its rendezvous on the {self.backend.name} backend is closed), so "
                        f"node {self.node_id} cannot join it: give a new job its own run id "
                        "(--rdzv-id), or wait until the old state expires (etcd: the lease "
                        "ttl after its last node left)."
                    )
                raise RendezvousClosedError(
                    f"The rendezvous of run {self.settings.run_id!r} is closed; node "
                    f"{self.node_id} cannot join a new round."
                )
            if outcome.kind is ActionKind.FINISH:
                return self._finish(state, time.monotonic() - started)
            self._waiting_log.note(state, started)
            self._raise_if_aborted()
            if outcome.kind is ActionKind.ERROR_TIMEOUT:
                self._give_up(state)
            now = time.monotonic()
            left = deadline - now
            # Half the outage budget at most, so that a watch on a live backend always ends
            # by itself before its call is cut at the budget's end.
            bound = self._outage.call_bound()
            budget = (bound - now) / 2
            self._outage.bound_calls(bound)
            try:
                self.backend.watch(token, max(0.0, min(left, outcome.wait, budget)))
            except RendezvousError as exc:
                self._liveness.backend_unreachable()
                logger.debug("Watching the rendezvous state failed, re-reading: %s", exc)
                time.sleep(min(0.1, max(0.0, left)))

    def release_job_keys(self) -> int:
        """Delete the joined job's keys from the run's store, where the store can delete by
        prefix (etcd): the last node out of a finished job calls it, so that a run leaves no
        keys behind (the rendezvous state itself expires with its lease). Returns how many
        keys went; 0 where nothing can or need be deleted (an embedded store dies with its
        host)."""
        return self._job.release(self.node_id)

    def meet_again(self) -> None:
        """This node's round is over and the calling thread will join the next one: from now
        on its backend and store calls share that join's outage budget (join_outage_timeout,
        see `join_outage`), which `next_rendezvous` goes on with instead of starting anew."""
        self._outage.begin_join()

    def num_nodes_waiting(self) -> int:
        """Alive nodes waiting for the next round while the current one runs (0 if it is full)."""
        state, _ = self._read()
        return 0 if state is None else decisions.waiting_count(self._context(state))

    def signal_restart(self, reason: str) -> None:
        """Ask every node of this node's round to restart (they see it in restart_requested)."""
        if self._round is None:
            logger.info("Node %s signals a restart outside any round: %s", self.node_id, reason)
            return
        logger.info("Node %s requests a restart of round %s: %s", self.node_id, self._round, reason)
        text = f"{reason} (signalled by node {self.node_id})"
        self._update(lambda ctx: decisions.decide_restart(ctx, text))

    def restart_requested(self) -> Optional[str]:
        """Why this node's round must end (restart asked, node dead, newer round), or None."""
        if self._round is None:
            return None
        state, token, _ = self._update(decisions.decide_liveness)
        if token is None:
            return self._vanished()
        return decisions.restart_reason(self._context(state))

    def dead_nodes(self) -> list[str]:
        """Participants of this node's round that were declared dead or whose heartbeat lapsed."""
        if self._round is None:
            return []
        state, _ = self._read()
        if state is None:
            return []
        return decisions.dead_nodes(self._context(state), self._participants)

    def is_closed(self) -> bool:
        """True once any node of the job closed the rendezvous."""
        state, _ = self._read()
        return state is not None and state.closed

    def closed_by(self) -> str:
        """' by node X (its job finished)' after a close was read, else ''."""
        state = self._last_state
        return decisions.closer(state) if state is not None and state.closed else ""

    def set_closed(self, how: str = "finished") -> None:
        """Close the rendezvous, saying how the job ended ("finished": every node's workers
        succeeded; "failed": restarts ran out): every node's next_rendezvous raises
        RendezvousClosedError, and a node whose workers still run sees who closed it."""
        if how not in decisions.CLOSED_AS:
            raise ValueError(f"set_closed how={how!r}; choose one of {decisions.CLOSED_AS}.")
        logger.info("Node %s closes the rendezvous of run %s (%s)", self.node_id,
                    self.settings.run_id, how)
        self._update(lambda ctx: decisions.decide_close(ctx, how))

    def abort(self, error: RendezvousError) -> None:
        """Give up on the backend for good (e.g. the store's host died): stop heartbeats, and
        make every pending and later call raise `error` instead of retrying to its timeout.
        Safe to call from any thread."""
        if self._aborted is None:
            self._aborted = error
        self._stop.set()

    def limit(self, per_call: float, until: Optional[float] = None) -> None:
        """Bound the backend's calls while the agent finishes: each by `per_call` seconds, all
        by `until` (time.monotonic()); limits only tighten. The backend and the store are
        capped too where they can be (`cap_calls`, the etcd ones)."""
        self._backend_timeout = min(self._backend_timeout, per_call)
        if until is not None and (self._until is None or until < self._until):
            self._until = until
        for resource in (self.backend, self.store):
            cap = getattr(resource, "cap_calls", None)
            if cap is not None:
                cap(per_call, until)

    def shutdown(self) -> None:
        """Leave the rendezvous (a running round then restarts without us), stop heartbeats."""
        if self._shut:
            return
        self._shut = True
        self._stop.set()
        thread = self._heartbeat_thread
        if thread.ident is not None:
            join_by = self._deadline(self._backend_timeout + self.settings.heartbeat_interval)
            thread.join(max(0.0, join_by - time.monotonic()))
        try:
            if self._aborted is None:  # nobody is left to tell
                self._update(decisions.decide_leave,
                             self._deadline(min(self._backend_timeout, _LEAVE_S)))
        except RendezvousError as exc:
            logger.warning("Node %s could not leave the rendezvous cleanly: %s", self.node_id, exc)
        finally:
            if self._owns:
                for resource in (self.backend, self.store):
                    try:
                        resource.close()
                    except Exception as exc:  # noqa: BLE001  (closing must not raise)
                        logger.warning("Closing %r failed: %s", resource, exc)

    # ------------------------------------------------------------------ syncing the state

    def _context(self, state: RendezvousState) -> Context:
        return Context(node=self.node_id, settings=self.settings, state=state, now=time.time(),
                       lapsed=self._liveness.lapsed(), heartbeat=self._heartbeat_thread.value,
                       last_round=self._round)

    def _read(self) -> tuple[Optional[RendezvousState], Optional[Token]]:
        if self._outage.in_join():
            self._outage.bound_calls(self._outage.call_bound())
        try:
            result = self.backend.get_state()
        except RendezvousError:
            self._liveness.backend_unreachable()
            self._outage.failed()
            raise
        self._outage.answered()
        if result is None:
            self._liveness.observe(None)
            return None, None
        raw, token = result
        state = self._decode(raw)
        self._liveness.observe(state)
        self._last_state = state
        return state, token

    def _update(
        self, decide: Decide, deadline: Optional[float] = None
    ) -> tuple[RendezvousState, Optional[Token], Action]:
        """Write what `decide` changes by compare-and-set until it sticks.

        Returns the state (as written, or as read when nothing changed), its token (None: no
        state is stored) and the decision's outcome. Backend errors are retried until
        `deadline` (default: the backend timeout from now), so a short outage of etcd or the
        store only delays the update.
        """
        if deadline is None:
            deadline = self._deadline(self._backend_timeout)
        elif self._until is not None:
            deadline = min(deadline, self._until)
        attempt = 0
        current: Optional[tuple[Optional[RendezvousState], Optional[Token]]] = None
        while True:
            attempt += 1
            self._raise_if_aborted()
            joining = self._outage.in_join()
            try:
                if current is None:
                    current = self._read()
                elif joining:
                    self._outage.bound_calls(self._outage.call_bound())
                state, token = current
                if state is None:
                    state = self._job.fresh_state(self._round, self._last_state,
                                                  self._vanished())
                ctx = self._context(state)
                plan = transitions.settle(ctx, decide)
                if not plan.changes:
                    return plan.state, token, plan.outcome
                result = self.backend.set_state(plan.state.encode(self._seal), token)
            except RendezvousError as exc:
                if isinstance(exc, (RendezvousClosedError, RendezvousTimeoutError)):
                    raise
                self._liveness.backend_unreachable()
                self._outage.failed()
                if joining:
                    self._outage.check(exc, reports.waiting_for(
                        self._last_state, self.node_id, self.settings, self._round),
                        self.abort)
                if time.monotonic() >= deadline:
                    raise RendezvousError(
                        f"Node {self.node_id} could not update the rendezvous state of run "
                        f"{self.settings.run_id!r} on backend {self.backend.name!r} "
                        f"({attempt} attempts): {exc}"
                    ) from exc
                logger.debug("Rendezvous update failed (attempt %d), retrying: %s", attempt, exc)
                current = None
                until = min(deadline, self._outage.deadline()) if joining else deadline
                time.sleep(min(0.05 * attempt, 0.5, max(0.0, until - time.monotonic())))
                continue
            self._outage.answered()
            if result is None:
                current = (None, None)
                continue
            raw, new_token, written = result
            new_state = self._decode(raw)
            self._liveness.observe(new_state)
            self._last_state = new_state
            if written:
                reports.log_changes(plan, ctx.lapsed, self.node_id, self.settings)
                return new_state, new_token, plan.outcome
            current = (new_state, new_token)  # lost the race: decide again on the winner's state

    def _decode(self, raw: bytes) -> RendezvousState:
        """The stored state, its MAC checked first; a forgery aborts the handler for good."""
        try:
            return RendezvousState.decode(raw, self._seal, self._where)
        except ForgedValueError as exc:
            self._forged(exc)
            raise

    def _forged(self, error: ForgedValueError) -> None:
        if self._aborted is None:
            logger.error("Node %s: %s", self.node_id, error)
        self.abort(error)

    def _vanished(self) -> str:
        return (f"the rendezvous state of run {self.settings.run_id!r} vanished from the "
                f"{self.backend.name} backend")

    # ------------------------------------------------------------------ deadlines

    def _deadline(self, seconds: float) -> float:
        """`seconds` from now, but never past the limit set by `limit()`."""
        deadline = time.monotonic() + seconds
        return deadline if self._until is None else min(deadline, self._until)

    def _raise_if_aborted(self) -> None:
        if self._aborted is not None:
            raise self._aborted

    # ------------------------------------------------------------------ round results

    def _finish(self, state: RendezvousState, took: float) -> RendezvousInfo:
        rank = state.participants.index(self.node_id)
        self._round = state.round
        self._participants = state.participants
        self._job.generation = state.generation
        self._waiting_log.reset()
        logger.info("Node %s joined round %s as node rank %d of %d after %.2fs", self.node_id,
                    state.round, rank, len(state.participants), took)
        return RendezvousInfo(
            round=state.round,
            group_rank=rank,
            num_nodes=len(state.participants),
            participants=list(state.participants),
            store=self._job.round_store(state),
        )

    def _give_up(self, state: RendezvousState) -> None:
        try:
            self._update(decisions.decide_leave,
                         time.monotonic() + min(self._backend_timeout, _LEAVE_S))
        except RendezvousError as exc:
            logger.warning("Node %s could not leave after its join timed out: %s", self.node_id,
                           exc)
        where = "waiting for the running round to end" if state.complete else (
            f"with {len(state.participants)} of min_nodes={self.settings.min_nodes} joined "
            f"({', '.join(state.participants) or 'none'})"
        )
        raise RendezvousTimeoutError(
            f"Node {self.node_id} timed out after {self.settings.join_timeout:g}s joining round "
            f"{state.round} of run {self.settings.run_id!r}, {where}."
        )

    # ------------------------------------------------------------------ heartbeats

    def _start_heartbeats(self) -> None:
        if self._heartbeat_thread.ident is None:
            self._heartbeat_thread.start()

    def _keep_alive(self) -> None:
        """One heartbeat (run by the heartbeat thread)."""
        interval = self.settings.heartbeat_interval
        self._update(decisions.decide_keep_alive,
                     time.monotonic() + max(interval, min(self._backend_timeout, _LEAVE_S)))
