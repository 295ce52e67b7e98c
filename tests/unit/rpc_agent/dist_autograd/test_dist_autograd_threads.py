"""Distributed autograd contexts change on several threads at once: calls arrive, `with` blocks
begin and end, streams die. These tests run those paths together with the interpreter
switching threads every microsecond, so that a walk of the live context table or of a
context's peers meets concurrent changes; before the table and the peer sets were changed only
under their locks, both walks failed with "changed size during iteration" within a second."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from shoal import rpc_agent
from shoal.collectives.store.hash import HashStore
from shoal.rpc_agent.dist_autograd import container, release

_SECONDS = 1.5  # how long each test keeps the threads racing


@pytest.fixture
def fast_switching():
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _run_beside(work, background) -> list:
    """Run `work()` repeatedly for _SECONDS while `background(stop)` runs on a thread; the
    exceptions either raised."""
    errors: list = []
    stop = threading.Event()

    def guarded() -> None:
        try:
            background(stop)
        except BaseException as exc:  # noqa: BLE001  (reported by the test)
            errors.append(exc)

    thread = threading.Thread(target=guarded, name="test-dist-autograd-race")
    thread.start()
    deadline = time.monotonic() + _SECONDS
    try:
        while time.monotonic() < deadline and not errors:
            work()
    except BaseException as exc:  # noqa: BLE001
        errors.append(exc)
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive(), "the background thread did not stop within 10 s"
    return errors


def test_contexts_begin_and_end_while_a_peer_is_lost(fast_switching):
    me, lost = 7, 99
    before = container.live_count()
    standing = [container.new_context(me) for _ in range(2000)]
    standing[0].add_peer(lost)

    def churn(stop: threading.Event) -> None:
        while not stop.is_set():
            made = [container.new_context(me).context_id for _ in range(50)]
            for cid in made:
                assert container.release(cid) is not None

    try:
        errors = _run_beside(
            lambda: container.peer_lost(lost, "worker 'w99'", "test", own_id=me), churn)
        assert errors == []
        # Contexts this worker created stay (their `with` block reports the failure).
        assert container.get(standing[0].context_id) is standing[0]
        assert "involves worker 'w99'" in str(standing[0].failure)
        assert all(ctx.failure is None for ctx in standing[1:])
    finally:
        for ctx in standing:
            container.release(ctx.context_id)
    assert container.live_count() == before


@pytest.fixture
def solo():
    rpc_agent.init_rpc("solo", 0, 1, rpc_agent.RpcBackendOptions(store=HashStore(),
                                                                 rpc_timeout=10))
    yield
    release.drop_pending()
    rpc_agent.shutdown(timeout=10)


def test_peers_join_a_context_while_it_ends_here(solo, fast_switching):
    # A call that found the context just before it ended still adds its peer; ending it walks
    # the peers to queue their releases. Peer ids here name no worker: the queue is dropped
    # before anything is sent.
    rounds = [0]
    ctx_box: list = []

    def begin_one() -> None:
        ctx = container.new_context(0)
        for peer in range(1, 2001):
            ctx.add_peer(peer)
        ctx_box[:] = [ctx]

    def add_peers(stop: threading.Event) -> None:
        peer = 10_000
        while not stop.is_set():
            if ctx_box:
                ctx_box[0].add_peer(peer)
                peer += 1

    def end_one() -> None:
        begin_one()
        release.end_here(ctx_box[0].context_id, None)
        release.drop_pending()
        rounds[0] += 1

    before = container.live_count()
    assert _run_beside(end_one, add_peers) == []
    assert rounds[0] > 0 and container.live_count() == before
    ended = ctx_box[0]
    assert container.get(ended.context_id) is None
    assert ended.peer_ids() == tuple(sorted(ended.peers))
