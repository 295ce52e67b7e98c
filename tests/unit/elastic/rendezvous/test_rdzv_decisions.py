"""The rendezvous rules as a table: (operation, state, this node's view) -> the decided action.

Every row is one branch of `elastic.rendezvous.decisions`; the test at the end checks that the
table names every kind of action. Then `transitions`: what each change does to a state, and a
whole step settled into one write.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import pytest

from shoal.elastic.api import RendezvousSettings
from shoal.elastic.rendezvous import transitions
from shoal.elastic.rendezvous.decisions import (
    Action,
    ActionKind as K,
    Context,
    dead_nodes,
    decide_close,
    decide_join,
    decide_keep_alive,
    decide_leave,
    decide_liveness,
    decide_restart,
    restart_reason,
    waiting_count,
)
from shoal.elastic.rendezvous.state import RendezvousState

ME = "a"
BEAT = "nonce.7"  # this node's current heartbeat value
NOW = 1000.0
OPENED = NOW - 1.0
SETTINGS = RendezvousSettings(run_id="job", min_nodes=2, max_nodes=3, last_call_timeout=2.0,
                              join_timeout=60.0, heartbeat_interval=1.0, heartbeat_timeout=5.0)
LAPSE_S = 6.5  # how long a lapsed node's heartbeat stood still


def forming(*participants: str, beat: Optional[str] = BEAT, **fields) -> RendezvousState:
    """Round 3 while it forms; this node's heartbeat is current unless `beat` says otherwise."""
    heartbeats = {} if beat is None else {ME: beat}
    heartbeats.update(fields.pop("heartbeats", {}))
    fields.setdefault("opened_at", OPENED)
    return RendezvousState(round=3, participants=participants, heartbeats=heartbeats, **fields)


def running(*participants: str, **fields) -> RendezvousState:
    """Round 3 once complete."""
    return dataclasses.replace(forming(*participants, **fields), complete=True)


OPERATIONS = {
    "join": lambda ctx: decide_join(ctx, timed_out=False),
    "join, timed out": lambda ctx: decide_join(ctx, timed_out=True),
    "keep-alive": decide_keep_alive,
    "liveness": decide_liveness,
    "restart": lambda ctx: decide_restart(ctx, "worker 1 failed"),
    "close": decide_close,
    "close-failed": lambda ctx: decide_close(ctx, "failed"),
    "leave": decide_leave,
}


class Row(NamedTuple):
    operation: str
    state: RendezvousState
    expected: Action
    lapsed: tuple[str, ...] = ()
    last_round: Optional[int] = None  # the round this node last ran in
    now: float = NOW


def act(kind: K, **payload) -> Action:
    return Action(kind, **payload)


def gone(node: str) -> str:
    return f"node {node} sent no heartbeat for {LAPSE_S:.1f}s (heartbeat_timeout 5s)"


WAIT_INTERVAL = act(K.WAIT, wait=1.0)

