"""The agent's /metrics server under abuse: idle connections time out, hundreds of them do not
crowd out a scrape, and running out of file descriptors only pauses it."""

import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from shoal.elastic.metrics import MetricsServer


def _scrape(port: int, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as reply:
        assert reply.status == 200
        return reply.read()


def _idle(port: int, n: int) -> list[socket.socket]:
    conns = []
    for _ in range(n):
        conns.append(socket.create_connection(("127.0.0.1", port), timeout=5))
    return conns


def test_an_idle_connection_is_closed_after_the_read_timeout():
    server = MetricsServer("127.0.0.1", 0, None, read_timeout=0.3)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as idle:
            started = time.monotonic()
            assert idle.recv(1) == b""  # closed by the server
            assert time.monotonic() - started < 3
        assert any("without a request" in kind for kind in server.trouble)
    finally:
        server.stop()


def test_a_scrape_succeeds_while_300_idle_connections_are_held(caplog):
    server = MetricsServer("127.0.0.1", 0, None, max_connections=64)
    conns = _idle(server.port, 300)
    try:
        started = time.monotonic()
        assert b"python_gc_objects_collected_total" in _scrape(server.port)
        assert time.monotonic() - started < 2
        evicted = sum(n for kind, n in server.trouble.items() if "over the cap" in kind)
        assert evicted >= 300 - 64
    finally:
        for conn in conns:
            conn.close()
        server.stop()
    lines = [r for r in caplog.records if "Metrics server at" in r.getMessage()]
    assert 1 <= len(lines) <= 3, [r.getMessage() for r in lines]  # a summary, not 236 lines


def test_a_taken_port_raises_oserror():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            MetricsServer("127.0.0.1", taken.getsockname()[1], None)


SERVE_WITH_FEW_FDS = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))
    import logging
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from elastic.metrics import MetricsServer
    server = MetricsServer("127.0.0.1", 0, None, read_timeout=30, log_interval=60)
    print(server.port, flush=True)
    sys.stdin.read()  # serve until the test closes our stdin
    server.stop()
""")


@pytest.mark.slow
def test_running_out_of_descriptors_pauses_the_server_and_it_serves_again():
    proc = subprocess.Popen([sys.executable, "-c", SERVE_WITH_FEW_FDS], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    conns = []
    err = ""
    try:
        port = int(proc.stdout.readline())
        conns = _idle(port, 80)  # far more than the server's 48 descriptors
        with pytest.raises(OSError):  # it cannot accept one more: the scrape times out
            _scrape(port, timeout=1.5)
        for conn in conns:
            conn.close()
        conns = []
        deadline = time.monotonic() + 10
        while True:  # asyncio resumes accepting within a second or so
            try:
                assert b"python_gc_objects" in _scrape(port, timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
        assert proc.poll() is None
    finally:
        for conn in conns:
            conn.close()
        try:
            err = proc.communicate("", timeout=10)[1]
        except subprocess.TimeoutExpired:
            proc.kill()
            err = proc.communicate()[1]
    assert "Traceback" not in err, err
    pauses = [line for line in err.splitlines() if "out of file descriptors" in line]
    assert 1 <= len(pauses) <= 2, err  # one summary line (and the final one at stop)
