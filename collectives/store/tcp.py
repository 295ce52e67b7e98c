"""`TCPStore`: a store served over TCP by the master rank (or by `shoal store`), as in c10d.

The master hosts a `TCPStoreServer` in a background thread; every `TCPStore` (the master's
included) is a client. A client keeps a small pool of authenticated connections, one per call in
flight, so threads never wait on each other's blocking `get`. Every request and reply carries a
tag under its connection's keys (see `wire`), checked before it is parsed; a reply that fails
its check, or the server's word that it dropped the connection for a request that failed its
own, ends that connection with a StoreError that says so. Waits are parked on the server and
answered when their keys are set, or with a timeout reply at their deadline; the client's socket
timeout is that deadline plus a grace period, so a stopped server is also noticed.

Serve one standalone with `shoal store --host 127.0.0.1 --port 0` (the launcher's command over
`serve_forever`), or without the launcher with `python -m shoal.collectives.store.tcp`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional

from shoal.collectives.store.server import TCPStoreServer
from shoal.collectives.store.wire import (
    LENGTH,
    FrameError,
    Op,
    Status,
    check_length,
    decode,
    encode,
    encode_number,
    open_payload,
    seal,
)
from shoal.collectives.store.api import Store, missing_keys_message
from shoal.collectives.types import (
    DEFAULT_STORE_TIMEOUT_S,
    StoreError,
    StoreTimeout,
    StoreUnreachable,
)
from shoal.core import auth
from shoal.core.auth import load_token
from shoal.core.channel import IntegrityError, Link
from shoal.core.errors import AuthenticationError
from shoal.core.timeouts import TimeoutLike

logger = logging.getLogger(__name__)

# How long past a wait's own timeout the client listens for the server's timeout reply.
REPLY_GRACE_S = 10.0
# Sockets cannot take an infinite timeout; this is "forever" for practical purposes.
MAX_SOCKET_TIMEOUT_S = 1e7
_CONNECT_BACKOFF_S = (0.01, 0.5)

__all__ = ["TCPStore", "TCPStoreServer", "serve_forever", "main"]


def _nodelay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Connection:
    """One authenticated socket to the server and its keys; used by one call at a time."""

    def __init__(self, sock: socket.socket, link: Link):
        self.sock = sock
        self.link = link

    def call(self, frame: bytes, timeout: float) -> tuple[int, list[bytes]]:
        """Send `frame` (from `encode`) tagged, and return the checked reply.

        Raises:
            IntegrityError: the reply failed its check.
            OSError, FrameError: the connection broke, or the reply is malformed.
        """
        self.sock.settimeout(min(timeout, MAX_SOCKET_TIMEOUT_S))
        _send_all(self.sock, seal(self.link.sealer, frame))
        (length,) = LENGTH.unpack(self._recv_exact(LENGTH.size))
        check_length(length)
        return decode(open_payload(self.link.opener, self._recv_exact(length)))

    def _recv_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionResetError("the server closed the connection")
            got += k
        return buf

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _send_all(sock: socket.socket, parts: list) -> None:
    """Send every buffer of `parts` in order, with as few system calls as the socket allows."""
    if len(parts) == 1:
        sock.sendall(parts[0])
        return
    views = [memoryview(part) for part in parts]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if sent:
            views[0] = views[0][sent:]


# Servers that master stores of this process run, by (host, port, pid: a forked child has no
# server thread), for multi_tenant sharing: [server, token, stores using it, multi-tenant?].
_SERVERS: dict[tuple[str, int, int], list] = {}
_SERVERS_LOCK = threading.Lock()


def _host_server(host: str, port: int, world_size: Optional[int], token: bytes,
                 multi_tenant: bool) -> tuple[TCPStoreServer, tuple[str, int, int]]:
    """The server a master store uses: this process's on (host, port) when either side is
    multi-tenant and the secret matches, else a new one."""
    with _SERVERS_LOCK:
        entry = _SERVERS.get((host, port, os.getpid())) if port else None
        if entry is not None and (multi_tenant or entry[3]) and entry[1] == token:
            entry[2] += 1
            return entry[0], (host, port, os.getpid())
        server = TCPStoreServer(host, port, world_size=world_size, token=token).start()
        key = (host, server.port, os.getpid())
        _SERVERS.setdefault(key, [server, token, 0, multi_tenant])[2] += 1
        return server, key


def _leave_server(key: Optional[tuple[str, int, int]]) -> bool:
    """One master store fewer on the server; True when it was the last (stop the server)."""
    with _SERVERS_LOCK:
        entry = _SERVERS.get(key)
        if entry is None:
            return True
        entry[2] -= 1
        if entry[2] > 0:
            return False
        del _SERVERS[key]
        return True


class TCPStore(Store):
    """A client of a TCP key-value server; with `is_master=True` it also hosts the server.

    Args:
        host: the server's address (the master binds it).
        port: the server's port; 0 lets the master pick one (read `.port` afterwards).
        world_size: with `wait_for_workers`, the master waits until this many stores joined.
        is_master: host the server in a background thread of this process.
        timeout: default for `get`/`wait`, the connect retries and every other call.
        wait_for_workers: make the master's constructor wait for `world_size` stores.
        token: the job's secret (default: `core.auth.load_token()`).
        multi_tenant: a master shares the server another master store of this process already
            runs on the same host and port instead of failing to bind (torch's meaning; shoal
            also shares when only the earlier store asked for it). The server stops when the
            last of them closes.
        host_name: torch's name for `host`.
        use_libuv: accepted for torch's scripts; shoal's server has one implementation.

    Raises:
        StoreError: the server cannot be reached within the timeout.
        StoreTimeout: the master's wait for workers timed out (names how many joined).
        AuthenticationError: the server holds another secret.
    """

    def __init__(
        self,
        host: Optional[str] = None,
        port: int = 0,
        world_size: Optional[int] = None,
        is_master: bool = False,
        timeout: TimeoutLike = DEFAULT_STORE_TIMEOUT_S,
        wait_for_workers: bool = True,
        token: Optional[bytes | str] = None,
        multi_tenant: bool = False,
        master_listen_fd: Optional[int] = None,
        use_libuv: bool = True,
        host_name: Optional[str] = None,
    ):
        super().__init__(timeout)
        if host_name is not None:
            if host is not None and host != host_name:
                raise ValueError(
                    f"TCPStore got host={host!r} and host_name={host_name!r}; pass one.")
            host = host_name
        if not isinstance(host, str) or not host:
            raise ValueError(
                f"TCPStore needs the server's host (host= or host_name=), got {host!r}.")
        if master_listen_fd is not None:
            raise ValueError(
                "TCPStore master_listen_fd is not supported; let the master bind the port.")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"TCPStore port must be an int in 0..65535, got {port!r}.")
        if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
            raise ValueError(f"TCPStore world_size must be a positive int or None, got {world_size!r}.")
        if port == 0 and not is_master:
            raise ValueError("A TCPStore client needs the server's port; only the master may pass 0.")
        self._token = load_token(token)
        auth.require_secret_for(self._token, host, f"TCPStore at {host}:{port}")
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []
        self._closed = False
        self._pid = os.getpid()
        self.world_size = world_size
        self.server: Optional[TCPStoreServer] = None
        self.multi_tenant = bool(multi_tenant)
        self._tenancy: Optional[tuple[str, int, int]] = None
        if is_master:
            self.server, self._tenancy = _host_server(host, port, world_size, self._token,
                                                      self.multi_tenant)
            port = self.server.port
        self.host = host
        self.port = port
        try:
            self._idle.append(self._connect(self.timeout, retry=True))
            self._call(Op.JOIN, [], self.timeout, "join")
            if is_master and world_size is not None and wait_for_workers:
                self._wait_for_workers(world_size, self.timeout)
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> str:
        """`host:port` of the server."""
        return f"{self.host}:{self.port}"

    # ------------------------------------------------------------------ connections

    def _connect(self, timeout: float, retry: bool) -> _Connection:
        """Dial and authenticate; with `retry`, keep trying until `timeout` (server not up yet)."""
        end = time.monotonic() + timeout
        delay = _CONNECT_BACKOFF_S[0]
        while True:
            try:
                return self._dial(end)
            except AuthenticationError:  # an OSError too, but retrying cannot fix a secret
                raise
            except OSError as exc:
                left = end - time.monotonic()
                if not retry:
                    raise StoreUnreachable(
                        f"TCPStore could not reach the server at {self.address}: {exc}"
                    ) from exc
                if left <= 0:
                    raise StoreUnreachable(
                        f"TCPStore could not reach the server at {self.address} within "
                        f"{timeout:g}s: {exc}"
                    ) from exc
                time.sleep(min(delay, left))
                delay = min(delay * 2, _CONNECT_BACKOFF_S[1])

    def _dial(self, end: float) -> _Connection:
        """One attempt. Raises OSError when the server is not there (worth retrying), and
        AuthenticationError when it is there but refuses this secret (not worth it). A server
        that drops the connection before its verdict (shedding load) is retried by `auth.dial`
        until `end`."""
        left = max(0.01, end - time.monotonic())

        def connect(timeout: float) -> socket.socket:
            return socket.create_connection((self.host, self.port),
                                            timeout=min(timeout, MAX_SOCKET_TIMEOUT_S))

        try:
            sock, link = auth.dial_link(connect, self._token, "store", left, prepare=_nodelay,
                                        peer=f"the TCPStore server at {self.address}")
        except AuthenticationError as exc:
            raise AuthenticationError(
                f"TCPStore could not authenticate to the server at {self.address}: {exc}"
            ) from exc
        return _Connection(sock, link)

    def _checkout(self) -> _Connection:
        with self._lock:
            if self._closed:
                raise StoreError(f"This TCPStore (server {self.address}) is closed.")
            if self._pid != os.getpid():
                # A forked child must not talk on its parent's sockets; it dials its own.
                self._idle, self._pid = [], os.getpid()
            if self._idle:
                return self._idle.pop()
        # Another thread holds the other connections: open one more. The server was up a moment
        # ago, so a refusal means it is gone and is reported at once instead of retried.
        return self._connect(min(self.timeout, REPLY_GRACE_S), retry=False)

    def _checkin(self, conn: _Connection) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def _request(self, op: Op, args: list[bytes], timeout: float, what: str):
        """Send one request; return (status, reply args) for OK and TIMEOUT, raise otherwise."""
        try:
            frame = encode(op, args)
        except FrameError as exc:
            raise ValueError(f"TCPStore {what}: {exc}") from exc
        conn = self._checkout()
        try:
            status, reply = conn.call(frame, timeout)
        except socket.timeout as exc:
            conn.close()
            raise StoreError(
                f"TCPStore {what}: the server at {self.address} did not answer within {timeout:g}s."
            ) from exc
        except IntegrityError as exc:
            conn.close()
            raise StoreError(f"TCPStore {what}: {exc}") from exc
        except (OSError, FrameError) as exc:
            conn.close()
            raise StoreError(f"TCPStore {what}: lost the server at {self.address}: {exc}") from exc
        except BaseException:
            conn.close()  # e.g. KeyboardInterrupt mid-reply: the stream position is unknown
            raise
        if status == Status.DROPPED:
            conn.close()
        else:
            self._checkin(conn)
        if status == Status.OK or status == Status.TIMEOUT:
            return status, reply
        message = reply[0].decode(errors="replace") if reply else "no detail"
        if status == Status.DROPPED:
            raise StoreError(f"TCPStore {what}: the server at {self.address} dropped this "
                             f"connection: {message}")
        if status == Status.BAD_INPUT:
            raise ValueError(message)
        raise StoreError(f"TCPStore {what} failed on the server at {self.address}: {message}")

    def _call(self, op: Op, args: list[bytes], timeout: float, what: str) -> list[bytes]:
        status, reply = self._request(op, args, timeout, what)
        if status != Status.OK:
            raise StoreError(f"TCPStore {what}: unexpected reply {status} from {self.address}.")
        return reply

    def _waiting_call(self, op: Op, keys: list[str], timeout: float, what: str) -> list[bytes]:
        args = [encode_number(float(timeout))] + [k.encode() for k in keys]
        status, reply = self._request(op, args, timeout + REPLY_GRACE_S, what)
        if status == Status.TIMEOUT:
            missing = [k.decode(errors="replace") for k in reply]
            raise StoreTimeout(missing_keys_message(f"TCPStore at {self.address}", missing, timeout))
        return reply

    def _wait_for_workers(self, world_size: int, timeout: float) -> None:
        args = [encode_number(world_size), encode_number(float(timeout))]
        status, reply = self._request(
            Op.WAIT_WORKERS, args, timeout + REPLY_GRACE_S, "wait for workers"
        )
        if status == Status.TIMEOUT:
            joined = int(reply[0])
            raise StoreTimeout(
                f"TCPStore master at {self.address} waited {timeout:g}s for {world_size} "
                f"workers to join; only {joined} joined."
            )

    def close(self) -> None:
        """Close the connections; the master also stops its server."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        if self.server is not None:
            server, self.server = self.server, None
            if _leave_server(self._tenancy):
                server.stop()

    def clone(self) -> "TCPStore":
        """A new client of the same server with its own connections (torch's clone)."""
        return TCPStore(self.host, self.port, world_size=self.world_size, is_master=False,
                        timeout=self.timeout, token=self._token)

    def __del__(self):
        try:
            if not self._closed:
                self.close()
        # At interpreter shutdown modules may be half torn down and raise anything.
        except Exception:  # noqa: BLE001 - __del__ must not raise
            pass

    # ------------------------------------------------------------------ Store hooks

    def _set(self, key, value):
        self._call(Op.SET, [key.encode(), value], self.timeout, f"set of key {key!r}")

    def _get(self, key, timeout):
        return self._waiting_call(Op.GET, [key], timeout, f"get of key {key!r}")[0]

    def _add(self, key, amount):
        reply = self._call(Op.ADD, [key.encode(), encode_number(amount)], self.timeout,
                           f"add to key {key!r}")
        return int(reply[0])

    def _compare_set(self, key, expected, desired):
        reply = self._call(Op.COMPARE_SET, [key.encode(), expected, desired], self.timeout,
                           f"compare_set of key {key!r}")
        return reply[0]

    def _wait(self, keys, timeout):
        if not keys:
            return
        self._waiting_call(Op.WAIT, keys, timeout, f"wait for {len(keys)} key(s)")

    def _check(self, keys):
        return self._call(Op.CHECK, [k.encode() for k in keys], self.timeout, "check")[0] == b"1"

    def _delete(self, key):
        return self._call(Op.DELETE, [key.encode()], self.timeout, f"delete of key {key!r}")[0] == b"1"

    def _num_keys(self):
        return int(self._call(Op.NUM_KEYS, [], self.timeout, "num_keys")[0])

    def _multi_get(self, keys, timeout):
        if not keys:
            return []
        return self._waiting_call(Op.MULTI_GET, keys, timeout, f"multi_get of {len(keys)} key(s)")

    def _multi_set(self, keys, values):
        if not keys:
            return
        args = []
        for k, v in zip(keys, values):
            args += [k.encode(), v]
        self._call(Op.MULTI_SET, args, self.timeout, f"multi_set of {len(keys)} key(s)")