ROWS = {
    # ---------------------------------------------------------------- join
    "join: a closed rendezvous is an error":
        Row("join", dataclasses.replace(forming(), closed=True), act(K.ERROR_CLOSED)),
    "join: clean up after lapsed nodes first":
        Row("join", running("a", "b"), act(K.MARK_DEAD, nodes=("b",), reason=gone("b")),
            lapsed=("b",)),
    "join: our round completed":
        Row("join", running("a", "b"), act(K.FINISH), last_round=2),
    "join: we ran in this round: open the next, saying why it restarts":
        Row("join", running("a", "b", restart="worker 1 failed"),
            act(K.OPEN_ROUND, reason="worker 1 failed"), last_round=3),
    "join: we ran in this round and nobody asked: we ask":
        Row("join", running("a", "b"),
            act(K.OPEN_ROUND, reason="node a asked for a new round after round 3"), last_round=3),
    "join: a round runs without us: wait in the wait list":
        Row("join", running("b", "c"), act(K.ADD_TO_WAIT_LIST)),
    "join: waiting, our heartbeat is old":
        Row("join", running("b", "c", wait_list=("a",), beat="nonce.6"), act(K.KEEP_ALIVE)),
    "join: waiting for the running round to end":
        Row("join", running("b", "c", wait_list=("a",)), WAIT_INTERVAL),
    "join: waiting, out of time":
        Row("join, timed out", running("b", "c", wait_list=("a",)), act(K.ERROR_TIMEOUT)),
    "join: a round forms without us: join it":
        Row("join", forming("b"), act(K.ADD_TO_PARTICIPANTS)),
    "join: in the forming round, our heartbeat is missing":
        Row("join", forming("b", "a", beat=None), act(K.KEEP_ALIVE)),
    "join: min_nodes joined: the last call starts":
        Row("join", forming("b", "a"), act(K.START_LAST_CALL)),
    "join: max_nodes joined: complete at once":
        Row("join", forming("c", "a", "b", min_reached_at=NOW),
            act(K.MARK_COMPLETE, reason="max_nodes=3 joined")),
    "join: every expected node is back: complete before the last call ends":
        Row("join", forming("b", "a", expected=("a", "b"), min_reached_at=NOW),
            act(K.MARK_COMPLETE, reason="every expected node is back")),
    "join: the last call is over":
        Row("join", forming("b", "a", min_reached_at=NOW - 2.0),
            act(K.MARK_COMPLETE, reason="the last call of 2s is over")),
    "join: expected nodes did not come back in time":
        Row("join", forming("b", "a", expected=("a", "c"), min_reached_at=NOW - 2.0,
                            opened_at=NOW - 7.0),
            act(K.MARK_COMPLETE, reason="expected nodes ['c'] did not come back in time")),
    "join: the last call is over, an expected node may still come: wait for its deadline":
        Row("join", forming("b", "a", expected=("a", "c"), min_reached_at=NOW - 2.0,
                            opened_at=NOW - 6.5), act(K.WAIT, wait=0.51)),
    "join: the last call runs: wait for its end":
        Row("join", forming("b", "a", min_reached_at=NOW - 1.75), act(K.WAIT, wait=0.26)),
    "join: fewer than min_nodes: wait":
        Row("join", forming("a"), WAIT_INTERVAL),
    "join: fewer than min_nodes, out of time":
        Row("join, timed out", forming("a"), act(K.ERROR_TIMEOUT)),
    # ---------------------------------------------------------------- keep-alive
    "keep-alive: clean up after lapsed nodes first":
        Row("keep-alive", forming("a", "b"), act(K.REMOVE_NODES, nodes=("b",)), lapsed=("b",)),
    "keep-alive: moves a forming round on (its joiners may all be waiting)":
        Row("keep-alive", forming("a", "b", min_reached_at=NOW - 2.0),
            act(K.MARK_COMPLETE, reason="the last call of 2s is over")),
    "keep-alive: a closed round does not complete, but the beat is still written":
        Row("keep-alive", forming("a", "b", closed=True, beat="nonce.6"), act(K.KEEP_ALIVE)),
    "keep-alive: write the beat":
        Row("keep-alive", running("a", "b", beat="nonce.6"), act(K.KEEP_ALIVE)),
    "keep-alive: the beat is current":
        Row("keep-alive", running("a", "b"), act(K.DONE)),
    # ---------------------------------------------------------------- liveness
    "liveness: nothing to check once closed":
        Row("liveness", running("a", "b", closed=True), act(K.DONE), lapsed=("b",)),
    "liveness: lapsed participants of a running round are dead; the first names the reason":
        Row("liveness", running("a", "b", "c"),
            act(K.MARK_DEAD, nodes=("b", "c"), reason=gone("b")), lapsed=("b", "c")),
    "liveness: a participant already dead stays listed":
        Row("liveness", running("a", "b", dead=("b",)), act(K.DONE), lapsed=("b",)),
    "liveness: a lapsed waiter is dropped":
        Row("liveness", running("a", "b", wait_list=("c",)), act(K.REMOVE_NODES, nodes=("c",)),
            lapsed=("c",)),
    "liveness: lapsed joiners and expected nodes leave a forming round":
        Row("liveness", forming("a", "b", expected=("c",)),
            act(K.REMOVE_NODES, nodes=("b", "c")), lapsed=("b", "c")),
    "liveness: a lapsed heartbeat of a node no list names is dropped":
        Row("liveness", running("a", "b", heartbeats={"z": "z.1"}),
            act(K.REMOVE_NODES, nodes=("z",)), lapsed=("z",)),
    "liveness: below min_nodes again: the last call is off":
        Row("liveness", forming("a", min_reached_at=NOW - 1), act(K.CANCEL_LAST_CALL)),
    "liveness: everyone alive":
        Row("liveness", running("a", "b"), act(K.DONE)),
    # ---------------------------------------------------------------- restart
    "restart: not once closed":
        Row("restart", running("a", "b", closed=True), act(K.DONE), last_round=3),
    "restart: not while a round forms":
        Row("restart", forming("a", "b"), act(K.DONE), last_round=3),
    "restart: not once a newer round runs":
        Row("restart", running("a", "b"), act(K.DONE), last_round=2),
    "restart: the first reason stands":
        Row("restart", running("a", "b", restart="node b left the rendezvous"), act(K.DONE),
            last_round=3),
    "restart: ask":
        Row("restart", running("a", "b"), act(K.REQUEST_RESTART, reason="worker 1 failed"),
            last_round=3),
    # ---------------------------------------------------------------- close
    "close: once":
        Row("close", running("a", "b"), act(K.MARK_CLOSED, reason="finished")),
    "close: says the job failed when it did":
        Row("close-failed", running("a", "b"), act(K.MARK_CLOSED, reason="failed")),
    "close: already closed":
        Row("close", running("a", "b", closed=True), act(K.DONE)),
    # ---------------------------------------------------------------- leave
    "leave: a participant of a running round is dead, and the round restarts":
        Row("leave", running("a", "b"),
            act(K.MARK_DEAD, nodes=("a",), reason="node a left the rendezvous"), last_round=3),
    "leave: a closed round needs no restart":
        Row("leave", running("a", "b", closed=True), act(K.DONE), last_round=3),
    "leave: already marked dead":
        Row("leave", running("a", "b", dead=("a",)), act(K.DONE), last_round=3),
    "leave: a forming round drops us":
        Row("leave", forming("a", "b"), act(K.REMOVE_NODES, nodes=("a",))),
    "leave: the wait list drops us":
        Row("leave", running("b", "c", wait_list=("a",)), act(K.REMOVE_NODES, nodes=("a",))),
    "leave: only our heartbeat is left to drop":
        Row("leave", running("b", "c"), act(K.REMOVE_NODES, nodes=("a",))),
    "leave: nothing of us is left":
        Row("leave", running("b", "c", beat=None), act(K.DONE)),
}


