"""`TCPStoreServer`: the network side of a TCPStore, one selector thread for all clients.

A `core.admission.Gatekeeper` accepts connections and runs the auth handshake (bounded pending
handshakes, a short deadline for the proof, rate-limited rejection logs, survives descriptor
exhaustion); only authenticated sockets reach the loop. The loop reads
length-prefixed frames without blocking, checks each length before allocating, and hands whole
requests to `StoreState` (the keys and parked waits), which it alone touches, so nothing needs
a lock. A connection that breaks the protocol is logged with its address and dropped.
"""

from __future__ import annotations

import collections
import logging
import selectors
import signal
import socket
import threading
import time
from typing import Optional

from shoal.collectives.store.state import StoreState
from shoal.collectives.store.wire import LENGTH, FrameError, Status, check_length, decode, encode
from shoal.collectives.types import StoreBindError
from shoal.core.admission import MAX_PENDING, MAX_PENDING_PER_SOURCE, Gatekeeper
from shoal.core.auth import GREETING_TIMEOUT_S, load_token

logger = logging.getLogger(__name__)

# An authenticated client sends one request at a time; a few queued behind a parked wait are
# tolerated, a flood is a broken client.
MAX_QUEUED_FRAMES = 16
RECV_CHUNK = 256 * 1024
# The loop wakes at least this often even when idle, so a missed wakeup cannot stall a stop.
_MAX_SELECT_S = 1.0


class _Conn:
    """One authenticated client connection and its read/write state."""

    __slots__ = ("sock", "peer", "inbuf", "body", "body_got", "frames", "out")

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer
        self.inbuf = bytearray()
        self.body: Optional[bytearray] = None  # a large frame being received in place
        self.body_got = 0
        self.frames: collections.deque = collections.deque()
        self.out: collections.deque = collections.deque()


