"""The TCPStore server under hostile or broken clients, over real sockets: it logs the peer and
the fault, drops that connection, and keeps serving everyone else."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from shoal.collectives.store.server import TCPStoreServer
from shoal.collectives.store.wire import LENGTH, MAX_PAYLOAD, Op, encode, seal
from shoal.collectives.types import StoreError
from shoal.collectives.store.tcp import TCPStore
from shoal.core.auth import MAGIC, client_handshake, load_token
from shoal.core.channel import TAG_BYTES
from shoal.core.errors import AuthenticationError
from tests.support.relay import pump

LOGGER = "shoal.collectives.store.server"
GATE_LOGGER = "shoal.core.admission"  # connections turned away before they authenticate
WAIT_S = 10.0


@pytest.fixture
def server():
    server = TCPStoreServer("127.0.0.1", 0, handshake_timeout=0.5, max_pending_handshakes=4)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def client(server):
    with TCPStore("127.0.0.1", server.port, timeout=5) as store:
        yield store


def wait_until(condition, what, timeout=WAIT_S):
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout}s waiting until {what}")
        time.sleep(0.01)


def wait_for_log(caplog, pattern):
    def found():
        return any(pattern in r.getMessage() for r in caplog.records
                   if r.name in (LOGGER, GATE_LOGGER))

    wait_until(found, f"the server logs {pattern!r}")
    return next(r for r in caplog.records if pattern in r.getMessage())


def raw_connection(server):
    """A connection that has not authenticated (the server greets it and waits for a proof)."""
    return socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)


def authed_connection(server):
    """A socket that passed the handshake, and its keys (every frame must carry a tag)."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
    return sock, client_handshake(sock, load_token(), "store")


def sealed(link, *frames):
    """The bytes of `frames` (from `encode`, or a hand-made prefix and body), each tagged in
    turn as a right-secret client tags them."""
    return b"".join(bytes(part) for frame in frames for part in seal(link.sealer, frame))


def framed(body):
    """A hand-made body with its length prefix (which counts the tag)."""
    return LENGTH.pack(len(body) + TAG_BYTES) + body


def assert_dropped(sock):
    """The server closed this connection: recv sees EOF (or a reset) after any greeting."""
    sock.settimeout(WAIT_S)
    try:
        for _ in range(100):
            if sock.recv(4096) == b"":
                break
        else:
            pytest.fail("the server kept the connection open")
    except ConnectionResetError:
        pass
    sock.close()


def assert_serving(client, tag):
    client.set(f"alive/{tag}", tag)
    assert client.get(f"alive/{tag}", timeout=5) == tag.encode()


