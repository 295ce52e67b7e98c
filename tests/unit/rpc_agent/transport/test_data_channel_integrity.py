"""The data channel checks every frame after the handshake (issue 34): a peer that proved the
secret but sends frames without this connection's tags, or a relay that alters one byte in
flight, is dropped before any transfer reaches the agent; honest transfers arrive intact, tagged
or encrypted (SHOAL_ENCRYPT)."""

from __future__ import annotations

import logging
import queue
import socket
import struct
import threading

import numpy as np
import pytest

from shoal.core import auth
from shoal.rpc_agent.transport.data_channel import PURPOSE, DataChannels
from tests.support.relay import pump

TOKEN = b"data-channel-integrity-test-secret"
WAIT_S = 5.0


def _label(peer_id: int):
    return f"worker 'w{peer_id}' (id {peer_id})" if peer_id in (0, 1) else None


class _Side:
    """One DataChannels and what it saw."""

    def __init__(self, worker_id: int):
        self.received: queue.SimpleQueue = queue.SimpleQueue()
        self.dead: queue.SimpleQueue = queue.SimpleQueue()
        self.channels = DataChannels(
            name=f"w{worker_id}", worker_id=worker_id, token=TOKEN, host="127.0.0.1",
            on_transfer=lambda peer, tid, array: self.received.put((peer, tid, bytes(array))),
            on_dead=lambda peer, reason: self.dead.put((peer, reason)), peer_label=_label)
        self.port = self.channels.start()


@pytest.fixture(params=["tagged", "encrypted"])
def mode(request, monkeypatch):
    monkeypatch.setenv("SHOAL_ENCRYPT", "1" if request.param == "encrypted" else "0")
    return request.param


@pytest.fixture
def pair(mode):
    a, b = _Side(0), _Side(1)
    yield a, b
    a.channels.close()
    b.channels.close()


def _send(side: _Side, port: int, payload: np.ndarray, transfer_id: int = 7) -> None:
    errors = []
    side.channels.send(1, ("127.0.0.1", port), [(transfer_id, memoryview(payload))],
                       errors.append)
    assert not errors, errors


@pytest.mark.parametrize("nbytes", [0, 100, 3 * 1024 * 1024 + 5])
def test_transfers_arrive_intact(pair, nbytes):
    a, b = pair
    payload = np.frombuffer(np.random.default_rng(0).bytes(nbytes), dtype=np.uint8)
    _send(a, b.port, payload)
    _send(a, b.port, payload[: nbytes // 2], transfer_id=8)
    assert b.received.get(timeout=WAIT_S) == (0, 7, payload.tobytes())
    assert b.received.get(timeout=WAIT_S) == (0, 8, payload[: nbytes // 2].tobytes())


def test_untagged_frames_after_an_honest_handshake_are_dropped(pair, caplog):
    # What a relay that forwarded a real worker's handshake can do: speak on the connection
    # without the keys. Before issue 34 the transfer reached the agent.
    _, b = pair
    with socket.create_connection(("127.0.0.1", b.port), timeout=WAIT_S) as sock:
        auth.client_handshake(sock, TOKEN, PURPOSE)
        with caplog.at_level(logging.WARNING):
            sock.sendall(struct.pack("!i", 0) + struct.pack("!QQ", 9, 5) + b"evil!" * 20)
            sock.settimeout(WAIT_S)
            try:
                assert sock.recv(64) == b""  # the worker closed the connection
            except ConnectionResetError:
                pass
    with pytest.raises(queue.Empty):
        b.received.get(timeout=0.5)
    assert any("failed its integrity check" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records]


class _FlippingRelay:
    """Forwards one connection both ways and flips the byte at `offset` of what the client
    sends (a relay that tampers in flight)."""

    def __init__(self, target_port: int, offset: int):
        self._target = target_port
        self._offset = offset
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        self._listener.settimeout(WAIT_S)
        client, _ = self._listener.accept()
        server = socket.create_connection(("127.0.0.1", self._target), timeout=WAIT_S)
        threading.Thread(target=pump, args=(server, client), daemon=True).start()
        pump(client, server, self._offset)


def test_one_byte_altered_in_flight_drops_the_connection(pair, caplog):
    a, b = pair
    # The handshake's answer, the id frame and the header frame (each tagged, or sealed, with
    # 16 bytes), then the 11th byte of the payload.
    relay = _FlippingRelay(b.port, auth.REPLY_BYTES + (4 + 16) + (16 + 16) + 10)
    payload = np.arange(4096, dtype=np.uint8)
    with caplog.at_level(logging.WARNING):
        _send(a, relay.port, payload)
        peer, reason = b.dead.get(timeout=WAIT_S)
    assert peer == 0 and "failed its integrity check" in reason, reason
    assert "worker 'w0' (id 0)" in reason, reason
    with pytest.raises(queue.Empty):
        b.received.get(timeout=0.2)
