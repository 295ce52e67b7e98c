"""core.admission.Gatekeeper over real sockets: floods of idle and garbage connections, per-source
bounds, rate-limited logs and descriptor exhaustion. Each test owns its listener and threads."""

from __future__ import annotations

import logging
import os
import queue
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from shoal.core import auth
from shoal.core.admission import CLOSED, SHED, SILENT, WRONG_SECRET, Gatekeeper
from shoal.core.errors import AuthenticationError

TOKEN = b"the job's secret"
PURPOSE = "store"


def wait_until(condition, what, timeout=10.0):
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout}s waiting until {what}")
        time.sleep(0.01)


class Port:
    """A gatekeeper on 127.0.0.1:0 whose admitted sockets land in `admitted`."""

    def __init__(self, **kwargs):
        self.admitted: queue.Queue = queue.Queue()
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
        self.address = self.listener.getsockname()
        self.gate = Gatekeeper(what="test port", token=TOKEN, purpose=PURPOSE,
                               on_admit=lambda sock, peer, link: self.admitted.put((sock, peer)),
                               **kwargs)
        self.gate.add_listener(self.listener)
        self.gate.start()

    def dial(self, token=TOKEN, timeout=5.0) -> socket.socket:
        return auth.dial_link(lambda left: socket.create_connection(self.address, timeout=left),
                              token, PURPOSE, timeout)[0]

    def idle(self) -> socket.socket:
        """A connection that never answers (the greeting waits unread in its receive buffer)."""
        sock = socket.create_connection(self.address, timeout=5)
        return sock

    def close(self):
        self.gate.close()
        self.listener.close()
        while not self.admitted.empty():
            self.admitted.get()[0].close()


@pytest.fixture
def port():
    p = Port(greeting_timeout=3.0)
    yield p
    p.close()


def test_a_right_secret_client_is_admitted_with_a_blocking_socket(port):
    client = port.dial()
    sock, peer = port.admitted.get(timeout=5)
    assert sock.getblocking() and sock.gettimeout() is None
    assert peer == f"127.0.0.1:{client.getsockname()[1]}"
    client.sendall(b"ping")
    assert sock.recv(4) == b"ping"
    client.close()
    sock.close()


def test_a_right_secret_client_is_served_while_500_idle_connections_are_held(port):
    idle = [port.idle() for _ in range(500)]
    try:
        wait_until(lambda: port.gate.num_pending + sum(port.gate.rejections.values()) >= 500,
                   "the gatekeeper has seen every idle connection")
        assert port.gate.num_pending <= 128  # the per-source bound (all from 127.0.0.1)
        for _ in range(5):
            start = time.monotonic()
            client = port.dial(timeout=5)
            port.admitted.get(timeout=5)[0].close()
            client.close()
            assert time.monotonic() - start < 2.0
        assert port.gate.rejections[SHED] + port.gate.rejections[SILENT] >= 500 - 128
    finally:
        for sock in idle:
            sock.close()


def test_the_total_bound_sheds_the_oldest_pending_handshake():
    p = Port(max_pending=8, max_pending_per_source=8)
    try:
        idle = [p.idle() for _ in range(8)]
        wait_until(lambda: p.gate.num_pending == 8, "eight handshakes are pending")
        client = p.dial()
        p.admitted.get(timeout=5)[0].close()
        client.close()
        assert _greeting_then_eof(idle[0])  # the oldest was shed
        assert p.gate.rejections[SHED] == 1
        assert p.gate.num_pending == 7
        for sock in idle:
            sock.close()
    finally:
        p.close()


def test_silent_connections_expire_at_the_greeting_deadline():
    p = Port(greeting_timeout=0.3)
    try:
        silent = p.idle()
        wait_until(lambda: p.gate.rejections[SILENT] == 1, "the silent peer expired", 5)
        assert _greeting_then_eof(silent)
        silent.close()
    finally:
        p.close()


