"""Right-secret clients that announce huge frames and stall, against a store server whose
address space is limited (issue 34): the server allocates a frame's body as its bytes arrive,
caps the bytes in flight, and a failed allocation drops only the connection that caused it.

The server runs in a child process under RLIMIT_AS (its size at start plus a little over two
maximal frames), so a server that allocated each announced frame up front would hit
MemoryError within three connections, and before the fix that MemoryError escaped
`serve_forever` and closed the store for everyone.
"""

from __future__ import annotations

import os
import secrets
import selectors
import socket
import subprocess
import sys
import time

import pytest

from shoal.collectives.store.tcp import TCPStore
from shoal.collectives.store.wire import LENGTH, MAX_FRAME_BYTES
from shoal.core import auth

TOKEN = secrets.token_hex(32)
START_S = 30.0
MIB = 1 << 20
# Room above the server's size at start: two maximal frames fit, a third does not.
HEADROOM = 2 * MAX_FRAME_BYTES + 100 * MIB

_SERVER = r"""
import os, resource, sys
from shoal.collectives.store.server import TCPStoreServer

def vm_size():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")

server = TCPStoreServer("127.0.0.1", 0, token=os.environ["SHOAL_AUTH_TOKEN"])
limit = vm_size() + int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
print(server.port, flush=True)
server.serve_forever()
"""


@pytest.fixture
def limited_server():
    env = dict(os.environ, SHOAL_AUTH_TOKEN=TOKEN, MALLOC_ARENA_MAX="2")
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(HEADROOM)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = _readline(proc, START_S)
        yield proc, int(line)
    finally:
        proc.kill()
        proc.wait(START_S)
        proc.stdout.close()
        proc.stderr.close()


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            pytest.fail(f"the store server printed no port within {timeout:g}s")
    line = proc.stdout.readline()
    if not line:
        pytest.fail(f"the store server exited ({proc.wait(5)}): {proc.stderr.read()[-2000:]}")
    return line


def _stalled_frame(port: int, body: int = 0):
    """A right-secret connection that announces a maximal frame, sends `body` bytes of it,
    and stalls."""

    def connect(timeout: float):
        return socket.create_connection(("127.0.0.1", port), timeout=timeout)

    sock, _link = auth.dial_link(connect, TOKEN.encode(), "store", 10.0)
    sock.sendall(LENGTH.pack(MAX_FRAME_BYTES) + bytes(body))
    return sock


def _served(store: TCPStore, i: int, proc: subprocess.Popen) -> None:
    assert proc.poll() is None, f"the store server died: {proc.stderr.read()[-2000:]}"
    store.set(f"ok/{i}", str(i))
    assert store.get(f"ok/{i}", timeout=5) == str(i).encode()


def test_stalled_maximal_frames_cost_the_server_nothing(limited_server):
    proc, port = limited_server
    stalled = []
    with TCPStore("127.0.0.1", port, timeout=10, token=TOKEN) as store:
        try:
            for i in range(40):
                stalled.append(_stalled_frame(port))
                _served(store, i, proc)
            time.sleep(0.2)
            _served(store, -1, proc)
        finally:
            for sock in stalled:
                sock.close()
        _served(store, -2, proc)


def test_bodies_past_the_address_space_drop_only_their_connections(limited_server):
    """Frames that really send their bytes: the caps, or a failed allocation, drop those
    connections; the server and a well-behaved client carry on."""
    proc, port = limited_server
    stalled = []
    with TCPStore("127.0.0.1", port, timeout=10, token=TOKEN) as store:
        try:
            for i in range(6):
                try:
                    stalled.append(_stalled_frame(port, body=120 * MIB))
                except OSError:  # the server dropped it while we were still sending
                    pass
                _served(store, i, proc)
        finally:
            for sock in stalled:
                sock.close()
        _served(store, -1, proc)
