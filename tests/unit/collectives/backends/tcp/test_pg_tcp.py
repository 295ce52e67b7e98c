"""The tcp backend with ranks as threads of one process (real sockets, HashStore): mismatches,
hostile connections, validation, Work handles, point to point, metrics, lifecycle."""

from __future__ import annotations

import logging
import socket
import time

import numpy as np
import pytest
from prometheus_client import REGISTRY

from shoal.collectives.backends.tcp import wire
from shoal.collectives.types import CollectiveMismatch, CollectiveTimeout, PeerLost
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.store.hash import HashStore
from shoal.core.admission import CLOSED, WRONG_SECRET
from shoal.core.auth import client_handshake, load_token
from shoal.core.channel import TAG_BYTES
from shoal.core.errors import AuthenticationError
from tests.support.threaded_ranks import form_groups, run_all


def make_groups(world: int, timeout: float = 10.0, name: str = "default"):
    store = HashStore()
    return form_groups(
        world, lambda r: ProcessGroupTCP(store, r, world, timeout=timeout, name=name)
    )


@pytest.fixture
def pair():
    pgs = make_groups(2)
    yield pgs
    for pg in pgs:
        pg.shutdown()


# ----------------------------------------------------------------------------- mismatches
# (every collective's semantics, Work, bad input and collective mismatches are the
# ProcessGroup contract's: tests/contracts/test_process_group_contract.py)

def test_p2p_mismatch_fails_only_that_recv(pair):
    def fn(pg, r):
        if r == 0:
            pg.send(np.ones(3, np.float32), dst=1, tag=5)
            pg.send(np.ones(4, np.float32), dst=1, tag=6)
            return None
        with pytest.raises(CollectiveMismatch, match=r"recv of p2p\(float64\[3\]\) with tag 5 but rank 0 sent p2p\(float32\[3\]\)"):
            pg.recv(np.empty(3, np.float64), src=0, tag=5)
        ok = np.empty(4, np.float32)
        pg.recv(ok, src=0, tag=6)
        return ok

    out = run_all(pair, fn)
    np.testing.assert_array_equal(out[1], np.ones(4))
    run_all(pair, lambda pg, r: pg.barrier())  # the group still works


# ----------------------------------------------------------------------------- hostile peers

def _closed_by_server(sock: socket.socket, timeout: float = 15.0) -> bool:
    sock.settimeout(timeout)
    try:
        while True:
            if not sock.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def test_garbage_and_unauthenticated_connections_are_dropped_and_logged(pair, caplog):
    caplog.set_level(logging.WARNING, logger="shoal.collectives.backends.tcp.mesh")
    addr = pair[0].address
    # 1. garbage bytes instead of a handshake
    g = socket.create_connection(addr)
    g.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 4)
    assert _closed_by_server(g)
    # 2. a client holding another secret
    w = socket.create_connection(addr)
    with pytest.raises(AuthenticationError):
        client_handshake(w, b"not-the-job-secret", "collectives", timeout=5)
    w.close()
    # 3. authenticated, and the hello carries its tag, but it is garbage
    h = socket.create_connection(addr)
    link = client_handshake(h, load_token(), "collectives", timeout=5)
    garbage = b"\x00" * wire.HELLO.size
    h.sendall(garbage + link.sealer.tag((garbage,)))
    assert _closed_by_server(h)
    # 4. authenticated and well-formed, impersonating rank 1, which is already connected
    d = socket.create_connection(addr)
    link = client_handshake(d, load_token(), "collectives", timeout=5)
    hello = wire.HELLO.pack(wire.HELLO_MAGIC, pair[0]._mesh._group_id, 1, 0, wire.CHANNEL_UP)
    d.sendall(hello + link.sealer.tag((hello,)))
    assert _closed_by_server(d)
    # 4b. authenticated, a well-formed hello, but not tagged with this connection's keys
    f = socket.create_connection(addr)
    client_handshake(f, load_token(), "collectives", timeout=5)
    f.sendall(hello + bytes(TAG_BYTES))
    assert _closed_by_server(f)
    # 5. connects and says nothing, then goes away
    socket.create_connection(addr).close()
    expected = {WRONG_SECRET: 2, CLOSED: 1}
    # 6. the same-host Unix listener gets the same treatment
    unix_address = pair[0]._mesh.unix_address
    if unix_address is not None:
        u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        u.connect(unix_address)
        u.sendall(b"\xff" * 300)
        assert _closed_by_server(u)
        expected[WRONG_SECRET] += 1
    gate = pair[0]._mesh._gate
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and dict(gate.rejections) != expected:
        time.sleep(0.05)
    assert dict(gate.rejections) == expected
    dropped = [r for r in caplog.records if "dropped a connection" in r.getMessage()]
    assert len(dropped) == 3, [r.getMessage() for r in caplog.records]
    assert "its hello failed its integrity check" in dropped[-1].getMessage()
    # The group never noticed.
    out = run_all(pair, lambda pg, r: (a := np.full(5, r + 1.0), pg.all_reduce(a), a)[2])
    for a in out:
        np.testing.assert_array_equal(a, np.full(5, 3.0))


