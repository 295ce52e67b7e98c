"""How long a joining node keeps trying a backend that does not answer.

A joining node gives an unreachable backend `join_outage_timeout` seconds, counted from its last
answer or from the start of the join, whichever is later, then gives up with a
RendezvousUnreachableError: a dead etcd must read as an error, not as a join that hangs for the
whole join timeout. The joining thread's calls are bounded by that budget where the backend can
be told (`bound_calls`, etcd), and by a few seconds each, so an outage is reported soon after it
began. Only the joining thread gives up; other threads' calls (heartbeats) just fail.

A join after a round ended starts when the round ends, not when `next_rendezvous` is called:
the agent's way there (settling a failure, claiming the round, counting the restart, asking the
others to restart) makes store and backend calls, and these share the join's budget (the
store's calls too, where it can be bounded: etcd), so a dead etcd ends the agent
`join_outage_timeout` after the round ended, not that long after a failure path that waited
out each call's own timeout (issue 34: 125 s for a documented 60 s). An outage noticed (a call
failed) before the join began is counted from the last answer, as documented.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from shoal.elastic.api import RendezvousBackend, RendezvousError, RendezvousUnreachableError

logger = logging.getLogger(__name__)

# A joining node's backend calls end within this long (less for a short join_outage_timeout),
# so that an outage is reported soon after it began; a call cut short is simply retried.
OUTAGE_NOTICE_S = 5.0


class JoinOutage:
    """One handler's record of when its backend last answered and of the join in progress.

    Args:
        backend: the rendezvous backend (its `describe()` names it in messages).
        node_id: this node's id, for messages.
        grace: join_outage_timeout, in seconds.
    """

    def __init__(self, backend: RendezvousBackend, node_id: str, grace: float, store=None):
        self._backend = backend
        self._store = store  # its calls are bounded by the budget too, where it can be
        self._node_id = node_id
        self._grace = grace
        # When the backend last answered (time.monotonic(), any thread) and when the current
        # join began (None outside a join): a join's outage counts from the later, unless a
        # call failed before the join began (`_failing_since`, reset by an answer).
        self._contact = time.monotonic()
        self._failing_since: Optional[float] = None
        self._joining_since: Optional[float] = None
        self._join_thread: Optional[threading.Thread] = None
        self._warned_at: Optional[float] = None  # the contact time an outage was logged for

    def answered(self) -> None:
        """The backend answered just now (any thread)."""
        self._contact = time.monotonic()
        self._failing_since = None

    def failed(self) -> None:
        """A backend call failed just now (any thread)."""
        if self._failing_since is None:
            self._failing_since = time.monotonic()

    def begin_join(self) -> None:
        """The calling thread starts a join, or goes on with the one it began (a round ended,
        and the agent's calls on its way to the next join count as part of it)."""
        me = threading.current_thread()
        if self._join_thread is me and self._joining_since is not None:
            return
        self._joining_since, self._join_thread = time.monotonic(), me
        self._bound_store(self.deadline)

    def end_join(self) -> None:
        """The join is over: unbound the backend's and the store's calls again."""
        self._joining_since, self._join_thread = None, None
        self.bound_calls(None)
        self._bound_store(None)

    def _bound_store(self, until: Optional[Callable[[], float]]) -> None:
        # The store's calls are not retried here (the agent's are each one attempt): bound
        # them by the outage deadline only, not by the short per-call step of call_bound.
        bound = getattr(self._store, "bound_calls", None)
        if bound is not None:
            bound(until)

    def in_join(self) -> bool:
        """Whether the calling thread is the joining one."""
        return self._join_thread is threading.current_thread()

    def _since(self) -> float:
        joining, failing = self._joining_since, self._failing_since
        if joining is not None and failing is not None and failing <= joining:
            return self._contact  # the outage began before this join: from the last answer
        return max(self._contact, joining or self._contact)

    def deadline(self) -> float:
        """When a join gives up on a backend that does not answer (time.monotonic())."""
        return self._since() + self._grace

    def call_bound(self) -> float:
        """When the joining thread's next backend call must end: by the outage deadline, and
        within a few seconds, so that an outage is reported (and retried) soon after it began."""
        step = max(1.0, min(OUTAGE_NOTICE_S, self._grace / 4))
        return min(self.deadline(), time.monotonic() + step)

    def bound_calls(self, until: Optional[float]) -> None:
        """Bound this thread's backend calls by `until` where the backend supports it."""
        bound = getattr(self._backend, "bound_calls", None)
        if bound is not None:
            bound(until)

    def check(self, exc: RendezvousError, waiting: str,
              abort: Callable[[RendezvousError], None]) -> None:
        """A joining call failed: warn once per outage, and give up once it outlasted the
        grace (`abort` then stops the handler, so heartbeats stop and nobody retries).

        Raises:
            RendezvousUnreachableError: the outage outlasted join_outage_timeout.
        """
        since = self._since()
        away = time.monotonic() - since
        if away < self._grace:
            if self._warned_at != since:
                self._warned_at = since
                logger.warning("%s does not answer while node %s waits %s; giving up in %.0fs "
                               "unless it comes back (join_outage_timeout=%gs): %s",
                               self._backend.describe(), self._node_id, waiting,
                               self._grace - away, self._grace, exc)
            return
        error = RendezvousUnreachableError(
            f"{self._backend.describe()} was unreachable for {away:.0f}s "
            f"(join_outage_timeout={self._grace:g}s) while node {self._node_id} waited "
            f"{waiting}; giving up the join."
        )
        logger.debug("The last failed call before giving up: %s", exc)
        abort(error)
        raise error from exc
