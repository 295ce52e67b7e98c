"""`TCPStoreServer`: the key-value server behind `TCPStore`, one selector thread for all clients.

Concurrency: accepted sockets first run `core.auth.server_handshake` in a short-lived thread of
their own (bounded in number, each with the handshake timeout), so a silent or slow stranger
costs one parked thread and never the loop; only authenticated sockets reach the loop. The loop
owns every piece of state (data, waiters, connections) so none of it needs a lock. A `get` or
`wait` whose keys are missing parks on those keys and is answered by the `set` that completes
it, or by the loop at its deadline; nothing polls.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import selectors
import signal
import socket
import threading
import time
from typing import Optional

from collectives._store_wire import (
    LENGTH,
    FrameError,
    Op,
    Status,
    check_length,
    decode,
    decode_int,
    decode_timeout,
    encode,
)
from collectives.api import MAX_KEY_BYTES
from core.auth import HANDSHAKE_TIMEOUT_S, load_token, server_handshake
from core.errors import AuthenticationError

logger = logging.getLogger(__name__)

MAX_PENDING_HANDSHAKES = 64
# An authenticated client sends one request at a time; a few queued behind a parked wait are
# tolerated, a flood is a broken client.
MAX_QUEUED_FRAMES = 16
RECV_CHUNK = 256 * 1024
# The loop wakes at least this often even when idle, so a missed wakeup cannot stall a stop.
_MAX_SELECT_S = 1.0


class _Conn:
    """One authenticated client connection and its read/write state."""

    __slots__ = ("sock", "peer", "inbuf", "body", "body_got", "frames", "parked", "out")

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer
        self.inbuf = bytearray()
        self.body: Optional[bytearray] = None  # a large frame being received in place
        self.body_got = 0
        self.frames: collections.deque = collections.deque()
        self.parked: Optional[_Waiter] = None
        self.out: collections.deque = collections.deque()


class _Waiter:
    """A parked GET, WAIT, MULTI_GET or WAIT_WORKERS request."""

    __slots__ = ("conn", "op", "keys", "workers", "timeout", "deadline", "done")

    def __init__(self, conn, op, keys, workers, timeout):
        self.conn = conn
        self.op = op
        self.keys = keys
        self.workers = workers
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.done = False


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
        handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
        max_pending_handshakes: int = MAX_PENDING_HANDSHAKES,
    ):
        self._token = load_token(token)
        self._handshake_timeout = handshake_timeout
        self._handshake_slots = threading.BoundedSemaphore(max_pending_handshakes)
        self.world_size = world_size
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._lsock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._lsock.bind((host, port))
            self._lsock.listen(1024)
        except OSError as exc:
            self._lsock.close()
            raise OSError(exc.errno, f"TCPStore server cannot listen on {host}:{port}: {exc}") from exc
        self._lsock.setblocking(False)
        self.host = host
        self.port = self._lsock.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._lsock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._handed_over: collections.deque = collections.deque()  # (sock, peer) after auth
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None
        # state owned by the loop thread
        self._data: dict[bytes, bytes] = {}
        self._waiters: dict[bytes, set] = {}
        self._worker_waiters: set = set()
        self._deadlines: list = []
        self._seq = itertools.count()
        self._conns: dict[socket.socket, _Conn] = {}
        # Published for monitoring and tests; written by the loop thread only.
        self.joined = 0
        self.num_connections = 0
        self.num_parked = 0

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
        previous_wakeup = None
        if threading.current_thread() is threading.main_thread():
            # A signal may land on a handshake thread and leave select() asleep; the wakeup fd
            # makes the C-level handler wake the loop so the Python handler (stop) runs now.
            previous_wakeup = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        try:
            while not self._stopping.is_set():
                for key, events in self._sel.select(self._select_timeout()):
                    sock = key.fileobj
                    if sock is self._lsock:
                        self._accept()
                    elif sock is self._wake_r:
                        self._drain_wake()
                    else:
                        conn = self._conns.get(sock)
                        if conn is None:
                            continue
                        if events & selectors.EVENT_WRITE:
                            self._flush(conn)
                        if events & selectors.EVENT_READ and conn.sock in self._conns:
                            self._read(conn)
                self._expire_waiters()
        finally:
            if previous_wakeup is not None:
                signal.set_wakeup_fd(previous_wakeup)
            self._shutdown()

    def _shutdown(self) -> None:
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

    # ------------------------------------------------------------------ accept and authenticate

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: keep serving the connections we have
                logger.warning("TCPStore server on %s could not accept: %s", self.address, exc)
                return
            peer = f"{addr[0]}:{addr[1]}"
            if not self._handshake_slots.acquire(blocking=False):
                logger.warning(
                    "TCPStore server on %s dropped the connection from %s: %d handshakes are "
                    "already pending.", self.address, peer, MAX_PENDING_HANDSHAKES,
                )
                sock.close()
                continue
            threading.Thread(
                target=self._authenticate, args=(sock, peer), name="shoal-store-auth", daemon=True
            ).start()

    def _authenticate(self, sock: socket.socket, peer: str) -> None:
        try:
            sock.setblocking(True)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server_handshake(sock, self._token, "store", timeout=self._handshake_timeout)
        except (AuthenticationError, OSError) as exc:
            logger.warning(
                "TCPStore server on %s dropped the connection from %s: it failed "
                "authentication: %s", self.address, peer, exc,
            )
            sock.close()
            return
        finally:
            self._handshake_slots.release()
        if self._stopping.is_set():
            sock.close()
            return
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
        if conn.parked is not None:
            self._unpark(conn.parked)
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
        while conn.frames and conn.parked is None and conn.sock in self._conns:
            body = conn.frames.popleft()
            try:
                code, args = decode(body)
                self._handle(conn, code, args)
            except FrameError as exc:
                return self._drop(conn, f"sent a malformed request ({exc})")

    def _handle(self, conn: _Conn, code: int, args: list[bytes]) -> None:
        try:
            op = Op(code)
        except ValueError:
            raise FrameError(f"unknown request code {code}") from None
        if op is Op.SET:
            key, value = _args(op, args, 2)
            self._set(_checked_key(key), value)
            self._reply(conn, Status.OK, [])
        elif op is Op.GET or op is Op.MULTI_GET or op is Op.WAIT:
            if len(args) < 2:
                raise FrameError(f"{op.name} needs a timeout and at least one key")
            timeout = decode_timeout(args[0])
            keys = [_checked_key(k) for k in args[1:]]
            if op is Op.GET and len(keys) != 1:
                raise FrameError(f"GET takes exactly one key, got {len(keys)}")
            self._wait_or_park(conn, op, keys, timeout)
        elif op is Op.ADD:
            key, amount = _args(op, args, 2)
            key, amount = _checked_key(key), decode_int(amount)
            current = self._data.get(key, b"0")
            try:
                value = int(current) + amount
            except ValueError:
                return self._reply(conn, Status.BAD_INPUT, [
                    f"Store.add on key {key.decode(errors='replace')!r}, whose value "
                    f"{current[:32]!r} is not an integer.".encode()
                ])
            self._set(key, str(value).encode())
            self._reply(conn, Status.OK, [str(value).encode()])
        elif op is Op.COMPARE_SET:
            key, expected, desired = _args(op, args, 3)
            key = _checked_key(key)
            current = self._data.get(key)
            if (current is None and expected == b"") or (current is not None and current == expected):
                self._set(key, desired)
                result = desired
            else:
                result = expected if current is None else current
            self._reply(conn, Status.OK, [result])
        elif op is Op.CHECK:
            keys = [_checked_key(k) for k in args]
            self._reply(conn, Status.OK, [b"1" if all(k in self._data for k in keys) else b"0"])
        elif op is Op.DELETE:
            (key,) = _args(op, args, 1)
            existed = self._data.pop(_checked_key(key), None) is not None
            self._reply(conn, Status.OK, [b"1" if existed else b"0"])
        elif op is Op.NUM_KEYS:
            _args(op, args, 0)
            self._reply(conn, Status.OK, [str(len(self._data)).encode()])
        elif op is Op.MULTI_SET:
            if len(args) % 2:
                raise FrameError(f"MULTI_SET needs key-value pairs, got {len(args)} arguments")
            pairs = [(_checked_key(args[i]), args[i + 1]) for i in range(0, len(args), 2)]
            for key, value in pairs:
                self._data[key] = value
            self._wake_waiters([k for k, _ in pairs])
            self._reply(conn, Status.OK, [])
        elif op is Op.JOIN:
            _args(op, args, 0)
            self.joined += 1
            if self.world_size is not None and self.joined == self.world_size:
                logger.info("TCPStore server on %s: all %d workers joined", self.address,
                            self.world_size)
            self._reply(conn, Status.OK, [str(self.joined).encode()])
            self._wake_worker_waiters()
        elif op is Op.WAIT_WORKERS:
            count, timeout = _args(op, args, 2)
            count, timeout = decode_int(count), decode_timeout(timeout)
            if self.joined >= count:
                return self._reply(conn, Status.OK, [str(self.joined).encode()])
            self._park(_Waiter(conn, op, [], count, timeout))
        elif op is Op.PING:
            self._reply(conn, Status.OK, args[:1])

    def _set(self, key: bytes, value: bytes) -> None:
        self._data[key] = value
        self._wake_waiters([key])

    def _wait_or_park(self, conn: _Conn, op: Op, keys: list[bytes], timeout: float) -> None:
        if all(k in self._data for k in keys):
            return self._answer(conn, op, keys)
        if timeout <= 0:
            return self._reply(conn, Status.TIMEOUT, [k for k in keys if k not in self._data])
        waiter = _Waiter(conn, op, keys, None, timeout)
        for k in keys:
            if k not in self._data:
                self._waiters.setdefault(k, set()).add(waiter)
        self._park(waiter)

    def _park(self, waiter: _Waiter) -> None:
        waiter.conn.parked = waiter
        self.num_parked += 1
        if waiter.op is Op.WAIT_WORKERS:
            self._worker_waiters.add(waiter)
        heapq.heappush(self._deadlines, (waiter.deadline, next(self._seq), waiter))

    def _unpark(self, waiter: _Waiter) -> None:
        waiter.done = True
        waiter.conn.parked = None
        self.num_parked -= 1
        self._worker_waiters.discard(waiter)
        for k in waiter.keys:
            bucket = self._waiters.get(k)
            if bucket is not None:
                bucket.discard(waiter)
                if not bucket:
                    del self._waiters[k]

    def _answer(self, conn: _Conn, op: Op, keys: list[bytes]) -> None:
        if op is Op.WAIT:
            self._reply(conn, Status.OK, [])
        else:
            self._reply(conn, Status.OK, [self._data[k] for k in keys])

    def _wake_waiters(self, keys: list[bytes]) -> None:
        ready = []
        for k in keys:
            for waiter in self._waiters.get(k, ()):
                if not waiter.done and all(w in self._data for w in waiter.keys):
                    ready.append(waiter)
        for waiter in ready:
            if waiter.done:
                continue
            conn = waiter.conn
            self._unpark(waiter)
            self._answer(conn, waiter.op, waiter.keys)
            self._process(conn)

    def _wake_worker_waiters(self) -> None:
        for waiter in [w for w in self._worker_waiters if self.joined >= w.workers]:
            conn = waiter.conn
            self._unpark(waiter)
            self._reply(conn, Status.OK, [str(self.joined).encode()])
            self._process(conn)

    def _select_timeout(self) -> float:
        while self._deadlines and self._deadlines[0][2].done:
            heapq.heappop(self._deadlines)
        if not self._deadlines:
            return _MAX_SELECT_S
        return min(_MAX_SELECT_S, max(0.0, self._deadlines[0][0] - time.monotonic()))

    def _expire_waiters(self) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, waiter = heapq.heappop(self._deadlines)
            if waiter.done:
                continue
            conn = waiter.conn
            self._unpark(waiter)
            if waiter.op is Op.WAIT_WORKERS:
                self._reply(conn, Status.TIMEOUT, [str(self.joined).encode()])
            else:
                self._reply(conn, Status.TIMEOUT, [k for k in waiter.keys if k not in self._data])
            self._process(conn)


def _args(op: Op, args: list[bytes], n: int) -> list[bytes]:
    if len(args) != n:
        raise FrameError(f"{op.name} takes {n} arguments, got {len(args)}")
    return args


def _checked_key(key: bytes) -> bytes:
    if not key or len(key) > MAX_KEY_BYTES:
        raise FrameError(f"a key must be 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")
    return key


def _is_disconnect(exc: OSError) -> bool:
    return isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError))