def test_garbage_and_wrong_secrets_are_refused_and_logged_once_per_interval(port, caplog):
    caplog.set_level(logging.WARNING, "shoal.core.admission")
    for i in range(200):
        sock = socket.create_connection(port.address, timeout=5)
        if i % 2:
            sock.sendall(os.urandom(auth.REPLY_BYTES))
        else:
            with pytest.raises(AuthenticationError, match="refused this process's secret"):
                auth.client_handshake(sock, b"wrong", PURPOSE, timeout=5)
        sock.close()
    wait_until(lambda: sum(port.gate.rejections.values()) == 200, "every stranger was judged")
    assert port.gate.rejections[WRONG_SECRET] + port.gate.rejections[CLOSED] == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "shoal.core.admission"]
    assert len(lines) == 1, lines  # the first at once; the rest wait for the interval
    assert lines[0].startswith("test port turned away a connection from 127.0.0.1:")
    port.gate.close()  # a close flushes the summary
    lines = [r.getMessage() for r in caplog.records if r.name == "shoal.core.admission"]
    assert len(lines) == 2, lines
    assert "test port turned away 199 connection(s) in the last" in lines[1]
    assert "from 127.0.0.1 (199)" in lines[1]


def test_the_development_token_is_refused_on_a_non_loopback_listener():
    listener = socket.create_server(("0.0.0.0", 0))
    gate = Gatekeeper(what="Rank 0's port", token=auth._INSECURE_DEFAULT, purpose=PURPOSE,
                      on_admit=lambda sock, peer, link: sock.close())
    try:
        with pytest.raises(AuthenticationError, match="Rank 0's port uses '0.0.0.0', which is "
                           "not a loopback address, and no secret is set"):
            gate.add_listener(listener)
    finally:
        gate.close()
        listener.close()


# A server with few descriptors: it fills its table with files, a client connects (accept fails
# with EMFILE), then the files are closed and the same client must be served.
_EMFILE_SERVER = textwrap.dedent("""
    import os, resource, socket, sys
    from core.admission import Gatekeeper
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    def admit(sock, peer, link):
        sock.sendall(b"served"); sock.close()
    gate = Gatekeeper(what="tiny port", token=b"k", purpose="store", on_admit=admit)
    gate.add_listener(listener)
    gate.start()
    hog = []
    try:
        while True:
            hog.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    print(listener.getsockname()[1], flush=True)
    sys.stdin.readline()              # the parent has connected and watched us rest
    for fd in hog:
        os.close(fd)
    sys.stdin.readline()              # the parent was served
    print(gate.rejections["no free descriptor"], flush=True)
""")


def test_an_accept_loop_rests_while_descriptors_run_out_and_accepts_again(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", _EMFILE_SERVER], cwd=root, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        port = int(proc.stdout.readline())
        client = socket.create_connection(("127.0.0.1", port), timeout=10)
        # The kernel completed the connection; the server cannot accept it yet. Give it a
        # second of EMFILE: it must rest (little CPU), not spin.
        before = _cpu_seconds(proc.pid)
        time.sleep(1.0)
        assert _cpu_seconds(proc.pid) - before < 0.3
        proc.stdin.write("free\n")
        proc.stdin.flush()
        auth.client_handshake(client, b"k", "store", timeout=10)
        client.settimeout(10)
        assert client.recv(16) == b"served"
        client.close()
        proc.stdin.write("done\n")
        proc.stdin.flush()
        rested = int(proc.stdout.readline())
        assert rested >= 1
        assert proc.wait(10) == 0
        err = proc.stderr.read()
        assert err.count("tiny port cannot accept") == 1, err  # logged once, not per retry
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _greeting_then_eof(sock: socket.socket) -> bool:
    """The server greeted this connection and then closed it without a verdict."""
    sock.settimeout(5)
    got = b""
    while chunk := sock.recv(4096):
        got += chunk
    return got.startswith(auth.MAGIC) and len(got) == auth.GREETING_BYTES


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
