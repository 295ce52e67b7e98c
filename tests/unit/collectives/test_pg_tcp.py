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
from shoal.collectives.types import (
    CollectiveMismatch,
    CollectiveTimeout,
    GroupDestroyed,
    PeerLost,
    ReduceOp,
)
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.store.hash import HashStore
from shoal.core.admission import CLOSED, WRONG_SECRET
from shoal.core.auth import client_handshake, load_token
from shoal.core.errors import AuthenticationError, ShapeError
from threaded_ranks import form_groups, run_all


def make_groups(world: int, timeout: float = 10.0, name: str = "default"):
    store = HashStore()
    return form_groups(
        world, lambda r: ProcessGroupTCP(store, r, world, timeout=timeout, name=name)
    )


@pytest.fixture
def trio():
    pgs = make_groups(3)
    yield pgs
    for pg in pgs:
        pg.shutdown()


@pytest.fixture
def pair():
    pgs = make_groups(2)
    yield pgs
    for pg in pgs:
        pg.shutdown()


# ----------------------------------------------------------------------------- mismatches

MISMATCHES = {
    "shape": (lambda pg, r: pg.all_reduce(np.ones(12 if r == 2 else 10, np.float32)),
              "all_reduce(float32[10], op=SUM)", "all_reduce(float32[12], op=SUM)"),
    "dtype": (lambda pg, r: pg.all_reduce(np.ones(10, np.float64 if r == 2 else np.float32)),
              "all_reduce(float32[10], op=SUM)", "all_reduce(float64[10], op=SUM)"),
    "reduce op": (lambda pg, r: pg.all_reduce(np.ones(10, np.float32), op=ReduceOp.MAX if r == 2 else ReduceOp.SUM),
                  "op=SUM", "op=MAX"),
    "collective": (lambda pg, r: pg.broadcast(np.ones(10, np.float32), src=0) if r == 0
                   else pg.all_reduce(np.ones(10, np.float32)),
                   "broadcast(float32[10], src=0)", "all_reduce(float32[10], op=SUM)"),
    "large shape": (lambda pg, r: pg.all_reduce(np.ones(300_000 + r, np.float32)),
                    "all_reduce(float32[", "all_reduce(float32["),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_mismatched_calls_fail_on_every_rank_naming_both(trio, case):
    call, one, other = MISMATCHES[case]
    out = run_all(trio, lambda pg, r: (pg.barrier(), call(pg, r)))
    for r, exc in enumerate(out):
        assert isinstance(exc, CollectiveMismatch), (r, exc)
        text = str(exc)
        assert one in text and other in text, text
        assert f"Rank {r} failed" in text and "#2" in text and "group 'default'" in text, text
    # The group stays failed: the next call fails at once with the same diagnosis.
    with pytest.raises(CollectiveMismatch, match="every rank must call the same collectives"):
        trio[0].barrier()


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
    # 3. authenticated, but the hello is garbage
    h = socket.create_connection(addr)
    client_handshake(h, load_token(), "collectives", timeout=5)
    h.sendall(b"\x00" * wire.HELLO.size)
    assert _closed_by_server(h)
    # 4. authenticated and well-formed, impersonating rank 1, which is already connected
    d = socket.create_connection(addr)
    client_handshake(d, load_token(), "collectives", timeout=5)
    d.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, pair[0]._mesh._group_id, 1, 0, wire.CHANNEL_UP))
    assert _closed_by_server(d)
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
    assert len(dropped) == 2, [r.getMessage() for r in caplog.records]
    # The group never noticed.
    out = run_all(pair, lambda pg, r: (a := np.full(5, r + 1.0), pg.all_reduce(a), a)[2])
    for a in out:
        np.testing.assert_array_equal(a, np.full(5, 3.0))


# ----------------------------------------------------------------------------- Work, async

def test_async_work_handles(pair):
    def fn(pg, r):
        if r == 1:
            time.sleep(0.5)
        a = np.full(100, r, np.float64)
        w = pg.all_reduce(a, async_op=True)
        if r == 0:
            assert not w.is_completed()
            with pytest.raises(CollectiveTimeout, match="did not complete within the 0.05s that wait"):
                w.wait(timeout=0.05)
        seen = []
        w.add_done_callback(lambda work: seen.append(work.is_success()))
        assert w.wait(timeout=10) is True
        assert w.is_completed() and w.is_success() and w.exception() is None
        assert w.result()[0] is a and seen == [True]
        return a

    for a in run_all(pair, fn):
        np.testing.assert_array_equal(a, np.ones(100))


def test_failed_async_work_reports_its_exception(pair):
    def fn(pg, r):
        w = pg.all_reduce(np.ones(3 + r), async_op=True)
        with pytest.raises(CollectiveMismatch):
            w.wait(timeout=10)
        assert w.is_completed() and not w.is_success()
        assert isinstance(w.exception(), CollectiveMismatch)
        return True

    assert run_all(pair, fn) == [True, True]


def test_tensor_and_bfloat16_in_place(pair):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from shoal.core.tensor import Tensor

    def fn(pg, r):
        t = Tensor(np.full(7, r + 1, np.float32))
        pg.all_reduce(t, op=ReduceOp.AVG)
        b = np.full(5, r + 1, ml_dtypes.bfloat16)
        pg.all_reduce(b)
        return t.data, b

    for t, b in run_all(pair, fn):
        np.testing.assert_array_equal(t, np.full(7, 1.5, np.float32))
        assert b.dtype == ml_dtypes.bfloat16 and (b.astype(np.float32) == 3).all()


# ----------------------------------------------------------------------------- validation

def test_bad_arguments_get_clear_errors_and_touch_nothing(pair):
    pg = pair[0]
    with pytest.raises(ValueError, match="must be C-contiguous"):
        pg.all_reduce(np.ones((4, 4))[:, 1])
    with pytest.raises(TypeError, match="numpy array, a cupy array or a core.Tensor, got list"):
        pg.all_reduce([1, 2, 3])
    with pytest.raises(TypeError, match="dtype object"):
        pg.all_reduce(np.array([object()]))
    with pytest.raises(ValueError, match="ReduceOp.AVG needs a floating-point dtype, got int32"):
        pg.all_reduce(np.ones(3, np.int32), op=ReduceOp.AVG)
    with pytest.raises(ValueError, match="op must be one of"):
        pg.all_reduce(np.ones(3), op="median")
    with pytest.raises(ValueError, match=r"broadcast src must be a rank in 0..1 of this group, got 2"):
        pg.broadcast(np.ones(3), src=2)
    with pytest.raises(ValueError, match="must hold 2 arrays"):
        pg.all_gather([np.ones(3)], np.ones(3))
    with pytest.raises(ShapeError, match=r"all_gather tensor_list\[1\] is float64\[4\] but the input tensor is float64\[3\]"):
        pg.all_gather([np.ones(3), np.ones(4)], np.ones(3))
    with pytest.raises(ValueError, match="cannot send to itself"):
        pg.send(np.ones(3), dst=0)
    with pytest.raises(ValueError, match="read-only"):
        ro = np.ones(3)
        ro.setflags(write=False)
        pg.all_reduce(ro)
    assert pg.ledger.seq == 0  # nothing was submitted
    run_all(pair, lambda g, r: g.barrier())


def test_destroyed_group_refuses_work():
    pgs = make_groups(2)
    for pg in pgs:
        pg.shutdown()
    with pytest.raises(GroupDestroyed, match="after it was destroyed"):
        pgs[0].all_reduce(np.ones(3))


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
