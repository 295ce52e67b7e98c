"""What the rendezvous handler tells operators: whom a forming round waits for, and the
changes a written step made that someone wants to know about."""

from __future__ import annotations

import logging
import time
from typing import Optional

from shoal.elastic.api import RendezvousSettings
from shoal.elastic.rendezvous import decisions, transitions
from shoal.elastic.rendezvous.decisions import ActionKind
from shoal.elastic.rendezvous.state import RendezvousState

# These are the handler's news: they keep its logger, which operators (and tests) filter by.
logger = logging.getLogger("shoal.elastic.rendezvous.handler")


def waiting_for(state: Optional[RendezvousState], node_id: str,
                settings: RendezvousSettings, last_round: Optional[int] = None) -> str:
    """What a joining node waits for, from the last state it read and the round it last ran
    (`last_round`): a state no newer than that round is the node's own, now over, round."""
    run = repr(settings.run_id)
    if last_round is not None and (state is None or state.round <= last_round):
        return f"to meet again after round {last_round} of run {run}, the round it ran"
    if state is None:
        return f"for the first round of run {run} to form (no state read yet)"
    if state.complete and node_id not in state.participants:
        return (f"for round {state.round} of run {run} to end before joining (it runs "
                f"with {len(state.participants)} nodes)")
    if state.complete:
        return f"for round {state.round} of run {run} to start"
    have = list(state.participants)
    return (f"for round {state.round} of run {run} to form ({len(have)} of "
            f"min_nodes={settings.min_nodes} joined: {', '.join(have) or 'none'})")


class WaitingLog:
    """While a round forms, say every so often whom it waits for (joins can take minutes)."""

    def __init__(self, node_id: str, settings: RendezvousSettings):
        self._node_id = node_id
        self._settings = settings
        self._logged_at: Optional[float] = None

    def reset(self) -> None:
        """A join ended: the next one reports at once."""
        self._logged_at = None

    def note(self, state: RendezvousState, started: float) -> None:
        """Log whom the round waits for, unless that was logged lately."""
        now = time.monotonic()
        s = self._settings
        every = max(5.0, min(30.0, s.join_timeout / 20))
        if self._logged_at is not None and now - self._logged_at < every:
            return
        self._logged_at = now
        have = list(state.participants)
        if state.complete:
            logger.info("Node %s waits for round %s of run %s to end before joining (it runs "
                        "with %d nodes); waited %.0fs of %gs", self._node_id, state.round,
                        s.run_id, len(have), now - started, s.join_timeout)
            return
        missing = max(0, s.min_nodes - len(have))
        if missing:
            logger.info("Node %s: waiting for %d more node(s) (have %d of min %d: %s) in round %s "
                        "of run %s; waited %.0fs of %gs", self._node_id, missing, len(have),
                        s.min_nodes, ", ".join(have) or "none", state.round, s.run_id,
                        now - started, s.join_timeout)


def log_changes(plan: transitions.Plan, lapsed: dict, node_id: str,
                settings: RendezvousSettings) -> None:
    """Say what a written step changed that an operator wants to know."""
    for action, after in plan.changes:
        kind = action.kind
        if kind is ActionKind.MARK_DEAD and node_id not in action.nodes:
            for node in action.nodes:
                logger.warning("%s; round %s must restart",
                               decisions.lapse_reason(node, lapsed[node], settings), after.round)
        elif kind is ActionKind.REMOVE_NODES and node_id not in action.nodes:
            for node in action.nodes:
                logger.warning("%s; dropping it from round %s",
                               decisions.lapse_reason(node, lapsed[node], settings), after.round)
        elif kind is ActionKind.MARK_COMPLETE:
            logger.info("Round %s of run %s completes with %d nodes (%s): %s", after.round,
                        settings.run_id, len(after.participants), action.reason,
                        list(after.participants))
        elif kind is ActionKind.OPEN_ROUND:
            logger.info("Node %s opens round %s of run %s: %s", node_id, after.round,
                        settings.run_id, action.reason)
