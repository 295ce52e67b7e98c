"""Frames of the tcp backend (`framing`): every frame after the handshake carries its
connection's tag, checked before the receiver acts on it, in the pump, the threaded ring, the
direct small-message path and the control channel; with SHOAL_ENCRYPT=1 payloads are sealed.

Ranks are threads here; the relay between processes is tests/multiproc/test_collectives_relay.py.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from shoal.collectives.backends.tcp import algorithms as algos
from shoal.collectives.backends.tcp import framing, wire
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.backends.tcp.pump import Plan, SenderThread, pump, pump_threaded
from shoal.collectives.store.hash import HashStore
from shoal.collectives.types import CollectiveError, ReduceOp
from shoal.core import channel
from tests.support.threaded_ranks import form_groups, run_all

SECRET = b"k" * 32


def _one_way(encrypt: bool = False, family=socket.AF_UNIX):
    """A connection from a sender to a receiver with its keys: (Outbound, Inbound)."""
    send_sock, recv_sock = socket.socketpair(family)
    for sock in (send_sock, recv_sock):
        sock.settimeout(10)
    nonces = (os.urandom(32), os.urandom(32))
    client = channel.pair(SECRET, "collectives", *nonces, server=False, encrypt=encrypt)
    server = channel.pair(SECRET, "collectives", *nonces, server=True, encrypt=encrypt)
    return framing.Outbound(send_sock, client), framing.Inbound(recv_sock, server)


def _send_in_thread(fn):
    errors = []

    def body():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001  (reported by the test)
            errors.append(exc)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, errors


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_chunk_and_its_header_arrive_checked(encrypt):
    out, inb = _one_way(encrypt)
    data = np.arange(100_000, dtype=np.float32)
    got = np.zeros_like(data)
    fp = b"all_reduce(float32[100000])"
    send = Plan()
    send.send(0, wire.data_header(7, fp), header=True)
    send.send(0, memoryview(data.view(np.uint8)))
    recv = Plan()
    algos.expect_header(recv, 0, inb, 7, fp)
    recv.recv(0, memoryview(got.view(np.uint8)))
    t, errors = _send_in_thread(lambda: pump(send, [out], [None]))
    pump(recv, [None], [inb])
    t.join(10)
    assert not errors, errors
    np.testing.assert_array_equal(got, data)


def _tampered_stream(flip_at: int):
    """A header and a 64 KiB chunk from rank 0 to rank 1, with one byte flipped on the way."""
    out, inb = _one_way()
    fp = b"broadcast(uint8[65536])"
    payload = os.urandom(65536)
    frames = out.header(wire.data_header(3, fp)) + out.frame(payload)
    wire_bytes = bytearray(b"".join(bytes(p) for p in frames))
    wire_bytes[flip_at] ^= 0x01
    out.sock.sendall(wire_bytes)
    return inb, fp, payload


@pytest.mark.parametrize("where", ["header", "payload", "tag"])
def test_the_pump_refuses_a_flipped_byte_before_using_the_frame(where):
    header_len = wire.DATA_HEADER.size + len(b"broadcast(uint8[65536])")
    flip_at = {"header": 5, "payload": header_len + framing.TAG + 1000,
               "tag": header_len + framing.TAG + 65536 + 3}[where]
    inb, fp, _payload = _tampered_stream(flip_at)
    got = bytearray(65536)
    reduced = []
    plan = Plan()
    algos.expect_header(plan, 1, inb, 3, fp)
    plan.recv(1, memoryview(got), lambda: reduced.append(True))
    with pytest.raises(framing.Tampered) as info:
        pump(plan, [None, None], [None, inb])
    assert info.value.peer == 1
    assert info.value.what == ("a collective header" if where == "header" else "a data frame")
    assert not reduced  # the callback (a reduction) never saw the frame


def test_the_threaded_ring_refuses_a_flipped_payload_byte():
    header_len = wire.DATA_HEADER.size + len(b"broadcast(uint8[65536])")
    inb, fp, _payload = _tampered_stream(header_len + framing.TAG + 7)
    idle_out, _idle_in = _one_way()
    plan = Plan()
    algos.expect_header(plan, 1, inb, 3, fp)
    plan.recv(1, memoryview(bytearray(65536)))
    plan.send(1, b"x")  # the ring's one sending peer
    sender = SenderThread("test-sender")
    try:
        with pytest.raises(framing.Tampered):
            pump_threaded(plan, [None, idle_out], [None, inb], sender)
    finally:
        sender.stop()


def test_a_frame_trickling_into_a_blocking_socket_lands_whole_and_checked():
    # The ring's receiver asks the kernel for a payload and its tag at once (MSG_WAITALL on a
    # blocking socket); a sender that writes them in odd pieces must still fill both, in order.
    out, inb = _one_way()
    inb.sock.settimeout(None)
    data = np.arange(50_000, dtype=np.float32)
    wire_bytes = b"".join(bytes(part) for part in out.frame(memoryview(data).cast("B")))

    def trickle():
        for start in range(0, len(wire_bytes), 65_521):  # a prime: pieces split the tag too
            out.sock.sendall(wire_bytes[start:start + 65_521])
            time.sleep(0.001)

    t, errors = _send_in_thread(trickle)
    got = np.zeros_like(data)
    assert inb.receive(1, memoryview(got).cast("B"))
    t.join(10)
    assert not errors and not t.is_alive()
    np.testing.assert_array_equal(got, data)


def test_a_peer_that_closes_mid_frame_ends_a_blocking_receive():
    out, inb = _one_way()
    inb.sock.settimeout(None)
    out.sock.sendall(b"x" * 1000)  # 1000 of the 4096 + TAG bytes the receiver waits for
    out.sock.close()
    assert wire.recv_parts(inb.sock, [memoryview(bytearray(4096)), inb.trailer]) is False


def test_the_direct_path_refuses_an_injected_payload():
    out, inb = _one_way()
    fp = b"all_reduce(float32[4])"
    hdr = wire.data_header(1, fp)
    # A well-formed header and payload with tags the sender of this connection never made.
    out.sock.sendall(hdr + bytes(framing.TAG) + bytes(16) + bytes(framing.TAG))
    direct = algos.Direct(1, 2, [None, out], [inb, None])
    with pytest.raises(framing.Tampered) as info:
        direct.recv_from(0, 1, fp, 16)
    assert info.value.peer == 0 and info.value.what == "a collective header"


def test_a_mismatched_call_is_still_a_checked_mismatch():
    out, inb = _one_way()
    out.send_header(wire.data_header(1, b"all_reduce(float64[1])"), b"\0" * 8)
    direct = algos.Direct(1, 2, [None, out], [inb, None])
    with pytest.raises(algos.HeaderMismatch) as info:
        direct.recv_from(0, 1, b"all_reduce(float32[1])", 4)
    assert info.value.their_fp == "all_reduce(float64[1])"


@pytest.fixture
def encrypted_pair(monkeypatch):
    monkeypatch.setenv("SHOAL_ENCRYPT", "1")
    monkeypatch.setenv("SHOAL_LOCAL_TRANSPORT", "unix")
    store = HashStore()
    pgs = form_groups(2, lambda r: ProcessGroupTCP(store, r, 2, timeout=20.0))
    yield pgs
    for pg in pgs:
        pg.shutdown()


def test_collectives_run_sealed_with_shoal_encrypt(encrypted_pair):
    pgs = encrypted_pair
    assert all(pg._mesh.tx[1 - r].encrypt for r, pg in enumerate(pgs))

    def fn(pg, r):
        out = {}
        for n in (16, 300_000, 1_200_000):  # direct, pumped ring, threaded ring
            a = np.arange(n, dtype=np.float32) * (r + 1)
            pg.all_reduce(a, ReduceOp.SUM)
            out[n] = a
        b = np.full(100_000, float(r), np.float64)
        pg.broadcast(b, 1)
        out["broadcast"] = b
        msg = np.arange(10, dtype=np.int64) if r == 0 else np.zeros(10, np.int64)
        if r == 0:
            pg.send(msg, 1, 5)
        else:
            pg.recv(msg, 0, 5)
        out["p2p"] = msg
        return out

    for r, got in enumerate(run_all(pgs, fn)):
        assert not isinstance(got, BaseException), got
        for n in (16, 300_000, 1_200_000):
            np.testing.assert_array_equal(got[n], np.arange(n, dtype=np.float32) * 3)
        np.testing.assert_array_equal(got["broadcast"], np.ones(100_000))
        np.testing.assert_array_equal(got["p2p"], np.arange(10))


def test_a_forged_control_message_fails_the_group_naming_the_peer():
    store = HashStore()
    pgs = form_groups(2, lambda r: ProcessGroupTCP(store, r, 2, timeout=20.0))
    try:
        # Rank 1's control connection to rank 0 carries a goodbye with a tag nobody made.
        head = wire.CONTROL_HEADER.pack(wire.CONTROL_MAGIC, wire.KIND_BYE, 0, 0, 0)
        pgs[1]._mesh.ctrl[0].sendall(head + bytes(framing.TAG))
        deadline = time.monotonic() + 10
        while pgs[0].failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        out = run_all(pgs, lambda pg, r: pg.all_reduce(np.ones(4)))
        for got in out:
            assert isinstance(got, CollectiveError), out
            assert "from rank 1 failed its integrity check" in str(got)
        assert not pgs[0]._mesh.departed[1]  # the forged goodbye was not obeyed
    finally:
        for pg in pgs:
            pg.shutdown()