# ---------------------------------------------------------------------- standalone server

def serve_forever(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    world_size: Optional[int] = None,
    token: Optional[bytes | str] = None,
    on_ready: Optional[Callable[[TCPStoreServer], None]] = None,
    handle_signals: bool = True,
) -> None:
    """Serve a store in this thread until SIGTERM/SIGINT (or `server.stop()` from `on_ready`).

    `on_ready(server)` runs once the port is bound (read `server.port`). Signal handlers are
    installed only when `handle_signals` and this is the main thread, and restored afterwards.
    """
    server = TCPStoreServer(host, port, world_size=world_size, token=token)
    previous = {}
    if handle_signals and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, lambda *_: server.stop(timeout=0))
    try:
        if on_ready is not None:
            on_ready(server)
        server.serve_forever()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m shoal.collectives.store.tcp`: serve a store; the first stdout line names the
    port. `shoal store` is the command for users; this entry point serves tests and scripts
    that need no launcher."""
    parser = argparse.ArgumentParser(
        prog="python -m shoal.collectives.store.tcp",
        description="Serve a shoal TCPStore until SIGTERM/SIGINT. The secret comes from "
        "SHOAL_AUTH_TOKEN or SHOAL_AUTH_TOKEN_FILE.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--world-size", "--world_size", dest="world_size", type=int,
                        default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def announce(server: TCPStoreServer) -> None:
        sys.stdout.write(f"shoal store listening on {server.host}:{server.port}\n")
        sys.stdout.flush()

    try:
        serve_forever(args.host, args.port, world_size=args.world_size, on_ready=announce)
    except OSError as exc:
        sys.stderr.write(f"shoal store: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