def test_garbage_instead_of_the_handshake(server, client, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    sock = raw_connection(server)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\xff" * 64)
    port = sock.getsockname()[1]
    wait_for_log(caplog, f"TCPStore server on {server.address} turned away a connection from "
                 f"127.0.0.1:{port}: wrong secret")
    assert_dropped(sock)
    assert_serving(client, "garbage")


def test_garbage_after_authenticating(server, client, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    sock, _ = authed_connection(server)
    sock.sendall(LENGTH.pack(9) + b"\x77garbage!")
    record = wait_for_log(caplog, "sent a malformed")
    assert f"from 127.0.0.1:{sock.getsockname()[1]}" in record.getMessage()
    assert_dropped(sock)
    assert_serving(client, "garbage2")


def test_arguments_that_overrun_the_frame(server, client, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    sock, link = authed_connection(server)
    body = bytes([Op.SET]) + (2).to_bytes(4, "big") + (1000).to_bytes(4, "big") + b"k"
    sock.sendall(sealed(link, framed(body)))
    record = wait_for_log(caplog, "argument 0 claims 1000 bytes but only 1 remain")
    assert "malformed frame" in record.getMessage() or "malformed request" in record.getMessage()
    assert_dropped(sock)
    assert_serving(client, "overrun")


def test_truncated_frame_then_close(server, client, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    sock, _ = authed_connection(server)
    frame = encode(Op.SET, [b"truncated", b"x" * 100])
    sock.sendall(frame[:40])
    sock.close()
    wait_for_log(caplog, "closed the connection in the middle of a frame (40 bytes)")
    assert not client.check(["truncated"])
    assert_serving(client, "truncated")


def test_oversized_length_prefix_is_refused_before_reading(server, client, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    sock, _ = authed_connection(server)
    sock.sendall(LENGTH.pack(MAX_PAYLOAD + 1))  # and no body at all
    wait_for_log(caplog, f"frame length {MAX_PAYLOAD + 1} exceeds the {MAX_PAYLOAD}-byte")
    assert_dropped(sock)
    assert_serving(client, "oversized")


def read_challenge(sock):
    """The server's 37-byte challenge (magic, mode and nonce), which a silent peer never answers."""
    got = b""
    while len(got) < 36:
        chunk = sock.recv(36 - len(got))
        assert chunk, "the server closed before sending its challenge"
        got += chunk
    assert got.startswith(MAGIC)


def test_silent_connection_stalls_nobody_and_is_dropped(caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    server = TCPStoreServer("127.0.0.1", 0, handshake_timeout=1.5).start()
    try:
        silent = raw_connection(server)
        read_challenge(silent)
        with TCPStore("127.0.0.1", server.port, timeout=5) as client:
            assert_serving(client, "silent")
            with TCPStore("127.0.0.1", server.port, timeout=5) as other:
                assert other.get("alive/silent") == b"silent"
        # all of that happened while the silent peer still held its handshake
        assert not any("sent no proof" in r.getMessage() for r in caplog.records)
        wait_for_log(caplog, f"turned away a connection from 127.0.0.1:"
                     f"{silent.getsockname()[1]}: sent no proof in time (1.5s)")
        assert_dropped(silent)
    finally:
        server.stop()


def test_a_full_handshake_table_sheds_its_oldest_entry_not_the_newcomer(server, client, caplog):
    caplog.set_level(logging.WARNING, GATE_LOGGER)
    silent = [raw_connection(server) for _ in range(4)]
    for s in silent:
        read_challenge(s)
    wait_until(lambda: server._gate.num_pending == 4, "four handshakes are pending")
    with TCPStore("127.0.0.1", server.port, timeout=5) as newcomer:
        newcomer.set("newcomer", "served")
    assert client.get("newcomer") == b"served"
    assert_dropped(silent[0])  # the oldest idle one made room
    assert server._gate.num_pending <= 4
    wait_for_log(caplog, "shed to make room")
    for s in silent[1:]:
        s.close()


def test_wrong_token_is_refused_with_a_clear_error(server, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    with pytest.raises(
        AuthenticationError,
        match=rf"TCPStore could not authenticate to the server at 127\.0\.0\.1:{server.port}: .*"
              r"same SHOAL_AUTH_TOKEN",
    ):
        TCPStore("127.0.0.1", server.port, timeout=5, token="not-the-job-secret")
    wait_for_log(caplog, "wrong secret")


def test_flood_of_requests_behind_a_parked_wait_is_dropped(server, client, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    sock, link = authed_connection(server)
    get = encode(Op.GET, [b"30.0", b"flood/never"])
    sock.sendall(sealed(link, *[get] * 40))
    wait_for_log(caplog, "requests without waiting for the replies")
    assert_dropped(sock)
    wait_until(lambda: server.num_parked == 0, "the flooder's parked wait is gone")
    assert_serving(client, "flood")


def test_client_that_disconnects_while_waiting_disturbs_no_one(server, client):
    sock, link = authed_connection(server)
    sock.sendall(sealed(link, encode(Op.GET, [b"30.0", b"gone/key"])))
    wait_until(lambda: server.num_parked == 1, "the raw client's get is parked")
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault("v", client.get("gone/key", 10)))
    waiter.start()
    wait_until(lambda: server.num_parked == 2, "the store client's get is parked too")
    sock.close()
    wait_until(lambda: server.num_parked == 1, "the closed connection's wait is dropped")
    other = TCPStore("127.0.0.1", server.port, timeout=5)
    other.set("gone/key", "v")
    waiter.join(10)
    assert result == {"v": b"v"}
    other.close()


def test_server_stop_fails_waiting_clients_promptly(server):
    client = TCPStore("127.0.0.1", server.port, timeout=30)
    errors = []

    def wait():
        try:
            client.get("stop/never", timeout=30)
        except StoreError as exc:
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    wait_until(lambda: server.num_parked == 1, "the get is parked")
    start = time.monotonic()
    server.stop()
    t.join(10)
    assert time.monotonic() - start < 5
    assert len(errors) == 1
    assert f"lost the server at 127.0.0.1:{server.port}" in str(errors[0])
    with pytest.raises(StoreError, match=rf"could not reach the server at 127\.0\.0\.1:{server.port}"):
        client.set("stop/k", "v")
    client.close()


def test_a_new_client_is_served_while_500_idle_strangers_hold_connections():
    server = TCPStoreServer("127.0.0.1", 0).start()
    idle = []
    try:
        with TCPStore("127.0.0.1", server.port, timeout=5) as first:
            idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5)
                    for _ in range(500)]
            wait_until(lambda: server._gate.num_pending
                       + sum(server._gate.rejections.values()) >= 500,
                       "the server has seen every idle connection")
            start = time.monotonic()
            with TCPStore("127.0.0.1", server.port, timeout=5) as newcomer:
                newcomer.set("joined", "during the flood")
            assert time.monotonic() - start < 2.0
            assert first.get("joined") == b"during the flood"
    finally:
        for sock in idle:
            sock.close()
        server.stop()


class _SheddingProxy:
    """Closes the first `drop` connections at once (as a loaded server sheds them), then
    forwards every later one to `target`."""

    def __init__(self, target: int, drop: int):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target, self.drop, self.accepted = target, drop, 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            if self.accepted <= self.drop:
                sock.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            for a, b in ((sock, upstream), (upstream, sock)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    def close(self):
        self.listener.close()


def test_a_client_dropped_before_the_greeting_retries_and_is_not_told_to_check_its_secret(server):
    proxy = _SheddingProxy(server.port, drop=3)
    try:
        with TCPStore("127.0.0.1", proxy.port, timeout=5) as store:
            store.set("through", "the proxy")
            assert store.get("through") == b"the proxy"
        assert proxy.accepted >= 4
    finally:
        proxy.close()


def test_a_port_that_accepts_and_never_speaks_is_not_blamed_on_the_secret():
    mute = socket.create_server(("127.0.0.1", 0))
    port = mute.getsockname()[1]
    try:
        with pytest.raises(StoreError) as info:
            TCPStore("127.0.0.1", port, timeout=1.5)
        message = str(info.value)
        assert "accepted the connection but sent no greeting" in message
        assert "is it a shoal port" in message
        assert "SHOAL_AUTH_TOKEN" not in message
    finally:
        mute.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_store_on_all_interfaces_refuses_the_development_token(host, monkeypatch):
    for name in ("SHOAL_AUTH_TOKEN", "SHOAL_AUTH_TOKEN_FILE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(AuthenticationError, match=rf"uses '{host}', which is not a loopback "
                       r"address, and no secret is set: set SHOAL_AUTH_TOKEN"):
        TCPStoreServer(host, 0)
    with pytest.raises(AuthenticationError, match="not a loopback address"):
        TCPStore(host, 0, is_master=True, timeout=2)
    monkeypatch.setenv("SHOAL_AUTH_TOKEN", "a real secret")
    TCPStoreServer(host, 0).stop()
