"""`TCPStoreServer`: the network side of a TCPStore, one selector thread for all clients.

A `core.admission.Gatekeeper` accepts connections and runs the auth handshake (bounded pending
handshakes, a short deadline for the proof, rate-limited rejection logs, survives descriptor
exhaustion); only authenticated sockets reach the loop, each with its connection's keys. The
loop reads length-prefixed frames without blocking (`frames.FrameReader`: bodies allocated as
their bytes arrive, bytes in flight capped per connection and in total), checks every frame's
tag before it parses it, and hands whole requests to `StoreState` (the keys and parked waits),
which it alone touches, so nothing needs a lock. Every reply is tagged (or sealed) in turn. A
connection that breaks the protocol, fails a frame's check or runs the server out of memory is
logged with its address and dropped; the server and the other connections carry on.
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

from shoal.collectives.store.frames import RECV_CHUNK, Budget, FrameReader, OverBudget
from shoal.collectives.store.state import StoreState
from shoal.collectives.store.wire import MAX_PAYLOAD, FrameError, Status, decode, encode, seal
from shoal.collectives.types import StoreBindError
from shoal.core.admission import MAX_PENDING, MAX_PENDING_PER_SOURCE, Gatekeeper
from shoal.core.auth import GREETING_TIMEOUT_S, load_token
from shoal.core.channel import IntegrityError, Link

logger = logging.getLogger(__name__)

# An authenticated client sends one request at a time; a few queued behind a parked wait are
# tolerated, a flood is a broken client.
MAX_QUEUED_FRAMES = 16
# Bytes of unserved frames one connection may hold (one maximal frame and a few small ones
# queued behind a parked wait), and all connections together: a peer must send the bytes it
# holds, and past either cap its connection is dropped.
MAX_HELD_PER_CONNECTION = MAX_PAYLOAD + 4 * RECV_CHUNK
MAX_HELD_BYTES = 1 << 30
# The loop wakes at least this often even when idle, so a missed wakeup cannot stall a stop.
_MAX_SELECT_S = 1.0


class _Conn:
    """One authenticated client connection: its keys, its frames in, its replies out."""

    __slots__ = ("sock", "peer", "link", "reader", "out")

    def __init__(self, sock: socket.socket, peer: str, link: Link, reader: FrameReader):
        self.sock = sock
        self.peer = peer
        self.link = link
        self.reader = reader
        self.out: collections.deque = collections.deque()  # memoryviews still to send


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
        max_held_bytes: int = MAX_HELD_BYTES,
        max_held_per_connection: int = MAX_HELD_PER_CONNECTION,
    ):
        self._token = load_token(token)
        self._budget = Budget(max_held_bytes)
        self._max_held_per_connection = max_held_per_connection
        self._scratch = memoryview(bytearray(RECV_CHUNK))
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
        self._handed_over: collections.deque = collections.deque()  # (sock, peer, link)
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
    def held_bytes(self) -> int:
        """Bytes of frames received and not yet served, over all connections (any thread)."""
        return self._budget.held

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
                try:
                    self._turn()
                except MemoryError:  # outside any one connection's work (see _serve)
                    logger.warning("TCPStore server on %s ran out of memory; it keeps serving",
                                   self.address)
        finally:
            if previous_wakeup is not None:
                signal.set_wakeup_fd(previous_wakeup)
            self._shutdown()

    def _turn(self) -> None:
        for key, events in self._sel.select(self._select_timeout()):
            sock = key.fileobj
            if sock is self._wake_r:
                self._drain_wake()
            elif sock in self._conns:
                self._serve(self._conns[sock], events)
        self._state.expire(time.monotonic())

    def _shutdown(self) -> None:
        self._gate.close()
        for conn in list(self._conns.values()):
            self._drop(conn, None)
        while self._handed_over:
            self._handed_over.popleft()[0].close()
        self._scratch.release()
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
            sock, peer, link = self._handed_over.popleft()
            sock.setblocking(False)
            reader = FrameReader(link.opener, self._budget, self._max_held_per_connection)
            conn = _Conn(sock, peer, link, reader)
            self._conns[sock] = conn
            self._sel.register(sock, selectors.EVENT_READ, None)
            self.num_connections = len(self._conns)

    # ------------------------------------------------------------------ authenticated clients

    def _hand_over(self, sock: socket.socket, peer: str, link: Link) -> None:
        """Gatekeeper callback: queue an authenticated socket for the loop (on the gate thread)."""
        if self._stopping.is_set():
            sock.close()
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._handed_over.append((sock, peer, link))
        self._wake()

    # ------------------------------------------------------------------ reading frames

    def _serve(self, conn: _Conn, events: int) -> None:
        try:
            if events & selectors.EVENT_WRITE:
                self._flush(conn)
            if events & selectors.EVENT_READ and conn.sock in self._conns:
                self._read(conn)
        except MemoryError:
            # A failed allocation (a body growing, a value stored, a reply) costs this
            # connection, never the server: what it held is given back.
            if conn.sock in self._conns:
                self._drop(conn, f"ran the server out of memory ({conn.reader.pending} bytes "
                                 f"of a frame in progress)")

    def _read(self, conn: _Conn) -> None:
        try:
            if not conn.reader.receive(conn.sock, self._scratch):
                return self._drop_truncated(conn, conn.reader.pending)
        except (BlockingIOError, InterruptedError):
            return
        except IntegrityError as exc:
            return self._refuse(conn, exc)
        except OverBudget as exc:
            return self._drop(conn, str(exc))
        except FrameError as exc:
            return self._drop(conn, f"sent a malformed frame ({exc})")
        except OSError as exc:
            return self._drop(conn, None if _is_disconnect(exc) else f"failed: {exc}")
        if len(conn.reader) > MAX_QUEUED_FRAMES:
            return self._drop(
                conn, f"sent {len(conn.reader)} requests without waiting for the replies"
            )
        self._process(conn)

    def _refuse(self, conn: _Conn, exc: IntegrityError) -> None:
        """A frame failed its check: serve the frames that passed before it, tell the client
        why (best effort: it may be a relay's victim), and drop the connection."""
        self._process(conn)
        if conn.sock not in self._conns:
            return
        self._reply(conn, Status.DROPPED, [str(exc).encode()])
        if conn.sock in self._conns:
            self._drop(conn, f"sent a frame that failed its integrity check ({exc})")

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
        conn.reader.release()
        conn.out.clear()
        self._conns.pop(conn.sock, None)
        self.num_connections = len(self._conns)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    # ------------------------------------------------------------------ writing replies

    def _reply(self, conn: _Conn, status: Status, args: list[bytes]) -> None:
        """Tag (or seal) the reply, the next frame of this connection, and send what the socket
        takes now; the rest waits for EVENT_WRITE."""
        parts = [memoryview(part) for part in seal(conn.link.sealer, encode(status, args))]
        if conn.out:
            conn.out.extend(parts)
            return
        try:
            sent = conn.sock.send(parts[0]) if len(parts) == 1 else conn.sock.sendmsg(parts)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            return self._drop(conn, None if _is_disconnect(exc) else f"failed: {exc}")
        for part in parts:
            if sent >= len(part):
                sent -= len(part)
                continue
            conn.out.append(part[sent:])
            sent = 0
        if conn.out:
            self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, None)

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
        self._process(conn)  # requests that arrived while the reply was on its way

    # ------------------------------------------------------------------ requests

    def _process(self, conn: _Conn) -> None:
        """Serve the connection's queued requests until one parks (one at a time per client),
        or until a reply waits for the client to read it: a client that does not read its
        replies gets no more served, so what it makes the server hold stays bounded."""
        while (conn.reader and not conn.out and not self._state.is_parked(conn)
               and conn.sock in self._conns):
            try:
                code, args = decode(conn.reader.pop())
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
