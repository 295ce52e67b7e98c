"""The TCPStore's authenticated channel and its bounded reads, over real sockets: every frame
carries a tag under its connection's keys (or is encrypted, SHOAL_ENCRYPT), each side checks it
before it parses the frame, and the server allocates a frame's body only as its bytes arrive,
with the bytes it holds capped per connection and in total (issue 34)."""

from __future__ import annotations

import logging
import socket
import threading

import pytest

from shoal.collectives.store import frames
from shoal.collectives.store.server import TCPStoreServer
from shoal.collectives.store.tcp import TCPStore
from shoal.collectives.store.wire import (
    LENGTH,
    MAX_FRAME_BYTES,
    Op,
    Status,
    check_length,
    decode,
    encode,
    open_payload,
    seal,
)
from shoal.collectives.types import StoreError
from shoal.core.auth import client_handshake, load_token, server_handshake
from shoal.core.channel import TAG_BYTES
from tests.support.fuzz import wait_until

LOGGER = "shoal.collectives.store.server"
WAIT_S = 10.0
MIB = 1 << 20


def logged(caplog, *parts):
    return any(all(p in r.getMessage() for p in parts) for r in caplog.records
               if r.name == LOGGER)


@pytest.fixture
def server():
    server = TCPStoreServer("127.0.0.1", 0).start()
    yield server
    server.stop()


def authed(port):
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    return sock, client_handshake(sock, load_token(), "store")


def recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, "the server closed the connection before its reply"
        buf += chunk
    return bytes(buf)


def read_reply(sock, link):
    (length,) = LENGTH.unpack(recv_exact(sock, LENGTH.size))
    check_length(length)
    return decode(open_payload(link.opener, recv_exact(sock, length)))


