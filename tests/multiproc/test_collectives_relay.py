"""A relay between two ranks of a tcp group (issue 34): the collectives mesh must check every
frame after the handshake, on the data channels and the control channel, over TCP and over a
Unix socket.

Rank 1 is handed the relay's address for rank 0 (as an attacker who rewrote the address would
hand it). The relay runs in its own process and forwards the handshake untouched, so rank 0
admits the connection; afterwards it tampers with what rank 1 sends: it flips a byte of a
payload in flight, overwrites a stretch of payload with its own values, or injects a forged
abort notice on the control connection. Every rank must then fail with an error that names
rank 1 and the integrity check: never a wrong result, never a hang.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
import traceback

import numpy as np
import pytest

from tests.support.ranks import CTX, Ranks, agent_store

from shoal.collectives.backends.tcp import wire
from shoal.collectives.store.tcp import TCPStore
from shoal.core.auth import DIGEST_BYTES, GREETING_BYTES, REPLY_BYTES

IO_TIMEOUT_S = 10.0
ACCEPT_S = 30.0
PREFIX = "shoal/pg/default/0"
# Where the relay tampers with rank 1's data stream, counted from the end of the handshake:
# past the hello, the shared-memory setup and the first data header, inside the payload.
TAMPER_AT = 64 * 1024
ELEMENTS = 1 << 20  # 4 MiB of float32: a ring all_reduce over the sockets


# ------------------------------------------------------------------ the relay (a child process)

def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return bytes(buf)


def _shut(*socks: socket.socket) -> None:
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _pump(src: socket.socket, dst: socket.socket, edit=None) -> None:
    """Forward src to dst; `edit(offset, bytearray)` may change each chunk in flight."""
    offset = 0
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            if edit is not None:
                data = bytearray(data)
                edit(offset, data)
            offset += len(data)
            dst.sendall(data)
    except OSError:
        pass
    _shut(src, dst)


def _flip(offset: int, data: bytearray) -> None:
    if offset <= TAMPER_AT < offset + len(data):
        data[TAMPER_AT - offset] ^= 0x01


def _overwrite(offset: int, data: bytearray) -> None:
    """The relay's own values over 4 KiB of rank 1's payload (float32 1000.0, 0x447a0000)."""
    forged = np.full(1024, 1000.0, np.float32).tobytes()
    lo, hi = max(offset, TAMPER_AT), min(offset + len(data), TAMPER_AT + len(forged))
    if lo < hi:
        data[lo - offset:hi - offset] = forged[lo - TAMPER_AT:hi - TAMPER_AT]


def forged_abort() -> bytes:
    """An abort notice the relay makes up, blaming rank 0, with a tag it cannot compute."""
    body = json.dumps({"kind": "error", "cause": "forged by the relay", "origin": 1,
                       "culprits": [0]}).encode()
    head = wire.CONTROL_HEADER.pack(wire.CONTROL_MAGIC, wire.KIND_ABORT, 0, 0, len(body))
    return head + bytes(16) + body + bytes(16)


def _relay_one(target, family: int, mode: str, client: socket.socket) -> None:
    server = socket.socket(family, socket.SOCK_STREAM)
    server.settimeout(IO_TIMEOUT_S)
    client.settimeout(IO_TIMEOUT_S)
    try:
        server.connect(target)
        # The handshake, untouched: rank 0's greeting, rank 1's proof, rank 0's verdict.
        client.sendall(_recv_exact(server, GREETING_BYTES))
        server.sendall(_recv_exact(client, REPLY_BYTES))
        client.sendall(_recv_exact(server, DIGEST_BYTES))
        if mode == "control":
            server.sendall(client.recv(4096))  # rank 1's hello (one send)
            client.sendall(server.recv(4096))  # rank 0's acknowledgement (one send)
            server.sendall(forged_abort())
        client.settimeout(None)
        server.settimeout(None)
    except OSError:
        _shut(client, server)
        client.close()
        server.close()
        return
    edit = {"flip": _flip, "overwrite": _overwrite}.get(mode)
    back = threading.Thread(target=_pump, args=(server, client), daemon=True)
    back.start()
    _pump(client, server, edit)
    back.join(IO_TIMEOUT_S)
    client.close()
    server.close()


def _target(store, transport: str):
    """Rank 0's real address (what rank 1 would have dialled), read from the store."""
    if transport == "unix":
        return store.get(f"{PREFIX}/unix/0", timeout=ACCEPT_S).partition(b"\n")[2]
    host, _, port = store.get(f"{PREFIX}/addr/0", timeout=ACCEPT_S).decode().rpartition(":")
    return host, int(port)


