"""What a node does next in the rendezvous: pure decisions over one snapshot of the state.

Every operation of `RendezvousHandler` (join, keep-alive, liveness check, restart request,
close, leave) has a decision function here. It reads a `Context` (the state as last read, this
node, the settings, the time, whose heartbeats lapsed) and returns one `Action`: either a change
to make (`transitions.apply` makes it) or an outcome (wait, finish, done, an error). Nothing
here does I/O, reads a clock or takes a lock, so the rules are tested as a table
(tests/unit/elastic/rendezvous/test_rdzv_decisions.py), and the handler only syncs: read the state,
decide, apply, compare-and-set, and decide again on a conflict.

The shape is torch.distributed.elastic's dynamic_rendezvous (`_RendezvousJoinOp` returns an
`_Action`). One difference: the handler applies every change decided on one snapshot before
it writes (`transitions.settle`), so a step that joins, beats and completes a round costs one
compare-and-set, not three.

Rules of a round:

- It forms while nodes join, and completes at once when `max_nodes` joined; when every node it
  expects (the previous round's survivors and waiters) is back and `min_nodes` joined; or when
  `min_nodes` joined and the last call (`last_call_timeout` after the minimum was reached) is
  over. Expected nodes are awaited for at most `last_call_timeout + heartbeat_timeout` after
  the round opened. Ranks are the sorted node ids.
- A node that arrives while a round runs waits in the wait list. A participant that asks to
  join again after running in the complete round opens the next round.
- A node whose heartbeat lapsed is dropped from a forming round and the wait list, and marked
  dead in a running round (which must then restart).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Mapping, Optional

from shoal.elastic.api import RendezvousSettings
from shoal.elastic.rendezvous.state import RendezvousState

__all__ = [
    "Action", "ActionKind", "Context", "decide_close", "decide_join", "decide_keep_alive",
    "decide_leave", "decide_liveness", "decide_restart", "dead_nodes", "lapse_reason",
    "closer", "restart_reason", "waiting_count",
]

# A joiner re-checks a deadline this long after it passed, so that the check sees it over.
_PAST_DEADLINE_S = 0.01


class ActionKind(enum.Enum):
    """What a decision asks for: a change to the state, or an outcome that writes nothing."""

    # Changes (see transitions.apply).
    KEEP_ALIVE = "write this node's current heartbeat value"
    ADD_TO_PARTICIPANTS = "join the forming round"
    ADD_TO_WAIT_LIST = "wait for the running round to end"
    START_LAST_CALL = "note that min_nodes joined: the last call starts"
    CANCEL_LAST_CALL = "the forming round fell below min_nodes again"
    MARK_COMPLETE = "the forming round is complete; ranks are fixed"
    OPEN_ROUND = "end the running round and open the next"
    MARK_DEAD = "mark participants of the running round dead; it must restart"
    REMOVE_NODES = "drop nodes from every list (their heartbeat lapsed, or they leave)"
    REQUEST_RESTART = "ask every node of the running round to restart"
    MARK_CLOSED = "close the rendezvous: the job is over everywhere"
    # Outcomes.
    DONE = "nothing (more) to change"
    WAIT = "wait for a change or a deadline, then decide again"
    FINISH = "this node's round is complete"
    ERROR_CLOSED = "the rendezvous is closed"
    ERROR_TIMEOUT = "the join timed out"

    @property
    def changes_state(self) -> bool:
        """True for an action that `transitions.apply` turns into a new state."""
        return self not in _OUTCOMES


_OUTCOMES = frozenset({ActionKind.DONE, ActionKind.WAIT, ActionKind.FINISH,
                       ActionKind.ERROR_CLOSED, ActionKind.ERROR_TIMEOUT})


@dataclasses.dataclass(frozen=True)
class Action:
    """One decision: its kind, and what the kind needs to be carried out."""

    kind: ActionKind
    # MARK_DEAD, REMOVE_NODES: whom.
    nodes: tuple[str, ...] = ()
    # MARK_COMPLETE, OPEN_ROUND, MARK_DEAD, REQUEST_RESTART: why (stored, or logged);
    # MARK_CLOSED: how the job ended (CLOSED_AS).
    reason: Optional[str] = None
    # WAIT: seconds to wait at most before deciding again although nothing changed.
    wait: Optional[float] = None


DONE = Action(ActionKind.DONE)


@dataclasses.dataclass(frozen=True)
class Context:
    """Everything a decision reads: one snapshot, taken by the handler before deciding."""

    node: str
    settings: RendezvousSettings
    state: RendezvousState
    # Wall-clock seconds (time.time()): a round's opened_at and min_reached_at are stored as
    # wall-clock times, since every node reads them.
    now: float
    # Other nodes whose heartbeat value stood still for more than heartbeat_timeout on this
    # observer's clock -> for how many seconds. Never this node.
    lapsed: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # The value this node's heartbeat must have in the state (it changes every interval).
    heartbeat: str = ""
    # The round this node last ran in (returned by next_rendezvous), None before its first.
    last_round: Optional[int] = None

    def with_state(self, state: RendezvousState) -> "Context":
        """The same context over another state (the state after an applied action)."""
        return dataclasses.replace(self, state=state)


# ----------------------------------------------------------------------------- operations

def decide_join(ctx: Context, timed_out: bool) -> Action:
    """The next step of `next_rendezvous`; `timed_out` once its join_timeout passed."""
    state, me = ctx.state, ctx.node
    if state.closed:
        return Action(ActionKind.ERROR_CLOSED)
    cleanup = decide_liveness(ctx)
    if cleanup.kind is not ActionKind.DONE:
        return cleanup
    if state.complete:
        if me in state.participants:
            if state.round != ctx.last_round:
                return Action(ActionKind.FINISH)
            # This node ran in the round and asks for the next one (a restart, or a scale-up).
            why = state.restart or f"node {me} asked for a new round after round {state.round}"
            return Action(ActionKind.OPEN_ROUND, reason=why)
        if me not in state.wait_list:
            return Action(ActionKind.ADD_TO_WAIT_LIST)
        if _beat_is_stale(ctx):
            return Action(ActionKind.KEEP_ALIVE)
        return _wait_or_time_out(ctx, timed_out, ctx.settings.heartbeat_interval)
    if me not in state.participants:
        return Action(ActionKind.ADD_TO_PARTICIPANTS)
    if _beat_is_stale(ctx):
        return Action(ActionKind.KEEP_ALIVE)
    progress = _forming_round_progress(ctx)
    if progress is not None:
        return progress
    return _wait_or_time_out(ctx, timed_out, _forming_round_wait(ctx))


def decide_keep_alive(ctx: Context) -> Action:
    """One heartbeat: tidy up after lapsed nodes, move a forming round on, write the beat.

    A closed state still gets beats: on etcd every write renews the state's lease.
    """
    cleanup = decide_liveness(ctx)
    if cleanup.kind is not ActionKind.DONE:
        return cleanup
    if not ctx.state.complete and not ctx.state.closed:
        progress = _forming_round_progress(ctx)
        if progress is not None:
            return progress
    if _beat_is_stale(ctx):
        return Action(ActionKind.KEEP_ALIVE)
    return DONE


def decide_liveness(ctx: Context) -> Action:
    """Mark lapsed participants of a running round dead; drop lapsed nodes everywhere else."""
    state, lapsed = ctx.state, ctx.lapsed
    if state.closed:
        return DONE
    if state.complete:
        newly_dead = tuple(n for n in state.participants if n in lapsed and n not in state.dead)
        if newly_dead:
            first = newly_dead[0]
            return Action(ActionKind.MARK_DEAD, nodes=newly_dead,
                          reason=lapse_reason(first, lapsed[first], ctx.settings))
    # A running round's participants stay listed (marked dead); any other lapsed node goes.
    droppable = [*(() if state.complete else state.participants), *state.expected,
                 *state.wait_list, *_unlisted(state)]
    gone = tuple(dict.fromkeys(n for n in droppable if n in lapsed))
    if gone:
        return Action(ActionKind.REMOVE_NODES, nodes=gone)
    if (not state.complete and state.min_reached_at is not None
            and len(state.participants) < ctx.settings.min_nodes):
        return Action(ActionKind.CANCEL_LAST_CALL)
    return DONE


def decide_restart(ctx: Context, reason: str) -> Action:
    """Ask for a restart of this node's running round, unless it is over or already asked."""
    state = ctx.state
    if state.closed or not state.complete or state.round != ctx.last_round:
        return DONE  # the round is already over
    if state.restart is not None:
        return DONE  # the first reason stands
    return Action(ActionKind.REQUEST_RESTART, reason=reason)


