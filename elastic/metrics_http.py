"""A small, hardened HTTP server for /metrics (the exposition itself stays prometheus_client's).

prometheus_client.start_http_server is a ThreadingHTTPServer with no timeouts: every
connection gets a thread that waits forever for a request, so a few hundred idle connections
(a port scanner, a broken scraper) pin threads and descriptors, and when the process runs out
of descriptors socketserver's accept loop spins without a word. This server runs on one
asyncio loop in a thread of its own:

- each connection has `read_timeout` seconds to send its request head, and `write_timeout` to
  take the answer; idle ones cost a descriptor and a coroutine, never a thread;
- at most `max_connections` are open; when a new one arrives at the cap, the oldest one still
  waiting for its request is closed at once (a scraper sends its request at once, so holding
  connections open cannot crowd out the next scrape);
- asyncio's accept loop survives EMFILE/ENFILE by pausing accepts for a second; we only
  count those pauses;
- what goes wrong is counted and logged as one summary line per `log_interval`, never a line
  per connection.

The response is computed by prometheus_client's WSGI app (`make_wsgi_app`), in a worker thread,
so content negotiation, gzip and the multiprocess collector behave exactly as before.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import socket
import ssl
import threading
import time
import urllib.parse
from typing import Callable, Optional

logger = logging.getLogger(__name__)

DEFAULT_READ_TIMEOUT_S = 5.0
DEFAULT_WRITE_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 128
DEFAULT_LOG_INTERVAL_S = 30.0
_MAX_HEAD_BYTES = 16 * 1024
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class Tally:
    """Counts of trouble by kind, logged as one line per interval (the first at once)."""

    def __init__(self, where: str, interval: float):
        self._where = where
        self._interval = interval
        self._counts: collections.Counter = collections.Counter()
        self._last_line = float("-inf")
        self.totals: collections.Counter = collections.Counter()

    @property
    def interval(self) -> float:
        """Seconds between two summary lines."""
        return self._interval

    def add(self, kind: str) -> None:
        """Count one occurrence of `kind` (and log the summary if one is due)."""
        self._counts[kind] += 1
        self.totals[kind] += 1
        self.flush()

    def flush(self, force: bool = False) -> None:
        """Log the counts since the last line, if an interval has passed or `force`."""
        now = time.monotonic()
        if not self._counts or (not force and now - self._last_line < self._interval):
            return
        parts = ", ".join(f"{n} {kind}" for kind, n in sorted(self._counts.items()))
        logger.warning("Metrics server at %s: %s (summary; at most one line per %gs)",
                       self._where, parts, self._interval)
        self._counts.clear()
        self._last_line = now


class HardenedHTTPServer:
    """Serve a WSGI `app` (GET and HEAD only) on `host:port`; port 0 picks a free one.

    Raises:
        OSError: the address cannot be bound (in use, not local).
    """

    def __init__(self, host: str, port: int, app: Callable, *,
                 read_timeout: float = DEFAULT_READ_TIMEOUT_S,
                 write_timeout: float = DEFAULT_WRITE_TIMEOUT_S,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 log_interval: float = DEFAULT_LOG_INTERVAL_S,
                 ssl_context: Optional[ssl.SSLContext] = None):
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}.")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # Bound here, in the caller's thread, so that a taken port raises at once.
        self._sock = socket.create_server((host, port), family=family, backlog=128)
        self.port = int(self._sock.getsockname()[1])
        self._app = app
        self._ssl = ssl_context  # HTTPS when set; the handshake shares the read timeout
        self._read_timeout = read_timeout
        self._write_timeout = write_timeout
        self._max = max_connections
        # writer -> True once its request head arrived (it is then being served, not idle);
        # insertion order is age, so the first idle entry is the oldest idle connection.
        self._open: "collections.OrderedDict[asyncio.StreamWriter, bool]" = (
            collections.OrderedDict())
        self.tally = Tally(f"{host}:{self.port}", log_interval)
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(self._on_loop_error)
        self._server: Optional[asyncio.AbstractServer] = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True,
                                        name="shoal-metrics-http")
        self._thread.start()
        ready.wait(10.0)

    # ------------------------------------------------------------------ lifecycle

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            tls = {} if self._ssl is None else {
                "ssl": self._ssl, "ssl_handshake_timeout": self._read_timeout}
            self._server = await asyncio.start_server(self._handle, sock=self._sock,
                                                      limit=_MAX_HEAD_BYTES, **tls)
            self._loop.create_task(self._flush_tally())

        self._loop.run_until_complete(start())
        ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        """Stop accepting, close every connection, and release the port."""
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._open):
                writer.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(close(), self._loop).result(5.0)
            except Exception as exc:  # noqa: BLE001  (stopping must not raise)
                logger.debug("Closing the metrics server failed: %r", exc)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        self.tally.flush(force=True)
        self._sock.close()
        if not self._thread.is_alive():
            self._loop.close()

    # ------------------------------------------------------------------ trouble

    def _on_loop_error(self, loop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _OUT_OF_DESCRIPTORS:
            # asyncio pauses accepting for a second and tries again; say so once per interval.
            self.tally.add(f"accept pauses ({errno.errorcode.get(exc.errno, exc.errno)}: out "
                           "of file descriptors)")
            return
        loop.default_exception_handler(context)

    async def _flush_tally(self) -> None:
        while True:
            await asyncio.sleep(self.tally.interval)
            self.tally.flush()

    def _admit(self, writer: asyncio.StreamWriter) -> None:
        self._open[writer] = False
        while len(self._open) > self._max:
            oldest_idle = next((w for w, busy in self._open.items() if not busy), None)
            if oldest_idle is None:
                break  # all busy being served; they end within their write timeout
            del self._open[oldest_idle]
            oldest_idle.close()
            self.tally.add(f"idle connections closed over the cap of {self._max}")

    # ------------------------------------------------------------------ one connection

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._admit(writer)
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._read_timeout)
            except asyncio.TimeoutError:
                self.tally.add(f"connections closed after {self._read_timeout:g}s without a "
                               "request")
                return
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return  # closed early, or a head too long to be a scrape
            if writer not in self._open:
                return  # evicted while it was sending
            self._open[writer] = True
            response = await self._respond(head)
            writer.write(response)
            try:
                await asyncio.wait_for(writer.drain(), self._write_timeout)
            except asyncio.TimeoutError:
                self.tally.add(f"responses not taken within {self._write_timeout:g}s")
        except ConnectionError:
            pass
        except asyncio.CancelledError:
            # stop() cancels the connections it finds open. The stream protocol asks this task
            # for its exception once it ends, and a cancelled task answers by raising there,
            # which asyncio logs as a traceback at every shutdown: end the task normally.
            pass
        finally:
            self._open.pop(writer, None)
            writer.close()

    async def _respond(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _plain(400, b"Bad request line.\n")
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            return _plain(405, b"Only GET and HEAD are served.\n")
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        url = urllib.parse.urlsplit(target)
        environ = {
            "REQUEST_METHOD": method, "PATH_INFO": urllib.parse.unquote(url.path or "/"),
            "QUERY_STRING": url.query, "SERVER_PROTOCOL": "HTTP/1.1",
            "HTTP_ACCEPT": headers.get("accept", ""),
            "HTTP_ACCEPT_ENCODING": headers.get("accept-encoding", ""),
            "HTTP_AUTHORIZATION": headers.get("authorization", ""),
            "wsgi.url_scheme": "http" if self._ssl is None else "https",
        }
        loop = asyncio.get_running_loop()
        status, response_headers, body = await loop.run_in_executor(None, self._call_app, environ)
        if method == "HEAD":
            body = b""
        out = [f"HTTP/1.1 {status}\r\n".encode("latin-1")]
        for name, value in response_headers:
            if name.lower() not in ("content-length", "connection"):
                out.append(f"{name}: {value}\r\n".encode("latin-1"))
        out.append(f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
        return b"".join(out) + body

    def _call_app(self, environ: dict) -> tuple[str, list, bytes]:
        captured: dict = {}

        def start_response(status, headers, exc_info=None):
            captured["status"], captured["headers"] = status, headers

        body = b"".join(self._app(environ, start_response))
        return captured["status"], captured["headers"], body


def _plain(code: int, text: bytes) -> bytes:
    reason = {400: "Bad Request", 405: "Method Not Allowed"}[code]
    return (f"HTTP/1.1 {code} {reason}\r\nContent-Type: text/plain\r\nContent-Length: "
            f"{len(text)}\r\nConnection: close\r\n\r\n").encode() + text