def context(row: Row) -> Context:
    return Context(node=ME, settings=SETTINGS, state=row.state, now=row.now,
                   lapsed={n: LAPSE_S for n in row.lapsed}, heartbeat=BEAT,
                   last_round=row.last_round)


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_decision_table(row: Row):
    ctx = context(row)
    before = row.state.encode()
    decided = OPERATIONS[row.operation](ctx)
    if row.expected.wait is not None and decided.wait is not None:
        decided = dataclasses.replace(decided, wait=round(decided.wait, 6))
    assert decided == row.expected
    assert row.state.encode() == before  # a decision never changes its snapshot


def test_the_table_names_every_action_and_operation():
    assert {row.expected.kind for row in ROWS.values()} == set(K)
    assert {row.operation for row in ROWS.values()} == set(OPERATIONS)


# ----------------------------------------------------------------------------- queries

@pytest.mark.parametrize("state, lapsed, count", [
    (forming("a", wait_list=("c",)), (), 0),                # nothing runs yet
    (running("a", "b", wait_list=("c",), closed=True), (), 0),
    (running("a", "b", "d", wait_list=("c",)), (), 0),      # full: max_nodes=3 run
    (running("a", "b", wait_list=("c", "d")), ("d",), 1),   # the lapsed one does not count
])
def test_waiting_count(state, lapsed, count):
    assert waiting_count(context(Row("", state, act(K.DONE), lapsed))) == count


@pytest.mark.parametrize("state, last_round, reason", [
    (running("a", closed=True), 3, "the rendezvous of run 'job' was closed"),
    (forming("a", reason="node b asked for a new round after round 2"), 2,
     "node b asked for a new round after round 2"),
    (forming("a"), 2, "round 3 of the rendezvous started"),
    (running("a", "b", restart="worker 1 failed"), 3, "worker 1 failed"),
    (running("a", "b"), 3, None),
])
def test_restart_reason(state, last_round, reason):
    assert restart_reason(context(Row("", state, act(K.DONE), (), last_round))) == reason