CLOSED_AS = ("finished", "failed")


def closer(state: RendezvousState) -> str:
    """' by node X (its job finished)' for a closed state, or '' when nobody is named."""
    if not state.closed_by:
        return ""
    how = {"finished": "its job finished", "failed": "its job failed"}.get(
        state.closed_as or "", f"as {state.closed_as!r}")
    return f" by node {state.closed_by} ({how})"


def decide_close(ctx: Context, how: str = "finished") -> Action:
    """Close the rendezvous once, saying how the job ended ("finished" or "failed")."""
    return DONE if ctx.state.closed else Action(ActionKind.MARK_CLOSED, reason=how)


def decide_leave(ctx: Context) -> Action:
    """Leave: a participant of a running round is marked dead (the round restarts without
    it); anywhere else the node is dropped."""
    state, me = ctx.state, ctx.node
    if state.complete and me in state.participants:
        if state.closed or me in state.dead:
            return DONE
        return Action(ActionKind.MARK_DEAD, nodes=(me,), reason=f"node {me} left the rendezvous")
    if (me in state.participants or me in state.expected or me in state.wait_list
            or me in state.heartbeats):
        return Action(ActionKind.REMOVE_NODES, nodes=(me,))
    return DONE


# ----------------------------------------------------------------------------- queries

