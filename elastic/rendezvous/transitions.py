"""How each decided action changes the rendezvous state, and the settling of one step.

`apply` is pure: a new state from a context and an action, the old one untouched. `settle`
applies decisions to a snapshot until the decision is an outcome, so the handler writes the
whole step with one compare-and-set (and redoes it from the newer state on a conflict).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from shoal.elastic.rendezvous.decisions import Action, ActionKind, Context
from shoal.elastic.rendezvous.state import RendezvousState

__all__ = ["Plan", "apply", "settle"]

# No rule takes more changes than this in one step (a join can drop dead nodes, open a round,
# join it, beat, start the last call and complete it); more means two rules undo each other.
MAX_CHANGES_PER_STEP = 16


def _without(items: tuple[str, ...], nodes) -> tuple[str, ...]:
    return tuple(n for n in items if n not in nodes)


def _keep_alive(ctx: Context, action: Action) -> RendezvousState:
    return dataclasses.replace(ctx.state, heartbeats={**ctx.state.heartbeats,
                                                      ctx.node: ctx.heartbeat})


def _add_to_participants(ctx: Context, action: Action) -> RendezvousState:
    state = ctx.state
    return dataclasses.replace(state, participants=(*state.participants, ctx.node),
                               wait_list=_without(state.wait_list, {ctx.node}))


def _add_to_wait_list(ctx: Context, action: Action) -> RendezvousState:
    return dataclasses.replace(ctx.state, wait_list=(*ctx.state.wait_list, ctx.node))


def _start_last_call(ctx: Context, action: Action) -> RendezvousState:
    return dataclasses.replace(ctx.state, min_reached_at=ctx.now)


def _cancel_last_call(ctx: Context, action: Action) -> RendezvousState:
    return dataclasses.replace(ctx.state, min_reached_at=None)


def _mark_complete(ctx: Context, action: Action) -> RendezvousState:
    state = ctx.state
    ranked = tuple(sorted(state.participants))  # ranks are the sorted node ids
    return dataclasses.replace(state, complete=True, participants=ranked,
                               wait_list=_without(state.wait_list, ranked), expected=(),
                               restart=None, dead=())


def _open_round(ctx: Context, action: Action) -> RendezvousState:
    # Lapsed participants are marked dead and lapsed waiters dropped before any decision opens
    # a round (decide_liveness comes first), so the dead list says who does not carry over.
    state = ctx.state
    survivors = _without(state.participants, state.dead)
    waiters = _without(state.wait_list, survivors)
    return dataclasses.replace(
        state, round=state.round + 1, complete=False, participants=(),
        expected=survivors + waiters, wait_list=(), opened_at=ctx.now, min_reached_at=None,
        restart=None, dead=(), reason=action.reason,
        lost=_without(state.participants, survivors))


def _mark_dead(ctx: Context, action: Action) -> RendezvousState:
    state = ctx.state
    return dataclasses.replace(state, dead=(*state.dead, *action.nodes),
                               restart=state.restart or action.reason)


def _remove_nodes(ctx: Context, action: Action) -> RendezvousState:
    state, gone = ctx.state, set(action.nodes)
    return dataclasses.replace(
        state, participants=_without(state.participants, gone),
        expected=_without(state.expected, gone), wait_list=_without(state.wait_list, gone),
        heartbeats={n: v for n, v in state.heartbeats.items() if n not in gone})


def _request_restart(ctx: Context, action: Action) -> RendezvousState:
    return dataclasses.replace(ctx.state, restart=action.reason)


def _mark_closed(ctx: Context, action: Action) -> RendezvousState:
    return dataclasses.replace(ctx.state, closed=True, closed_by=ctx.node,
                               closed_as=action.reason or "finished")


_APPLY: dict[ActionKind, Callable[[Context, Action], RendezvousState]] = {
    ActionKind.KEEP_ALIVE: _keep_alive,
    ActionKind.ADD_TO_PARTICIPANTS: _add_to_participants,
    ActionKind.ADD_TO_WAIT_LIST: _add_to_wait_list,
    ActionKind.START_LAST_CALL: _start_last_call,
    ActionKind.CANCEL_LAST_CALL: _cancel_last_call,
    ActionKind.MARK_COMPLETE: _mark_complete,
    ActionKind.OPEN_ROUND: _open_round,
    ActionKind.MARK_DEAD: _mark_dead,
    ActionKind.REMOVE_NODES: _remove_nodes,
    ActionKind.REQUEST_RESTART: _request_restart,
    ActionKind.MARK_CLOSED: _mark_closed,
}


def apply(ctx: Context, action: Action) -> RendezvousState:
    """The state after `action`; `ctx.state` is left as it was.

    Raises:
        ValueError: `action` is an outcome, which changes nothing.
    """
    change = _APPLY.get(action.kind)
    if change is None:
        raise ValueError(f"{action.kind.name} is an outcome, not a change of the state.")
    return change(ctx, action)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One settled step: the state to write, each change with the state it made, the outcome."""

    state: RendezvousState
    changes: tuple[tuple[Action, RendezvousState], ...]
    outcome: Action


def settle(ctx: Context, decide: Callable[[Context], Action]) -> Plan:
    """Apply `decide`'s changes to `ctx.state` until it answers with an outcome.

    Raises:
        RuntimeError: the decisions did not settle within MAX_CHANGES_PER_STEP changes.
    """
    changes: list[tuple[Action, RendezvousState]] = []
    while True:
        action = decide(ctx)
        if not action.kind.changes_state:
            return Plan(ctx.state, tuple(changes), action)
        if len(changes) == MAX_CHANGES_PER_STEP:
            raise RuntimeError(
                f"Rendezvous decisions for node {ctx.node} did not settle after "
                f"{MAX_CHANGES_PER_STEP} changes ({', '.join(a.kind.name for a, _ in changes)}).")
        ctx = ctx.with_state(apply(ctx, action))
        changes.append((action, ctx.state))
