"""Parking the all_reduces issued inside backward (`torch_bridge.deferral`): they run when backward
ends, in the order they were issued relative to the group's other ops, and nothing that waits for
one of them can wait forever. One rank (W=1) in this process: a real tcp group, no peers needed to
see when each op reaches the group (its op ledger numbers them as they are submitted)."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch.autograd import Variable  # noqa: E402

from shoal.collectives.backends.tcp.group import ProcessGroupTCP  # noqa: E402
from shoal.collectives.store.hash import HashStore  # noqa: E402
from shoal.torch_bridge import deferral  # noqa: E402
from shoal.torch_bridge.group import ShoalProcessGroup  # noqa: E402


@pytest.fixture
def pg():
    group = ShoalProcessGroup(ProcessGroupTCP(HashStore(), 0, 1, timeout=10))
    yield group
    group.shutdown()


def _async():
    opts = dist.AllreduceOptions()
    opts.asyncOp = True
    return opts


def _backward_running(fn):
    """Run `fn()` inside autograd's evaluation of a node, as DDP's gradient hooks run."""

    class Node(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            fn()
            return grad

    Node.apply(torch.ones(2, requires_grad=True)).sum().backward()


def _ops(pg):
    return [rec.op for rec in pg.shoal_group.ledger.history]


def test_an_all_reduce_issued_in_backward_reaches_the_group_when_backward_ends(pg):
    pg.defer_in_backward = True
    t = torch.arange(3.0)
    seen = {}

    def issue():
        seen["work"] = pg.allreduce([t], _async())
        seen["seq"] = pg.shoal_group.ledger.seq

    before = pg.shoal_group.ledger.seq
    _backward_running(issue)
    assert seen["seq"] == before  # parked: not yet submitted inside backward
    assert pg.shoal_group.ledger.seq == before + 1  # run by the end-of-backward callback
    assert seen["work"].is_completed() and seen["work"].get_future().done()
    assert not pg.deferral.has_pending


def test_handed_to_the_worker_at_once_when_deferral_is_off(pg):
    pg.defer_in_backward = False
    seen = {}
    before = pg.shoal_group.ledger.seq
    _backward_running(lambda: seen.setdefault("seq", (pg.allreduce([torch.ones(2)], _async()),
                                                     pg.shoal_group.ledger.seq)[1]))
    assert seen["seq"] == before + 1


def test_another_op_on_the_group_runs_after_the_parked_ones_as_issued(pg):
    pg.defer_in_backward = True
    works = []

    def issue():
        works.append(pg.allreduce([torch.ones(2)], _async()))
        opts = dist.BroadcastOptions()
        opts.asyncOp = False
        pg.broadcast([torch.ones(3)], opts)  # synchronous: must not overtake the all_reduce

    _backward_running(issue)
    assert _ops(pg)[-2:] == ["all_reduce", "broadcast"]
    assert works[0].is_completed()


def test_waiting_on_a_parked_op_inside_backward_runs_it(pg, monkeypatch):
    monkeypatch.setattr(deferral, "RESCUE_AFTER_S", 3600.0)  # the wait itself must run it
    pg.defer_in_backward = True
    t = torch.full((4,), 2.0)
    done = []

    def issue():
        work = pg.allreduce([t], _async())
        done.append(work.wait(timeout=5) and work.is_completed())

    _backward_running(issue)
    assert done == [True]


def test_a_future_waited_on_where_the_flush_cannot_run_is_rescued(pg, monkeypatch):
    # A C++ wait on the op's Future inside backward blocks the thread that would run the flush;
    # the rescue thread hands the op to the group's worker thread after RESCUE_AFTER_S.
    monkeypatch.setattr(deferral, "RESCUE_AFTER_S", 0.05)
    monkeypatch.setattr(deferral, "_RESCUE_TICK_S", 0.01)
    pg.defer_in_backward = True
    got = []

    def issue():
        future = pg.allreduce([torch.ones(2)], _async()).get_future().then(lambda f: f.value())
        got.append(future.wait()[0].tolist())

    finished = threading.Event()

    def run():
        _backward_running(issue)
        finished.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    # 10 s: the rescue fires after 0.05 s; the rest is room for a loaded machine.
    assert finished.wait(10), "a Future waited on inside backward was never completed"
    assert got == [[1.0, 1.0]]


def test_ops_issued_in_autograds_final_callbacks_are_not_parked(pg, monkeypatch):
    # DDP's delayed all_reduce (static graphs) issues and waits there: parking would hang it
    # until the rescue, so they go to the worker thread at once.
    monkeypatch.setattr(deferral, "RESCUE_AFTER_S", 3600.0)
    pg.defer_in_backward = True
    seen = []

    def at_end():
        work = pg.allreduce([torch.ones(2)], _async())
        seen.append(pg.deferral.has_pending)
        seen.append(work.get_future().wait()[0].tolist())

    finished = threading.Event()

    def run():
        _backward_running(lambda: Variable._execution_engine.queue_callback(at_end))
        finished.set()

    threading.Thread(target=run, daemon=True).start()
    assert finished.wait(10), "an op issued in a final callback waited for a flush"
    assert seen == [False, [1.0, 1.0]]


def test_an_async_op_outside_backward_goes_to_the_worker_as_before(pg):
    pg.defer_in_backward = True
    before = pg.shoal_group.ledger.seq
    work = pg.allreduce([torch.ones(2)], _async())
    assert pg.shoal_group.ledger.seq == before + 1 and not pg.deferral.has_pending
    assert work.wait(timeout=5)


def test_by_default_it_parks_where_the_host_lacks_a_core_per_rank_for_the_worker(pg):
    assert pg.defer_in_backward is None
    seen = []
    before = pg.shoal_group.ledger.seq
    _backward_running(lambda: (pg.allreduce([torch.ones(2)], _async()),
                               seen.append(pg.shoal_group.ledger.seq)))
    parks = not deferral.spare_core_per_rank(1)  # one rank of this group on this host
    assert seen == [before if parks else before + 1]


def test_an_op_issued_while_the_rescue_hands_parked_ops_over_waits_for_them(monkeypatch):
    from shoal.collectives.api import CompletedWork

    monkeypatch.setattr(deferral, "RESCUE_AFTER_S", 0.0)
    monkeypatch.setattr(deferral, "_RESCUE_TICK_S", 0.01)
    holder = deferral.BackwardDeferral("handover")
    order = []
    handing, release = threading.Event(), threading.Event()

    def slow_submit(async_op, timeout):  # the rescue's submission of the parked op, held open
        handing.set()
        release.wait(5)
        order.append("parked op submitted")
        return CompletedWork([])

    def issue():
        holder.park(slow_submit, 5.0)
        assert handing.wait(5), "the rescue thread never took the parked op"
        threading.Timer(0.1, release.set).start()
        if holder.has_pending:  # what ShoalProcessGroup does before any other op
            holder.flush()
        order.append("next op submitted")

    try:
        _backward_running(issue)
    finally:
        holder.stop()
    assert order == ["parked op submitted", "next op submitted"]


def test_a_wait_with_a_timeout_on_a_parked_op_ends_within_it():
    """A parked all_reduce whose peer is late: wait(timeout) inside backward raises once the
    timeout passes (the op goes to the worker thread) instead of running the op in the waiting
    thread for the group's own timeout; the op completes once the peer joins."""
    import datetime
    import time

    from tests.support.threaded_ranks import form_groups, run_all

    store = HashStore()
    groups = form_groups(2, lambda r: ShoalProcessGroup(ProcessGroupTCP(store, r, 2, timeout=20)))
    waited = threading.Event()
    seen = {}

    def body(pg, rank):
        t = torch.full((3,), float(rank + 1))
        if rank == 1:  # joins only after rank 0's timed wait gave up
            assert waited.wait(30), "rank 0's timed wait never returned"
            pg.allreduce([t], dist.AllreduceOptions()).wait()
            return t
        pg.defer_in_backward = True

        def issue_and_wait():
            seen["work"] = pg.allreduce([t], _async())
            start = time.monotonic()
            try:
                with pytest.raises(Exception, match="did not complete within"):
                    seen["work"].wait(datetime.timedelta(seconds=0.5))
            finally:
                seen["waited_s"] = time.monotonic() - start
                waited.set()

        _backward_running(issue_and_wait)
        seen["work"].wait()
        return t

    try:
        results = run_all(groups, body, timeout=60)
    finally:
        run_all(groups, lambda pg, r: pg.shutdown())
    # Well under the group's 20 s, which an op run in the waiting thread would have taken, and
    # far above the 0.5 s asked, for a loaded machine's scheduling delays.
    assert seen["waited_s"] < 10.0
    for t in results:
        assert torch.equal(t, torch.full((3,), 3.0))
