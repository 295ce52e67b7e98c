"""The rendezvous state machine (`RendezvousHandler`) over any `RendezvousBackend`.

Rules, all applied through compare-and-set on one state document (`_rdzv_state`):

- A round forms while nodes join. It completes at once when `max_nodes` joined; when every node
  it expects (the previous round's survivors and waiters) is back and `min_nodes` joined; or
  when `min_nodes` joined and the last call (`last_call_timeout` after the minimum was
  reached) is over. Missing expected nodes are awaited for at most `last_call_timeout +
  heartbeat_timeout` after the round opened. Ranks are the sorted node ids.
- A node that arrives while a round runs waits; `num_nodes_waiting()` tells the agents, which
  then call `next_rendezvous()` again. A participant calling `next_rendezvous()` on its own
  complete round opens the next round, which every other participant sees through
  `restart_requested()`.
- Every node writes a heartbeat counter each `heartbeat_interval`. Each observer times how long
  a node's counter stays unchanged on its own monotonic clock, so clocks need not agree; a
  counter unchanged for `heartbeat_timeout` marks the node dead. Time while the backend was
  unreachable does not count, so an outage of the backend kills no node.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

from shoal.collectives.store.api import Store
from shoal.core.timeouts import TimeoutLike, to_seconds
from shoal.elastic.rendezvous.state import RendezvousState
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

logger = logging.getLogger(__name__)

__all__ = ["RendezvousHandler"]

Mutator = Callable[[RendezvousState], bool]


class RendezvousHandler:
    """One node's view of a run's rendezvous: join rounds, heartbeat, see restarts.

    Args:
        backend: where the state lives.
        settings: node counts and timeouts.
        node_id: this node's unique, stable id (e.g. "host-pid").
        store: the run's key-value store; each round gets a PrefixStore inside it.
        owns: close `backend` and `store` on `shutdown()`.
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
        self._lock = threading.RLock()
        self._round: Optional[int] = None
        self._participants: list[str] = []
        # node -> (last heartbeat value seen, monotonic time it was first seen)
        self._seen: dict[str, tuple[Optional[str], float]] = {}
        self._backend_down = False
        self._last_read: Optional[float] = None
        self._nonce = f"{os.getpid():x}.{time.time_ns() & 0xFFFFFFFF:x}"
        self._beats = 0
        self._stop = threading.Event()
        self._heartbeat_thread: Optional[threading.Thread] = None
        self._shut = False
        self._aborted: Optional[RendezvousError] = None
        self._until: Optional[float] = None  # set by limit(): every retry loop ends by then

    # ------------------------------------------------------------------ public API

    @property
    def round(self) -> Optional[int]:
        """The round this node last joined, or None before the first."""
        return self._round

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round and wait until it completes; return this node's place in it.

        Raises:
            RendezvousClosedError: the rendezvous is closed.
            RendezvousTimeoutError: no round with this node completed within join_timeout.
            RendezvousError: the backend stayed unreachable.
        """
        if self._shut:
            raise RendezvousError(f"Node {self.node_id} already shut its rendezvous handler down.")
        self._raise_if_aborted()
        self._start_heartbeats()
        deadline = time.monotonic() + self.settings.join_timeout
        with self._lock:
            self._round = None
        joined: list[Optional[int]] = [None]  # the forming round this call added us to
        started = time.monotonic()
        while True:
            state, token = self._update(lambda s: self._join_step(s, joined), deadline)
            if state.closed:
                raise RendezvousClosedError(
                    f"The rendezvous of run {self.settings.run_id!r} is closed; node "
                    f"{self.node_id} cannot join a new round."
                )
            me = self.node_id
            if state.complete and state.round == joined[0] and me in state.participants:
                return self._finish(state, time.monotonic() - started)
            self._raise_if_aborted()
            left = deadline - time.monotonic()
            if left <= 0:
                self._give_up(state)
            try:
                self.backend.watch(token, min(left, self._next_check(state)))
            except RendezvousError as exc:
                self._backend_down = True
                logger.debug("Watching the rendezvous state failed, re-reading: %s", exc)
                time.sleep(min(0.1, max(0.0, left)))

    def num_nodes_waiting(self) -> int:
        """Alive nodes waiting for the next round while the current one runs (0 if it is full)."""
        state, _ = self._read()
        if state is None or not state.complete or state.closed:
            return 0
        if len(state.participants) >= self.settings.max_nodes:
            return 0
        return sum(1 for n in state.wait_list if not self._lapsed(n))

    def signal_restart(self, reason: str) -> None:
        """Ask every node of this node's round to restart (they see it in restart_requested)."""
        text = f"{reason} (signalled by node {self.node_id})"

        def mark(state: RendezvousState) -> bool:
            if state.closed or not state.complete or state.round != self._round:
                return False  # the round is already over
            if state.restart is not None:
                return False
            state.restart = text
            return True

        if self._round is None:
            logger.info("Node %s signals a restart outside any round: %s", self.node_id, reason)
            return
        logger.info("Node %s requests a restart of round %s: %s", self.node_id, self._round, reason)
        self._update(mark)

    def restart_requested(self) -> Optional[str]:
        """Why this node's round must end (restart asked, node dead, newer round), or None."""
        if self._round is None:
            return None
        state, token = self._update(self._housekeep)
        if token is None:
            return self._vanished()
        if state.closed:
            return f"the rendezvous of run {self.settings.run_id!r} was closed"
        if state.round != self._round:
            return state.reason or f"round {state.round} of the rendezvous started"
        return state.restart

    def dead_nodes(self) -> list[str]:
        """Participants of this node's round that were declared dead or whose heartbeat lapsed."""
        if self._round is None:
            return []
        state, _ = self._read()
        if state is None:
            return []
        if state.round == self._round:
            dead = set(state.dead)
        elif state.round == self._round + 1:
            dead = set(state.lost)
        else:
            dead = set()
        dead.update(n for n in self._participants if self._lapsed(n))
        return [n for n in self._participants if n in dead]

    def is_closed(self) -> bool:
        """True once any node closed the rendezvous."""
        state, _ = self._read()
        return state is not None and state.closed

    def set_closed(self) -> None:
        """Close the rendezvous: every node's next_rendezvous raises RendezvousClosedError."""

        def close(state: RendezvousState) -> bool:
            if state.closed:
                return False
            state.closed = True
            return True

        logger.info("Node %s closes the rendezvous of run %s", self.node_id, self.settings.run_id)
        self._update(close)

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

    def _deadline(self, seconds: float) -> float:
        """`seconds` from now, but never past the limit set by `limit()`."""
        deadline = time.monotonic() + seconds
        return deadline if self._until is None else min(deadline, self._until)

    def _raise_if_aborted(self) -> None:
        if self._aborted is not None:
            raise self._aborted

    def shutdown(self) -> None:
        """Leave the rendezvous (a running round then restarts without us), stop heartbeats."""
        if self._shut:
            return
        self._shut = True
        self._stop.set()
        thread = self._heartbeat_thread
        if thread is not None:
            join_by = self._deadline(self._backend_timeout + self.settings.heartbeat_interval)
            thread.join(max(0.0, join_by - time.monotonic()))
        try:
            if self._aborted is None:  # nobody is left to tell
                self._update(self._leave, self._deadline(min(self._backend_timeout, 5.0)))
        except RendezvousError as exc:
            logger.warning("Node %s could not leave the rendezvous cleanly: %s", self.node_id, exc)
        finally:
            if self._owns:
                for resource in (self.backend, self.store):
                    try:
                        resource.close()
                    except Exception as exc:  # noqa: BLE001  (closing must not raise)
                        logger.warning("Closing %r failed: %s", resource, exc)

    # ------------------------------------------------------------------ mutators

    def _join_step(self, state: RendezvousState, joined: list[Optional[int]]) -> bool:
        if state.closed:
            return False
        me = self.node_id
        changed = self._housekeep(state)
        if state.complete:
            if me in state.participants and state.round == joined[0]:
                return changed  # our round completed
            if me in state.participants:
                # We ran in this round and ask for the next one.
                why = state.restart or f"node {me} asked for a new round after round {state.round}"
                self._open_round(state, why)
                changed = True
            else:
                if me not in state.wait_list:
                    state.wait_list.append(me)
                    changed = True
                return self._beat(state) or changed
        if me not in state.participants:
            state.participants.append(me)
            changed = True
        if me in state.wait_list:
            state.wait_list.remove(me)
            changed = True
        joined[0] = state.round
        changed = self._beat(state) or changed
        return self._try_complete(state) or changed

    def _heartbeat_step(self, state: RendezvousState) -> bool:
        changed = self._housekeep(state)
        if not state.complete:
            changed = self._try_complete(state) or changed
        return self._beat(state) or changed

    def _leave(self, state: RendezvousState) -> bool:
        me = self.node_id
        changed = False
        for name in ("wait_list", "expected"):
            items = getattr(state, name)
            if me in items:
                items.remove(me)
                changed = True
        if me in state.participants:
            if not state.complete:
                state.participants.remove(me)
                changed = True
            elif not state.closed and me not in state.dead:
                state.dead.append(me)
                state.restart = state.restart or f"node {me} left the rendezvous"
                changed = True
        if me in state.heartbeats and not (state.complete and me in state.participants):
            del state.heartbeats[me]
            changed = True
        return changed

    def _beat(self, state: RendezvousState) -> bool:
        # One write per interval at most: a join step refreshes only when the beat is stale.
        value = f"{self._nonce}.{self._beats}"
        if state.heartbeats.get(self.node_id) == value:
            return False
        state.heartbeats[self.node_id] = value
        return True

    def _housekeep(self, state: RendezvousState) -> bool:
        """Drop lapsed nodes from a forming round; mark lapsed participants of a running one."""
        if state.closed:
            return False
        changed = False
        if state.complete:
            for node in state.participants:
                if node not in state.dead and self._lapsed(node):
                    state.dead.append(node)
                    state.restart = state.restart or self._lapse_reason(node)
                    logger.warning("%s; round %s must restart", self._lapse_reason(node), state.round)
                    changed = True
        else:
            for node in [n for n in state.participants if self._lapsed(n)]:
                logger.warning("%s; dropping it from forming round %s", self._lapse_reason(node),
                               state.round)
                state.participants.remove(node)
                changed = True
            for node in [n for n in state.expected if self._lapsed(n)]:
                state.expected.remove(node)
                changed = True
            if state.min_reached_at is not None and len(state.participants) < self.settings.min_nodes:
                state.min_reached_at = None
                changed = True
        for node in [n for n in state.wait_list if self._lapsed(n)]:
            state.wait_list.remove(node)
            changed = True
        listed = set(state.participants) | set(state.wait_list) | set(state.expected)
        for node in [n for n in state.heartbeats if n not in listed and self._lapsed(n)]:
            del state.heartbeats[node]
            changed = True
        return changed

    def _try_complete(self, state: RendezvousState) -> bool:
        s = self.settings
        count = len(state.participants)
        now = time.time()
        changed = False
        if count >= s.min_nodes and state.min_reached_at is None:
            state.min_reached_at = now
            changed = True
        if count >= s.max_nodes:
            why = f"max_nodes={s.max_nodes} joined"
        elif count >= s.min_nodes:
            missing = [n for n in state.expected if n not in state.participants]
            last_call_over = now >= state.min_reached_at + s.last_call_timeout
            if state.expected and not missing:
                why = "every expected node is back"
            elif last_call_over and not missing:
                why = f"the last call of {s.last_call_timeout:g}s is over"
            elif last_call_over and now >= self._expected_deadline(state):
                why = f"expected nodes {missing} did not come back in time"
            else:
                return changed
        else:
            return changed
        state.complete = True
        state.participants = sorted(state.participants)
        state.wait_list = [n for n in state.wait_list if n not in state.participants]
        state.expected = []
        state.restart = None
        state.dead = []
        logger.info("Round %s of run %s completes with %d nodes (%s): %s", state.round,
                    s.run_id, count, why, state.participants)
        return True

    def _open_round(self, state: RendezvousState, reason: str) -> None:
        survivors = [n for n in state.participants if n not in state.dead and not self._lapsed(n)]
        waiters = [n for n in state.wait_list if not self._lapsed(n) and n not in survivors]
        state.lost = [n for n in state.participants if n not in survivors]
        state.round += 1
        state.complete = False
        state.participants = []
        state.expected = survivors + waiters
        state.wait_list = []
        state.opened_at = time.time()
        state.min_reached_at = None
        state.restart = None
        state.dead = []
        state.reason = reason
        logger.info("Node %s opens round %s of run %s: %s", self.node_id, state.round,
                    self.settings.run_id, reason)

    # ------------------------------------------------------------------ state access

    def _read(self) -> tuple[Optional[RendezvousState], Optional[Token]]:
        try:
            result = self.backend.get_state()
        except RendezvousError:
            self._backend_down = True
            raise
        if result is None:
            self._observe(None)
            return None, None
        raw, token = result
        state = RendezvousState.decode(raw)
        self._observe(state)
        return state, token

    def _update(
        self, mutate: Mutator, deadline: Optional[float] = None
    ) -> tuple[RendezvousState, Optional[Token]]:
        """Apply `mutate` by compare-and-set until it sticks; return the state and its token.

        Backend errors are retried until `deadline` (default: the backend timeout from now), so
        a short outage of etcd or the store only delays the update.
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
            try:
                if current is None:
                    current = self._read()
                state, token = current
                if state is None:
                    state = self._fresh_state()
                if not mutate(state):
                    return state, token
                result = self.backend.set_state(state.encode(), token)
            except RendezvousError as exc:
                if isinstance(exc, (RendezvousClosedError, RendezvousTimeoutError)):
                    raise
                self._backend_down = True
                if time.monotonic() >= deadline:
                    raise RendezvousError(
                        f"Node {self.node_id} could not update the rendezvous state of run "
                        f"{self.settings.run_id!r} on backend {self.backend.name!r} "
                        f"({attempt} attempts): {exc}"
                    ) from exc
                logger.debug("Rendezvous update failed (attempt %d), retrying: %s", attempt, exc)
                current = None
                time.sleep(min(0.05 * attempt, 0.5, max(0.0, deadline - time.monotonic())))
                continue
            if result is None:
                current = (None, None)
                continue
            raw, new_token, written = result
            new_state = RendezvousState.decode(raw)
            self._observe(new_state)
            if written:
                return new_state, new_token
            current = (new_state, new_token)

    def _fresh_state(self) -> RendezvousState:
        """The state to create when none is stored: round 0, or after ours if it vanished."""
        if self._round is None:
            return RendezvousState(opened_at=time.time())
        # The stored state disappeared (an etcd lease expired, the store was wiped): carry on
        # with a higher round number, so every node sees its own round as over.
        return RendezvousState(round=self._round + 1, opened_at=time.time(),
                               reason=self._vanished())

    def _vanished(self) -> str:
        return (f"the rendezvous state of run {self.settings.run_id!r} vanished from the "
                f"{self.backend.name} backend")

    def _observe(self, state: Optional[RendezvousState]) -> None:
        now = time.monotonic()
        with self._lock:
            blind = self._last_read is not None and (
                now - self._last_read > self.settings.heartbeat_timeout / 2)
            if self._backend_down or blind:
                # While the backend was away (calls failed, or were retried inside the backend
                # until it came back) nobody could write heartbeats: restart every clock.
                self._backend_down = False
                self._seen = {n: (v, now) for n, (v, _) in self._seen.items()}
            self._last_read = now
            if state is None:
                return
            nodes = (set(state.heartbeats) | set(state.participants) | set(state.wait_list)
                     | set(state.expected))
            seen = {}
            for node in nodes:
                value = state.heartbeats.get(node)
                old = self._seen.get(node)
                seen[node] = old if old is not None and old[0] == value else (value, now)
            self._seen = seen

    def _age(self, node: str) -> float:
        with self._lock:
            seen = self._seen.get(node)
        return 0.0 if seen is None else time.monotonic() - seen[1]

    def _lapsed(self, node: str) -> bool:
        return node != self.node_id and self._age(node) > self.settings.heartbeat_timeout

    def _lapse_reason(self, node: str) -> str:
        return (f"node {node} sent no heartbeat for {self._age(node):.1f}s "
                f"(heartbeat_timeout {self.settings.heartbeat_timeout:g}s)")

    def _expected_deadline(self, state: RendezvousState) -> float:
        s = self.settings
        return state.opened_at + s.last_call_timeout + s.heartbeat_timeout

    def _next_check(self, state: RendezvousState) -> float:
        """How long a joiner may wait for a change before re-checking deadlines itself."""
        wait = self.settings.heartbeat_interval
        if not state.complete and state.min_reached_at is not None:
            now = time.time()
            for at in (state.min_reached_at + self.settings.last_call_timeout,
                       self._expected_deadline(state)):
                if at > now:
                    wait = min(wait, at - now + 0.01)
        return max(wait, 0.01)

    # ------------------------------------------------------------------ round results

    def _finish(self, state: RendezvousState, took: float) -> RendezvousInfo:
        from shoal.collectives.store.prefix import PrefixStore

        with self._lock:
            self._round = state.round
            self._participants = list(state.participants)
        logger.info("Node %s joined round %s as node rank %d of %d after %.2fs", self.node_id,
                    state.round, state.participants.index(self.node_id), len(state.participants),
                    took)
        return RendezvousInfo(
            round=state.round,
            group_rank=state.participants.index(self.node_id),
            num_nodes=len(state.participants),
            participants=list(state.participants),
            store=PrefixStore(f"rdzv/{self.settings.run_id}/round_{state.round}", self.store),
        )

    def _give_up(self, state: RendezvousState) -> None:
        try:
            self._update(self._leave, time.monotonic() + min(self._backend_timeout, 5.0))
        except RendezvousError as exc:
            logger.warning("Node %s could not leave after its join timed out: %s", self.node_id, exc)
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
        if self._heartbeat_thread is not None:
            return
        thread = threading.Thread(
            target=self._heartbeat_loop, name=f"shoal-rdzv-heartbeat-{self.node_id}", daemon=True
        )
        thread.start()
        self._heartbeat_thread = thread

    def _heartbeat_loop(self) -> None:
        interval = self.settings.heartbeat_interval
        missed = 0
        while not self._stop.is_set():
            self._beats += 1
            try:
                self._update(self._heartbeat_step,
                             time.monotonic() + max(interval, min(self._backend_timeout, 5.0)))
            except RendezvousError as exc:
                # A missed beat is not fatal: the next one retries, and observers do not count
                # time the backend was away. One warning per outage, not one per beat: a long
                # outage would otherwise bury the line that says why it happened.
                if self._aborted is not None:
                    return
                missed += 1
                level = logging.WARNING if missed == 1 else logging.DEBUG
                logger.log(level, "Node %s missed a heartbeat (%d in a row; the next ones are "
                           "only logged when they resume): %s", self.node_id, missed, exc)
            except Exception:  # noqa: BLE001  (the thread must keep beating)
                logger.exception("Node %s's heartbeat failed unexpectedly", self.node_id)
            else:
                if missed:
                    logger.warning("Node %s's heartbeats resume after %d missed", self.node_id,
                                   missed)
                missed = 0
            self._stop.wait(interval)
