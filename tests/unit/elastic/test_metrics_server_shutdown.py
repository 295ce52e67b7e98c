"""The agent's /metrics server stops quietly: connections still open at stop() (an idle one,
one whose request is being answered) end without asyncio logging a CancelledError traceback,
which used to follow every scraped job's last line."""

import logging
import socket
import urllib.request

from shoal.elastic.metrics import MetricsServer


def test_stopping_with_open_connections_logs_no_traceback(caplog):
    caplog.set_level(logging.DEBUG, logger="asyncio")
    server = MetricsServer("127.0.0.1", 0, None)
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(3)]
    # A scrape whose answer nobody reads: its task may still be writing when stop() comes.
    busy = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    busy.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    # Connections are accepted in order: once a later scrape is answered, these are open.
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as reply:
        assert reply.status == 200
    try:
        server.stop(linger=0)
    finally:
        for conn in idle + [busy]:
            conn.close()
    # The loop's thread has ended: anything asyncio had to say is in the log by now.
    noisy = [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.WARNING]
    assert not noisy, [r.getMessage() for r in noisy]