def waiting_count(ctx: Context) -> int:
    """Alive nodes waiting for the next round while the current one runs (0 if it is full)."""
    state = ctx.state
    if not state.complete or state.closed or len(state.participants) >= ctx.settings.max_nodes:
        return 0
    return sum(1 for n in state.wait_list if n not in ctx.lapsed)


def restart_reason(ctx: Context) -> Optional[str]:
    """Why the round this node runs in (`ctx.last_round`) must end, or None."""
    state = ctx.state
    if state.closed:
        return f"the rendezvous of run {ctx.settings.run_id!r} was closed{closer(state)}"
    if state.round != ctx.last_round:
        return state.reason or f"round {state.round} of the rendezvous started"
    return state.restart


def dead_nodes(ctx: Context, participants: tuple[str, ...]) -> list[str]:
    """Which of `participants` (of round `ctx.last_round`) were declared dead or lapsed."""
    state = ctx.state
    if state.round == ctx.last_round:
        dead = set(state.dead)
    elif ctx.last_round is not None and state.round == ctx.last_round + 1:
        dead = set(state.lost)  # the next round already opened: its `lost` names them
    else:
        dead = set()
    dead.update(n for n in participants if n in ctx.lapsed)
    return [n for n in participants if n in dead]


def lapse_reason(node: str, age: float, settings: RendezvousSettings) -> str:
    """The sentence that says a node's heartbeat lapsed."""
    return (f"node {node} sent no heartbeat for {age:.1f}s "
            f"(heartbeat_timeout {settings.heartbeat_timeout:g}s)")


# ----------------------------------------------------------------------------- helpers

def _beat_is_stale(ctx: Context) -> bool:
    # One write per interval at most: a step refreshes the beat only when its value is old.
    return ctx.state.heartbeats.get(ctx.node) != ctx.heartbeat


def _unlisted(state: RendezvousState) -> list[str]:
    """Nodes with a heartbeat that no list names any more."""
    listed = {*state.participants, *state.wait_list, *state.expected}
    return [n for n in state.heartbeats if n not in listed]


def _wait_or_time_out(ctx: Context, timed_out: bool, wait: float) -> Action:
    if timed_out:
        return Action(ActionKind.ERROR_TIMEOUT)
    return Action(ActionKind.WAIT, wait=wait)


def _forming_round_progress(ctx: Context) -> Optional[Action]:
    """Start the last call once min_nodes joined; complete the round when a rule allows."""
    state, cfg = ctx.state, ctx.settings
    if len(state.participants) < cfg.min_nodes:
        return None
    if state.min_reached_at is None:
        return Action(ActionKind.START_LAST_CALL)
    why = _completion_reason(ctx)
    return None if why is None else Action(ActionKind.MARK_COMPLETE, reason=why)


def _completion_reason(ctx: Context) -> Optional[str]:
    state, cfg, now = ctx.state, ctx.settings, ctx.now
    if len(state.participants) >= cfg.max_nodes:
        return f"max_nodes={cfg.max_nodes} joined"
    missing = [n for n in state.expected if n not in state.participants]
    last_call_over = now >= state.min_reached_at + cfg.last_call_timeout
    if state.expected and not missing:
        return "every expected node is back"
    if last_call_over and not missing:
        return f"the last call of {cfg.last_call_timeout:g}s is over"
    if last_call_over and now >= _expected_deadline(ctx):
        return f"expected nodes {missing} did not come back in time"
    return None


def _expected_deadline(ctx: Context) -> float:
    """Until when a forming round waits for the nodes it expects (wall clock)."""
    cfg = ctx.settings
    return ctx.state.opened_at + cfg.last_call_timeout + cfg.heartbeat_timeout


def _forming_round_wait(ctx: Context) -> float:
    """How long a joiner may wait for a change before re-checking the round's deadlines."""
    state, cfg = ctx.state, ctx.settings
    wait = cfg.heartbeat_interval
    if state.min_reached_at is not None:
        for at in (state.min_reached_at + cfg.last_call_timeout, _expected_deadline(ctx)):
            if at > ctx.now:
                wait = min(wait, at - ctx.now + _PAST_DEADLINE_S)
    return max(wait, _PAST_DEADLINE_S)