class TCPStoreServer:
    """Serve a TCPStore on `host:port` (port 0 picks one; read `.port` after construction).

    Call `start()` to serve from a daemon thread, or `serve_forever()` to serve from the calling
    thread; `stop()` ends either. `world_size`, when given, is only used to log when that many
    clients have joined.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        world_size: Optional[int] = None,
        token: Optional[bytes | str] = None,
        handshake_timeout: float = GREETING_TIMEOUT_S,
        max_pending_handshakes: int = MAX_PENDING,
        max_pending_per_source: int = MAX_PENDING_PER_SOURCE,
    ):
        self._token = load_token(token)
        self.world_size = world_size
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._lsock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._lsock.bind((host, port))
            self._lsock.listen(1024)
        except OSError as exc:
            self._lsock.close()
            raise StoreBindError(
                exc.errno, f"TCPStore server cannot listen on {host}:{port}: {exc}") from exc
        self.host = host
        self.port = self._lsock.getsockname()[1]
        self._gate = Gatekeeper(
            what=f"TCPStore server on {self.address}", token=self._token, purpose="store",
            on_admit=self._hand_over, greeting_timeout=handshake_timeout,
            max_pending=max_pending_handshakes,
            max_pending_per_source=min(max_pending_per_source, max_pending_handshakes),
        )
        try:
            self._gate.add_listener(self._lsock)
        except BaseException:
            self._lsock.close()
            raise
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._handed_over: collections.deque = collections.deque()  # (sock, peer) after auth
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None
        # state owned by the loop thread
        self._conns: dict[socket.socket, _Conn] = {}
        self._state = StoreState(self._reply, self._process, name=f"TCPStore server on "
                                 f"{self.address}", world_size=world_size)
        # Published for monitoring and tests; written by the loop thread only.
        self.num_connections = 0

    @property
    def num_parked(self) -> int:
        """Requests parked on the server now (readable from any thread)."""
        return self._state.num_parked

    @property
    def joined(self) -> int:
        """How many TCPStore clients have joined (each store object counts once)."""
        return self._state.joined

    @property
    def address(self) -> str:
        """`host:port` as clients dial it."""
        return f"{self.host}:{self.port}"

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "TCPStoreServer":
        """Serve from a daemon thread; returns self."""
        self._thread = threading.Thread(
            target=self.serve_forever, name=f"shoal-store-{self.port}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and close every connection (idempotent, callable from any thread)."""
        self._stopping.set()
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def serve_forever(self) -> None:
        """Run the loop in this thread until `stop()`."""
        logger.info("TCPStore server listening on %s", self.address)
        self._gate.start()
        previous_wakeup = None
        if threading.current_thread() is threading.main_thread():
            # A signal may land on a handshake thread and leave select() asleep; the wakeup fd
            # makes the C-level handler wake the loop so the Python handler (stop) runs now.
            previous_wakeup = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        try:
            while not self._stopping.is_set():
                for key, events in self._sel.select(self._select_timeout()):
                    sock = key.fileobj
                    if sock is self._wake_r:
                        self._drain_wake()
                    else:
                        conn = self._conns.get(sock)
                        if conn is None:
                            continue
                        if events & selectors.EVENT_WRITE:
                            self._flush(conn)
                        if events & selectors.EVENT_READ and conn.sock in self._conns:
                            self._read(conn)
                self._state.expire(time.monotonic())
        finally:
            if previous_wakeup is not None:
                signal.set_wakeup_fd(previous_wakeup)
            self._shutdown()

    def _shutdown(self) -> None:
        self._gate.close()
        for conn in list(self._conns.values()):
            self._drop(conn, None)
        while self._handed_over:
            self._handed_over.popleft()[0].close()
        self._sel.close()
        self._lsock.close()
        self._wake_r.close()
        self._wake_w.close()
        self._stopped.set()
        logger.info("TCPStore server on %s stopped", self.address)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # full (a wake is already pending) or closed (already stopped)
            pass

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while self._handed_over:
            sock, peer = self._handed_over.popleft()
            sock.setblocking(False)
            conn = _Conn(sock, peer)
            self._conns[sock] = conn
            self._sel.register(sock, selectors.EVENT_READ, None)
            self.num_connections = len(self._conns)

    # ------------------------------------------------------------------ authenticated clients

    def _hand_over(self, sock: socket.socket, peer: str) -> None:
        """Gatekeeper callback: queue an authenticated socket for the loop (on the gate thread)."""
        if self._stopping.is_set():
            sock.close()
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._handed_over.append((sock, peer))
        self._wake()

    # ------------------------------------------------------------------ reading frames

    def _read(self, conn: _Conn) -> None:
        try:
            if conn.body is not None:
                view = memoryview(conn.body)[conn.body_got:]
                n = conn.sock.recv_into(view)
                if n == 0:
                    return self._drop_truncated(conn, len(conn.body) - conn.body_got)
                conn.body_got += n
                if conn.body_got == len(conn.body):
                    conn.frames.append(conn.body)
                    conn.body = None
            else:
                data = conn.sock.recv(RECV_CHUNK)
                if not data:
                    return self._drop_truncated(conn, len(conn.inbuf))
                conn.inbuf += data
                self._split_frames(conn)
        except (BlockingIOError, InterruptedError):
            return
        except FrameError as exc:
            return self._drop(conn, f"sent a malformed frame ({exc})")
        except OSError as exc:
            return self._drop(conn, None if _is_disconnect(exc) else f"failed: {exc}")
        if len(conn.frames) > MAX_QUEUED_FRAMES:
            return self._drop(
                conn, f"sent {len(conn.frames)} requests without waiting for the replies"
            )
        self._process(conn)

    def _split_frames(self, conn: _Conn) -> None:
        buf = conn.inbuf
        pos = 0
        while len(buf) - pos >= LENGTH.size:
            (length,) = LENGTH.unpack_from(buf, pos)
            check_length(length)
            start = pos + LENGTH.size
            if len(buf) - start >= length:
                conn.frames.append(bytes(buf[start:start + length]))
                pos = start + length
                continue
            if length > RECV_CHUNK:
                # receive the rest of a large frame in place instead of growing inbuf
                body = bytearray(length)
                have = len(buf) - start
                body[:have] = buf[start:]
                conn.body, conn.body_got = body, have
                pos = len(buf)
            break
        del buf[:pos]

    def _drop_truncated(self, conn: _Conn, pending: int) -> None:
        if pending:
            self._drop(conn, f"closed the connection in the middle of a frame ({pending} bytes)")
        else:
            self._drop(conn, None)

    def _drop(self, conn: _Conn, why: Optional[str]) -> None:
        """Close one connection; `why` (if any) is logged as a protocol violation."""
        if why is not None:
            logger.warning(
                "TCPStore server on %s dropped the connection from %s: it %s.",
                self.address, conn.peer, why,
            )
        self._state.forget(conn)
        self._conns.pop(conn.sock, None)
        self.num_connections = len(self._conns)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    # ------------------------------------------------------------------ writing replies

    def _reply(self, conn: _Conn, status: Status, args: list[bytes]) -> None:
        frame = encode(status, args)
        if not conn.out:
            try:
                sent = conn.sock.send(frame)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                return self._drop(conn, None if _is_disconnect(exc) else f"failed: {exc}")
            if sent == len(frame):
                return
            conn.out.append(memoryview(frame)[sent:])
            self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, None)
        else:
            conn.out.append(memoryview(frame))

    def _flush(self, conn: _Conn) -> None:
        while conn.out:
            try:
                sent = conn.sock.send(conn.out[0])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                return self._drop(conn, None if _is_disconnect(exc) else f"failed: {exc}")
            if sent == len(conn.out[0]):
                conn.out.popleft()
            else:
                conn.out[0] = conn.out[0][sent:]
        self._sel.modify(conn.sock, selectors.EVENT_READ, None)

    # ------------------------------------------------------------------ requests

    def _process(self, conn: _Conn) -> None:
        """Serve the connection's queued requests until one parks (one at a time per client)."""
        while conn.frames and not self._state.is_parked(conn) and conn.sock in self._conns:
            try:
                code, args = decode(conn.frames.popleft())
                self._state.handle(conn, code, args)
            except FrameError as exc:
                return self._drop(conn, f"sent a malformed request ({exc})")

    def _select_timeout(self) -> float:
        deadline = self._state.next_deadline()
        if deadline is None:
            return _MAX_SELECT_S
        return min(_MAX_SELECT_S, max(0.0, deadline - time.monotonic()))


def _is_disconnect(exc: OSError) -> bool:
    return isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError))
