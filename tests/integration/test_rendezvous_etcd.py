"""The rendezvous over a real etcd: an outage of 3 s survived, a SIGKILLed node detected,
failover between endpoints, and clear errors when etcd cannot be reached."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
import traceback
import uuid

import pytest

from shoal.elastic.api import RendezvousError, RendezvousSettings
from shoal.elastic.rendezvous import create_handler
from tests.support.rdzv import join_all

WAIT_S = 30.0


def settings(**kw) -> RendezvousSettings:
    base = dict(run_id=f"run-{uuid.uuid4().hex[:8]}", min_nodes=2, max_nodes=2,
                last_call_timeout=0.5, join_timeout=WAIT_S, heartbeat_interval=0.2,
                heartbeat_timeout=2.0)
    base.update(kw)
    return RendezvousSettings(**base)


def test_rendezvous_and_store_survive_a_3s_etcd_outage(etcd, caplog):
    # heartbeat_timeout (2 s) is shorter than the outage on purpose, and the lease ttl (3 s)
    # is renewed every second, so renewals fail during the outage.
    s = settings()
    handlers = [create_handler("etcd", etcd.endpoint, s, n, ttl=3, timeout=20) for n in "ab"]
    try:
        infos = join_all(handlers)
        assert [i.participants for i in infos] == [["a", "b"]] * 2
        infos[0].store.set("before", b"1")
        with caplog.at_level(logging.WARNING, logger="shoal.elastic.rendezvous.etcd_backend"):
            etcd.restart(downtime=3.0)
            # Watch over two heartbeat timeouts: no node is declared dead.
            end = time.monotonic() + 2 * s.heartbeat_timeout
            while time.monotonic() < end:
                assert handlers[0].restart_requested() is None
                assert handlers[1].restart_requested() is None
                time.sleep(0.1)
        assert any("Renewing etcd lease" in r.getMessage() for r in caplog.records), \
            "no lease renewal failed during the outage: the test did not test the keepalive"
        for h in handlers:
            # the keepalive recovered: the lease is alive and renewed past its 3 s ttl
            assert h.backend.lease_ttl() > 0
            assert h.backend._renewals_failed == 0, "the keepalive did not recover"
            assert h.dead_nodes() == []
        assert infos[1].store.get("before", timeout=5) == b"1"
        # The rendezvous still works: a restart forms round 1.
        handlers[1].signal_restart("after the outage")
        infos = join_all(handlers)
        assert [i.round for i in infos] == [1, 1]
        infos[0].publish_master("127.0.0.1", 1234)
        assert infos[1].read_master(timeout=5) == ("127.0.0.1", 1234)
    finally:
        for h in handlers:
            h.shutdown()


def _child_node(endpoint: str, run_id: str, queue) -> None:
    """A node in its own process: join one round, report it, then idle until killed."""
    try:
        h = create_handler("etcd", endpoint,
                           settings(run_id=run_id, min_nodes=1, last_call_timeout=WAIT_S),
                           "child", ttl=10, timeout=10)
        info = h.next_rendezvous()
        queue.put(("joined", info.round, info.participants))
        time.sleep(120)
    except BaseException:  # noqa: BLE001  (handed to the test, which reports it)
        queue.put(("error", traceback.format_exc(), None))


def test_a_sigkilled_node_is_declared_dead_and_the_rest_go_on(shared_etcd):
    # A long last call: round 0 completes when both are in (max_nodes), however slowly the
    # child starts; round 1 completes at once because its one expected node is back.
    s = settings(min_nodes=1, max_nodes=2, last_call_timeout=WAIT_S)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_node, args=(shared_etcd.endpoint, s.run_id, queue))
    child.start()
    parent = create_handler("etcd", shared_etcd.endpoint, s, "parent", ttl=10, timeout=10)
    try:
        info = parent.next_rendezvous()
        kind, round_, participants = queue.get(timeout=WAIT_S)
        assert kind == "joined", round_
        assert (info.round, info.participants) == (0, ["child", "parent"]) == (round_, participants)
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        assert child.exitcode == -signal.SIGKILL, f"child exited with code {child.exitcode}"
        end = time.monotonic() + WAIT_S
        while (reason := parent.restart_requested()) is None and time.monotonic() < end:
            time.sleep(0.05)
        assert reason is not None and "node child sent no heartbeat" in reason
        assert parent.dead_nodes() == ["child"]
        info = parent.next_rendezvous()
        assert (info.round, info.participants, info.group_rank) == (1, ["parent"], 0)
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)
        parent.shutdown()


def test_rendezvous_fails_over_to_the_second_endpoint(shared_etcd):
    # 127.0.0.2 is loopback too, but etcd listens on 127.0.0.1 only: connections are refused.
    endpoints = f"127.0.0.2:{shared_etcd.port},{shared_etcd.endpoint}"
    s = settings(min_nodes=1, max_nodes=1)
    h = create_handler("etcd", endpoints, s, "solo", timeout=10)
    try:
        assert h.next_rendezvous().participants == ["solo"]
        info_store = h.store
        info_store.set("k", b"v")
        assert info_store.get("k", timeout=5) == b"v"
    finally:
        h.shutdown()


def test_unreachable_etcd_is_a_clear_error_within_the_timeout(shared_etcd):
    start = time.monotonic()
    with pytest.raises(RendezvousError,
                       match=rf"etcd at 127\.0\.0\.2:{shared_etcd.port} did not answer a lease "
                             r"grant within 1s"):
        create_handler("etcd", f"127.0.0.2:{shared_etcd.port}", settings(), "x", timeout=1.0)
    assert time.monotonic() - start < 10