@pytest.mark.parametrize("state, lapsed, last_round, dead", [
    (running("a", "b", "c", dead=("c",)), (), 3, ["c"]),
    (forming("a", lost=("b",)), (), 2, ["b"]),              # the next round names who was lost
    (forming("a", lost=("b",)), (), 1, []),                 # a round long gone says nothing
    (running("a", "b", "c"), ("b",), 3, ["b"]),             # lapsed, not yet marked
])
def test_dead_nodes(state, lapsed, last_round, dead):
    ctx = context(Row("", state, act(K.DONE), lapsed, last_round))
    assert dead_nodes(ctx, ("a", "b", "c")) == dead


# ----------------------------------------------------------------------------- transitions

def applied(state: RendezvousState, action: Action, lapsed=()) -> RendezvousState:
    return transitions.apply(context(Row("", state, action, lapsed)), action)


def test_each_change_of_the_state():
    s = applied(forming("b", beat=None), act(K.KEEP_ALIVE))
    assert dict(s.heartbeats) == {"a": BEAT}
    s = applied(forming("b", wait_list=("a",)), act(K.ADD_TO_PARTICIPANTS))
    assert (s.participants, s.wait_list) == (("b", "a"), ())
    assert applied(running("b"), act(K.ADD_TO_WAIT_LIST)).wait_list == ("a",)
    assert applied(forming("a", "b"), act(K.START_LAST_CALL)).min_reached_at == NOW
    assert applied(forming("a", min_reached_at=1.0), act(K.CANCEL_LAST_CALL)).min_reached_at is None
    s = applied(forming("c", "a", wait_list=("a", "d"), expected=("c",)), act(K.MARK_COMPLETE))
    assert (s.complete, s.participants, s.wait_list, s.expected) == (True, ("a", "c"), ("d",), ())
    s = applied(running("a", "b", "c", dead=("c",), wait_list=("d",), restart="r"),
                act(K.OPEN_ROUND, reason="r"))
    assert (s.round, s.complete, s.participants, s.expected, s.lost, s.reason, s.restart,
            s.opened_at) == (4, False, (), ("a", "b", "d"), ("c",), "r", None, NOW)
    s = applied(running("a", "b", restart="first"), act(K.MARK_DEAD, nodes=("b",), reason="x"))
    assert (s.dead, s.restart) == (("b",), "first")
    s = applied(forming("a", "b", expected=("b",), heartbeats={"b": "1"}),
                act(K.REMOVE_NODES, nodes=("b",)))
    assert (s.participants, s.expected, dict(s.heartbeats)) == (("a",), (), {"a": BEAT})
    assert applied(running("a"), act(K.REQUEST_RESTART, reason="why")).restart == "why"
    s = applied(running("a"), act(K.MARK_CLOSED, reason="failed"))
    assert (s.closed, s.closed_by, s.closed_as) == (True, ME, "failed")


def test_an_outcome_is_no_change():
    with pytest.raises(ValueError, match="FINISH is an outcome"):
        applied(running("a"), act(K.FINISH))


def test_a_join_settles_into_one_write():
    """A lone node with max_nodes=1 joins, beats, starts the last call and completes at once."""
    solo = dataclasses.replace(SETTINGS, min_nodes=1, max_nodes=1)
    ctx = Context(node=ME, settings=solo, state=RendezvousState(opened_at=OPENED), now=NOW,
                  heartbeat=BEAT)
    plan = transitions.settle(ctx, lambda c: decide_join(c, timed_out=False))
    assert [a.kind for a, _ in plan.changes] == [
        K.ADD_TO_PARTICIPANTS, K.KEEP_ALIVE, K.START_LAST_CALL, K.MARK_COMPLETE]
    assert plan.outcome.kind is K.FINISH
    assert (plan.state.complete, plan.state.participants) == (True, ("a",))
    assert ctx.state == RendezvousState(opened_at=OPENED)  # the snapshot is untouched


def test_decisions_that_never_settle_are_a_clear_error():
    ctx = context(Row("", running("a"), act(K.DONE)))
    with pytest.raises(RuntimeError, match="did not settle after 16 changes"):
        transitions.settle(ctx, lambda c: act(K.MARK_CLOSED))