def relay_main(store_port: int, transport: str, mode: str, addresses, results) -> None:
    """Relay rank 1's connections to rank 0; tamper with one of them as `mode` says: the first
    (rank 1's sending data channel) for "flip"/"overwrite", the third (control) for "control"."""
    try:
        family = socket.AF_UNIX if transport == "unix" else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.bind(b"\0shoal-test-relay-" + os.urandom(8).hex().encode()
                      if transport == "unix" else ("127.0.0.1", 0))
        listener.listen(16)
        listener.settimeout(ACCEPT_S)
        addresses.put(listener.getsockname())
        store = TCPStore("127.0.0.1", store_port, timeout=ACCEPT_S)
        target = None
        tampered = {"flip": 0, "overwrite": 0, "control": 2}[mode]
        threads = []
        for index in range(3):  # rank 1 dials its channels in order: up, down, control
            client, _ = listener.accept()
            target = target or _target(store, transport)
            threads.append(threading.Thread(
                target=_relay_one, daemon=True,
                args=(target, family, mode if index == tampered else "forward", client)))
            threads[-1].start()
        results.put(None)
        for thread in threads:  # relay until the ranks are done (the test then kills us)
            thread.join(ACCEPT_S * 4)
    except BaseException:  # noqa: BLE001  (handed to the test, which reports it)
        results.put(traceback.format_exc())


# ------------------------------------------------------------------ the ranks

class _Redirected(TCPStore):
    """Rank 1's view of the store: rank 0's addresses lead to the relay."""

    def __init__(self, port: int, relay):
        super().__init__("127.0.0.1", port, timeout=30)
        self._relay = relay

    def get(self, key, timeout=None):
        if key == f"{PREFIX}/addr/0":
            super().get(key, timeout=timeout)  # wait until rank 0 published it
            return f"127.0.0.1:{self._relay[1]}".encode()
        if key == f"{PREFIX}/unix/0":
            identity = super().get(key, timeout=timeout).partition(b"\n")[0]
            return identity + b"\n" + self._relay
        return super().get(key, timeout=timeout)


def _rank(rank, world, store_port, relay):
    import shoal.collectives as c

    store = (_Redirected(store_port, relay) if rank == 1
             else TCPStore("127.0.0.1", store_port, timeout=30))
    try:
        c.init_process_group("tcp", store=store, rank=rank, world_size=world, timeout=30)
    except c.CollectiveError as exc:  # the relay may strike while the group sets up
        return ("error", type(exc).__name__, str(exc))
    expected = np.arange(ELEMENTS, dtype=np.float32) * 3
    for _ in range(5):
        a = np.arange(ELEMENTS, dtype=np.float32) * (rank + 1)
        try:
            c.all_reduce(a, timeout=20)
        except c.CollectiveError as exc:
            return ("error", type(exc).__name__, str(exc))
        if not np.array_equal(a, expected):
            return ("wrong result", None, None)
    return ("ok", None, None)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
@pytest.mark.parametrize("mode", ["flip", "overwrite", "control"])
def test_a_relay_cannot_alter_or_inject_frames_between_ranks(transport, mode):
    store, env = agent_store()
    env["SHOAL_LOCAL_TRANSPORT"] = transport
    addresses, relay_results = CTX.Queue(), CTX.Queue()
    relay = CTX.Process(target=relay_main,
                        args=(store.port, transport, mode, addresses, relay_results), daemon=True)
    relay.start()
    try:
        relay_address = addresses.get(timeout=30)
        with Ranks(_rank, 2, (store.port, relay_address), env) as ranks:
            results = ranks.results(timeout=90)
        try:
            failure = relay_results.get(timeout=5)
        except queue.Empty:
            failure = None
        assert failure is None, (failure, results)
    finally:
        relay.kill()
        relay.join(5)
        store.close()
    for rank in (0, 1):
        status, value = results[rank]
        assert status == "ok", results[rank]
        outcome, kind, message = value
        assert outcome == "error", f"rank {rank}: {outcome} ({mode} over {transport})"
        if rank == 1 and mode == "control" and "integrity" not in message:
            # The forged abort reaches rank 0 while rank 1 may still be setting up shared memory
            # with it: rank 0 drops the link at once, and rank 1 can fail on that broken link
            # before rank 0's verdict reaches it. It must still fail, naming its peer.
            assert kind == "CollectiveError" and "rank 0" in message, (rank, kind, message)
            continue
        assert "rank 1" in message and "integrity" in message, (rank, kind, message)