@pytest.mark.parametrize("encrypt", ["0", "1"], ids=["tagged", "encrypted"])
def test_round_trips_small_and_large_values(encrypt, monkeypatch):
    monkeypatch.setenv("SHOAL_ENCRYPT", encrypt)
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=10, wait_for_workers=False) as master:
        with TCPStore("127.0.0.1", master.port, timeout=10) as client:
            big = bytes(range(256)) * (3 * MIB // 256 + 7)
            client.set("big", big)
            client.set("small", "v")
            assert master.get("big") == big
            assert client.multi_get(["small", "big"]) == [b"v", big]
            assert client.add("n", 5) == 5 and master.add("n", 1) == 6


def test_a_frame_with_a_wrong_tag_is_refused_and_the_client_told_why(server, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    sock, link = authed(server.port)
    frame = encode(Op.SET, [b"forged", b"pwned"])
    sock.sendall(frame + bytes(TAG_BYTES))
    status, args = read_reply(sock, link)  # the server's reply is still tagged: it checks out
    assert status == Status.DROPPED
    assert b"Frame 0 from 127.0.0.1:" in args[0] and b"failed its integrity check" in args[0]
    assert sock.recv(16) == b"", "the server kept the connection open"
    wait_until(lambda: logged(caplog, "dropped the connection from 127.0.0.1:",
                              "integrity check"), "the server logs the refusal")
    with TCPStore("127.0.0.1", server.port, timeout=5) as other:
        assert not other.check(["forged"])


def test_frames_before_the_bad_one_are_served(server):
    sock, link = authed(server.port)
    good = b"".join(bytes(p) for p in seal(link.sealer, encode(Op.ADD, [b"n", b"1"])))
    sock.sendall(good + encode(Op.ADD, [b"n", b"1"]) + bytes(TAG_BYTES))
    assert read_reply(sock, link) == (Status.OK, [b"1"])
    assert read_reply(sock, link)[0] == Status.DROPPED
    with TCPStore("127.0.0.1", server.port, timeout=5) as other:
        assert other.add("n", 0) == 1


def _tampering_server(listener, tamper):
    """Admit one client, answer its JOIN honestly, then tamper with the next reply."""
    sock, _ = listener.accept()
    with sock:
        link = server_handshake(sock, load_token(), "store")
        for reply in ([b"1"], [b""]):
            (length,) = LENGTH.unpack(recv_exact(sock, LENGTH.size))
            decode(open_payload(link.opener, recv_exact(sock, length)))
            data = bytearray(b"".join(bytes(p) for p in seal(link.sealer,
                                                              encode(Status.OK, reply))))
            if reply == [b""]:
                tamper(data)
            sock.sendall(data)
        sock.recv(1)


@pytest.mark.parametrize("how", ["flip a bit", "a zero tag"])
def test_a_reply_that_fails_its_check_is_an_error_that_says_so(how):
    def tamper(data):
        if how == "flip a bit":
            data[-TAG_BYTES - 1] ^= 1
        else:
            data[-TAG_BYTES:] = bytes(TAG_BYTES)

    listener = socket.create_server(("127.0.0.1", 0))
    t = threading.Thread(target=_tampering_server, args=(listener, tamper), daemon=True)
    t.start()
    try:
        client = TCPStore("127.0.0.1", listener.getsockname()[1], timeout=5)
        with pytest.raises(StoreError, match=r"TCPStore set of key 'k': Frame 1 from the TCPStore "
                           r"server at 127\.0\.0\.1:\d+ failed its integrity check"):
            client.set("k", "v")
        client.close()
    finally:
        listener.close()
        t.join(WAIT_S)


def test_a_stalled_maximal_frame_holds_no_memory(server):
    sock, _ = authed(server.port)
    with sock:
        sock.sendall(LENGTH.pack(MAX_FRAME_BYTES) + b"x" * 1000)
        wait_until(lambda: server.held_bytes >= 1000, "the server has the first bytes")
        assert server.held_bytes < 64 * 1024, "the server reserved the announced frame"
        with TCPStore("127.0.0.1", server.port, timeout=5) as client:
            client.set("still", "served")
    wait_until(lambda: server.held_bytes == 0, "the dropped connection gives its bytes back")


def test_bytes_held_past_the_servers_cap_drop_that_connection(caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    server = TCPStoreServer("127.0.0.1", 0, max_held_bytes=3 * MIB).start()
    first, _ = authed(server.port)
    second, _ = authed(server.port)
    try:
        first.sendall(LENGTH.pack(8 * MIB) + bytes(2 * MIB))
        wait_until(lambda: server.held_bytes >= 2 * MIB, "the first frame is half there")
        second.sendall(LENGTH.pack(8 * MIB))
        try:
            second.sendall(bytes(2 * MIB))
        except OSError:
            pass
        wait_until(lambda: logged(caplog, "unserved frames, its limit"), "the cap drops one")
        with TCPStore("127.0.0.1", server.port, timeout=5) as client:
            client.set("under", "the cap")
            assert client.get("under") == b"the cap"
    finally:
        first.close()
        second.close()
        wait_until(lambda: server.held_bytes == 0, "every byte is given back")
        server.stop()


def test_a_frame_larger_than_a_connections_cap_is_refused(caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    server = TCPStoreServer("127.0.0.1", 0, max_held_per_connection=MIB).start()
    try:
        with TCPStore("127.0.0.1", server.port, timeout=5) as client:
            with pytest.raises(StoreError, match="lost the server"):
                client.set("big", bytes(2 * MIB))
            client.set("small", "fits")
        wait_until(lambda: logged(caplog, "the most one connection may"), "the cap is logged")
    finally:
        server.stop()


def test_a_memory_error_drops_only_that_connection(server, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    real = frames.open_payload

    def failing(opener, payload):  # a large frame's body cannot be had
        if len(payload) > MIB:
            raise MemoryError
        return real(opener, payload)

    monkeypatch.setattr(frames, "open_payload", failing)
    with TCPStore("127.0.0.1", server.port, timeout=5) as client:
        with pytest.raises(StoreError, match="lost the server"):
            client.set("big", bytes(2 * MIB))
        client.set("small", "served")
        assert client.get("small") == b"served"
    wait_until(lambda: logged(caplog, "ran the server out of memory"), "the drop is logged")
    wait_until(lambda: server.held_bytes == 0, "the dropped connection gives its bytes back")