# ----------------------------------------------------------------------------- Work, async

def test_failed_async_work_reports_its_exception(pair):
    def fn(pg, r):
        w = pg.all_reduce(np.ones(3 + r), async_op=True)
        with pytest.raises(CollectiveMismatch):
            w.wait(timeout=10)
        assert w.is_completed() and not w.is_success()
        assert isinstance(w.exception(), CollectiveMismatch)
        return True

    assert run_all(pair, fn) == [True, True]


# ----------------------------------------------------------------------------- validation

def test_peer_that_leaves_mid_collective_is_named():
    pgs = make_groups(2)
    try:
        def fn(pg, r):
            if r == 1:
                time.sleep(0.3)
                pg.shutdown()
                return None
            with pytest.raises(PeerLost, match="rank 1 left the group"):
                pg.all_reduce(np.ones(10), timeout=20)
            return True

        assert run_all(pgs, fn)[0] is True
    finally:
        pgs[0].shutdown()


def test_abort_fails_every_rank(pair):
    def fn(pg, r):
        if r == 0:
            time.sleep(0.2)
            pg.abort()
            return None
        with pytest.raises(Exception, match=r"rank 0 aborted the group \(ProcessGroup.abort\(\)\)"):
            pg.all_reduce(np.ones(10), timeout=20)
        return True

    assert run_all(pair, fn)[1] is True


# ----------------------------------------------------------------------------- metrics

def _sample(name, labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_metrics_move(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_DUMP_DIR", str(tmp_path))
    pgs = make_groups(2)
    try:
        count = _sample("shoal_collectives_op_duration_seconds_count", {"op": "all_reduce", "backend": "tcp"})
        nbytes = _sample("shoal_collectives_bytes_total", {"op": "all_reduce"})
        errors = _sample("shoal_collectives_errors_total", {"op": "all_reduce", "kind": "timeout"})
        timeouts = _sample("shoal_collectives_timeouts_total", {"op": "all_reduce"})
        run_all(pgs, lambda pg, r: pg.all_reduce(np.ones(1000, np.float32)))
        assert _sample("shoal_collectives_op_duration_seconds_count",
                       {"op": "all_reduce", "backend": "tcp"}) == count + 2
        assert _sample("shoal_collectives_bytes_total", {"op": "all_reduce"}) == nbytes + 8000

        def fn(pg, r):
            if r == 0:
                with pytest.raises(CollectiveTimeout, match="rank 1 never arrived"):
                    pg.all_reduce(np.ones(3), timeout=0.5)
            return True

        run_all(pgs, fn)
        assert _sample("shoal_collectives_timeouts_total", {"op": "all_reduce"}) == timeouts + 1
        assert _sample("shoal_collectives_errors_total", {"op": "all_reduce", "kind": "timeout"}) >= errors + 1
    finally:
        for pg in pgs:
            pg.shutdown()


def test_tcp_transport_on_request(monkeypatch):
    monkeypatch.setenv("SHOAL_LOCAL_TRANSPORT", "tcp")
    pgs = make_groups(2)
    try:
        assert pgs[0]._mesh.transports == ["self", "tcp"] and pgs[0]._mesh.unix_address is None

        def fn(pg, r):
            small, large = np.full(10, r + 1.0), np.full(3_000_000, r + 1.0, np.float32)
            pg.all_reduce(small)
            pg.all_reduce(large)
            b = np.full(200_000, r, np.int32)
            pg.broadcast(b, src=1)
            return small[0], float(large[-1]), int(b[0])

        assert run_all(pgs, fn) == [(3.0, 3.0, 1)] * 2
    finally:
        for pg in pgs:
            pg.shutdown()
