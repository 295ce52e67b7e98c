"""A relay between an honest TCPStore client and the real server (issue 34).

The relay runs in its own process and forwards the handshake untouched, so the server admits
the connection (the verdict proves the client); afterwards it speaks on the connection itself:
it injects its own SET, rewrites a value in flight, or replays a captured ADD. The server must
check every frame before it acts on it: it drops that connection without applying the frame,
names the peer and the integrity failure, tells the honest client why, and keeps serving others.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import queue
import secrets
import socket
import threading

import pytest

from shoal.collectives.store.server import TCPStoreServer
from shoal.collectives.store.tcp import TCPStore
from shoal.collectives.store.wire import LENGTH, Op, encode
from shoal.collectives.types import StoreError
from shoal.core.auth import DIGEST_BYTES, GREETING_BYTES, REPLY_BYTES
from shoal.core.channel import TAG_BYTES
from tests.support.fuzz import wait_until

TOKEN = secrets.token_hex(32).encode()
IO_TIMEOUT_S = 10.0
JOIN_S = 20.0
FORGED_KEY = b"relay/forged"


# ------------------------------------------------------------------ the relay (a child process)
# Each socket is read through one buffered file, whose read(n) returns n bytes unless the
# connection ended first.

def _read(rfile, n: int) -> bytes:
    data = rfile.read(n)
    if len(data) != n:
        raise ConnectionError("closed")
    return data


def _read_frame(rfile) -> bytes:
    """One whole frame as it travels: its length prefix and the bytes it counts."""
    prefix = _read(rfile, LENGTH.size)
    (length,) = LENGTH.unpack(prefix)
    return prefix + _read(rfile, length)


def _pump(rfile, dst: socket.socket) -> None:
    try:
        while data := rfile.read1(65536):
            dst.sendall(data)
    except (OSError, ValueError):  # ValueError: the other direction closed the file
        pass
    try:
        dst.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _client_to_server(mode: str, client, server: socket.socket) -> None:
    """Forward the client's frames, tampering with them as `mode` says, then pump the rest."""
    try:
        if mode == "inject":
            first = _read_frame(client)  # the client's JOIN
            # A SET of the relay's own, with a tag it cannot compute (16 zero bytes).
            server.sendall(encode(Op.SET, [FORGED_KEY, b"pwned"]) + bytes(TAG_BYTES) + first)
        elif mode == "rewrite":
            server.sendall(_read_frame(client))  # the JOIN passes untouched
            frame = bytearray(_read_frame(client))  # the SET of the victim key
            frame[-TAG_BYTES - 1] ^= 0x01  # the value's last byte (before the tag)
            server.sendall(frame)
        elif mode == "replay":
            server.sendall(_read_frame(client))  # the JOIN
            frame = _read_frame(client)  # the ADD
            server.sendall(frame + frame)  # and its copy: the counter must move once
    except OSError:
        pass
    _pump(client, server)


def _relay_one(server_port: int, mode: str, client: socket.socket) -> None:
    server = socket.create_connection(("127.0.0.1", server_port), timeout=IO_TIMEOUT_S)
    client.settimeout(IO_TIMEOUT_S)
    with client, server, client.makefile("rb") as from_client, \
            server.makefile("rb") as from_server:
        try:
            # The handshake, untouched: the server's greeting, the client's proof, the verdict.
            client.sendall(_read(from_server, GREETING_BYTES))
            server.sendall(_read(from_client, REPLY_BYTES))
            client.sendall(_read(from_server, DIGEST_BYTES))
        except OSError:
            return
        back = threading.Thread(target=_pump, args=(from_server, client), daemon=True)
        back.start()
        _client_to_server(mode, from_client, server)
        back.join(IO_TIMEOUT_S)


def relay_main(server_port: int, mode: str, ports) -> None:
    """Relay every connection to the server until killed; tamper with the first one as `mode`
    says."""
    listener = socket.create_server(("127.0.0.1", 0))
    ports.put(listener.getsockname()[1])
    first = True
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_relay_one, daemon=True,
                         args=(server_port, mode if first else "forward", client)).start()
        first = False


# ------------------------------------------------------------------ the tests

@pytest.fixture(autouse=True)
def _server_warnings(caplog):
    caplog.set_level(logging.WARNING, "shoal.collectives.store.server")


@pytest.fixture
def server():
    server = TCPStoreServer("127.0.0.1", 0, token=TOKEN).start()
    yield server
    server.stop()


@pytest.fixture
def direct(server):
    store = TCPStore("127.0.0.1", server.port, timeout=5, token=TOKEN)
    yield store
    store.close()


@contextlib.contextmanager
def relayed(server_port: int, mode: str):
    """The port of a relay process to the server, tampering as `mode` says."""
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    proc = ctx.Process(target=relay_main, args=(server_port, mode, ports), daemon=True)
    proc.start()
    try:
        try:
            port = ports.get(timeout=JOIN_S)
        except queue.Empty:
            pytest.fail(f"the relay did not start within {JOIN_S}s (exit code {proc.exitcode})")
        yield port
    finally:
        proc.kill()
        proc.join(JOIN_S)


def _integrity_drops(caplog) -> list[str]:
    """The server's warnings that it dropped a connection for a frame that failed its check."""
    return [r.getMessage() for r in caplog.records
            if r.name == "shoal.collectives.store.server" and r.levelno >= logging.WARNING
            and "dropped the connection from 127.0.0.1:" in r.getMessage()
            and "integrity check" in r.getMessage()]


def _assert_dropped_for_integrity(caplog) -> None:
    wait_until(lambda: _integrity_drops(caplog),
               "the server logs the dropped connection and its integrity failure")


def test_a_set_injected_after_a_relayed_handshake_is_refused(server, direct, caplog):
    with relayed(server.port, "inject") as port:
        with pytest.raises(StoreError, match="integrity check"):
            TCPStore("127.0.0.1", port, timeout=5, token=TOKEN)
    assert not direct.check([FORGED_KEY.decode()]), "the server applied the relay's SET"
    _assert_dropped_for_integrity(caplog)
    wait_until(lambda: server.num_connections == 1, "only the direct client is connected")
    direct.set("still", "served")
    assert direct.get("still", timeout=5) == b"served"


def test_a_value_rewritten_in_flight_is_refused(server, direct, caplog):
    with relayed(server.port, "rewrite") as port, \
            TCPStore("127.0.0.1", port, timeout=5, token=TOKEN) as victim:
        with pytest.raises(StoreError, match="integrity check"):
            victim.set("victim", b"honest-value-" * 4)
    assert not direct.check(["victim"]), "the server applied a rewritten value"
    _assert_dropped_for_integrity(caplog)
    direct.set("victim", "direct")
    assert direct.get("victim", timeout=5) == b"direct"


def test_a_replayed_frame_is_refused(server, direct, caplog):
    with relayed(server.port, "replay") as port, \
            TCPStore("127.0.0.1", port, timeout=5, token=TOKEN) as victim:
        assert victim.add("counter", 1) == 1
    # Wait for the server's verdict on the copy: refused (logged), or applied (counter 2).
    wait_until(lambda: _integrity_drops(caplog) or direct.add("counter", 0) != 1,
               "the server judges the replayed ADD")
    assert direct.add("counter", 0) == 1, "the replayed ADD was applied"
    _assert_dropped_for_integrity(caplog)
