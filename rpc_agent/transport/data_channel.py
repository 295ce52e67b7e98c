"""The data channel: one raw, authenticated socket per pair of workers for large buffers.

grpcio's Python API copies a message into `bytes` several times on each side; a plain socket
sends straight from the array's memory and receives straight into a preallocated array, so a
16 MiB buffer costs one kernel copy per side. The control frame that refers to a buffer travels
on the gRPC stream; a buffer is matched to it by (sender, transfer id) (transport/assembly.py),
so neither has to arrive first, and small calls never queue behind a bulk transfer. Received
buffers land in reused memory (transport/receive_buffers.py).

Wire, after core.auth's handshake (purpose "rpc-data"), in frames that each carry the
connection's 16-byte tag (core.channel; or are sealed, 16 bytes longer, with SHOAL_ENCRYPT):
    dialer -> acceptor   the dialer's worker id (4 bytes, network order), once
    either way           repeated: transfer id (8) + nbytes (8), then the nbytes of data in
                         frames of up to 1 MiB
Every frame is checked before it is acted on: a header before its buffer is allocated, each
slice of data (received in place, into the array the call gets) before the array is handed on.
A frame that fails drops the connection, naming the peer: a relay that forwarded an honest
handshake can neither inject nor alter nor replay a byte. Tagging costs no copy; encryption
costs one each way.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import struct
import threading
from typing import Callable, Optional

import numpy as np

from shoal.core import auth
from shoal.core.admission import Gatekeeper
from shoal.core.channel import TAG_BYTES, IntegrityError, Link
from shoal.core.errors import AuthenticationError
from shoal.rpc_agent import metrics
from shoal.rpc_agent._threads import mark_io_thread
from shoal.rpc_agent.types import CONNECT_TIMEOUT_S, MAX_TRANSFER_BYTES, RpcPeerLost
from shoal.rpc_agent.transport.receive_buffers import ReceiveBuffers

logger = logging.getLogger(__name__)

PURPOSE = "rpc-data"
# Bulk sends go out in slices with a yield of the CPU between them: on a busy machine the
# threads of a small call then get a core within a slice's time instead of after the whole
# transfer (a 64-byte call behind a 16 MiB echo ~0.8 ms instead of ~2 ms). 1 MiB, not less:
# a raw loopback echo measured here ran at 4.8 GB/s in 1 MiB slices, 4.0 GB/s in one sendall
# and 2.9 GB/s in 256 KiB slices.
_SLICE_BYTES = 1024 * 1024
_HEADER = struct.Struct("!QQ")
_ID = struct.Struct("!i")
_BACKLOG = 1024


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        # MSG_WAITALL: one system call (and one GIL round trip) for the whole buffer.
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionError(f"the peer closed the data channel after {got} of {n} bytes")
        got += k


def _advance(views: list, n: int) -> None:
    """Drop the first `n` bytes of `views` (what one sendmsg or recvmsg_into moved)."""
    while n:
        if n >= len(views[0]):
            n -= len(views.pop(0))
        else:
            views[0] = views[0][n:]
            n = 0
    while views and not len(views[0]):
        views.pop(0)


def _recv_parts_into(sock: socket.socket, parts: list) -> None:
    """Fill every view of `parts` in order, in as few system calls as the kernel allows."""
    views = [v for v in parts if len(v)]
    while views:
        k = sock.recvmsg_into(views, 0, socket.MSG_WAITALL)[0]
        if k == 0:
            raise ConnectionError("the peer closed the data channel in the middle of a frame")
        _advance(views, k)


def _send_parts(sock: socket.socket, parts: list) -> None:
    views = [v for v in parts if len(v)]
    while views:
        _advance(views, sock.sendmsg(views))


def _bytes_view(buf) -> memoryview:
    view = memoryview(buf)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class _Frames:
    """One connection's framing: each frame goes out with its tag (or sealed) and is checked
    (or opened) on arrival, in order. Senders hold the connection's send lock; one reader."""

    def __init__(self, link: Link):
        self._sealer = link.sealer
        self._opener = link.opener
        self.encrypt = link.encrypt
        # Encrypt mode only: where a sealed slice lands before it is opened into the array.
        self._sealed = bytearray(_SLICE_BYTES + TAG_BYTES) if link.encrypt else None
        self._tag = bytearray(TAG_BYTES)

    def name_peer(self, label: str) -> None:
        """How integrity errors name the peer from now on."""
        self._opener.peer = label

    def pack(self, data) -> list:
        """The wire parts of one frame of `data` (at most _SLICE_BYTES)."""
        if self.encrypt:
            return [self._sealer.seal(data)]
        return [data, self._sealer.tag((data,))]

    def send(self, sock: socket.socket, buf) -> None:
        """Send `buf` as frames of up to _SLICE_BYTES, yielding the CPU between slices."""
        view = _bytes_view(buf)
        for start in range(0, view.nbytes, _SLICE_BYTES):
            _send_parts(sock, self.pack(view[start:start + _SLICE_BYTES]))
            if view.nbytes > _SLICE_BYTES:
                os.sched_yield()

    def receive_into(self, sock: socket.socket, view: memoryview) -> None:
        """Receive the frames of `view`'s bytes into it, each checked before the next is read.

        Raises:
            IntegrityError: a frame is not the next one the peer sent with this connection's
                keys (the caller drops the connection).
        """
        for start in range(0, len(view), _SLICE_BYTES):
            self._receive_one(sock, view[start:start + _SLICE_BYTES])

    def _receive_one(self, sock: socket.socket, view: memoryview) -> None:
        if self.encrypt:
            sealed = memoryview(self._sealed)[:len(view) + TAG_BYTES]
            _recv_exact_into(sock, sealed)
            view[:] = self._opener.open(sealed)
        else:
            _recv_parts_into(sock, [view, memoryview(self._tag)])
            self._opener.check((view,), self._tag)


class _Conn:
    """One data socket, its sender thread (jobs go out whole and in order) and a reader."""

    def __init__(self, sock: socket.socket, peer_id: int, frames: _Frames):
        self.sock = sock
        self.peer_id = peer_id
        self.frames = frames
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        # Held while sending; a sender that finds it free and no job queued sends itself.
        self.send_lock = threading.Lock()
        self.queued = 0
        self.alive = True


class DataChannels:
    """The agent's data port and its per-peer sockets.

    Args:
        name, worker_id: this worker.
        token: the job's secret.
        host: the address to bind.
        on_transfer(peer_id, transfer_id, array): a buffer arrived (called on a reader thread).
        on_dead(peer_id, reason): the data socket to a peer failed.
        peer_label(id): how messages name worker `id`; None when the id is not in the job.
        receive_cache_bytes: memory kept for reuse by large received buffers.
    """

    def __init__(self, *, name: str, worker_id: int, token: bytes, host: str,
                 on_transfer: Callable[[int, int, np.ndarray], None],
                 on_dead: Callable[[int, str], None],
                 peer_label: Callable[[int], Optional[str]], receive_cache_bytes: int = 0):
        self.name = name
        self.worker_id = worker_id
        self._token = token
        self._on_transfer = on_transfer
        self._on_dead = on_dead
        self._peer_label = peer_label
        self._receive = ReceiveBuffers(receive_cache_bytes)
        self._lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}
        self._dial_locks: dict[int, threading.Lock] = {}
        self._all: set[_Conn] = set()
        self._closed = False
        self._next_id = 0
        self._listener = socket.create_server((host, 0), backlog=_BACKLOG)
        self.port = self._listener.getsockname()[1]
        self._gate = Gatekeeper(
            what=f"Worker {name!r}'s data channel", token=token, purpose=PURPOSE,
            on_admit=self._admitted, on_reject=lambda reason: metrics.REJECTED_DATA.inc(),
        )
        try:
            self._gate.add_listener(self._listener)
        except BaseException:
            self._listener.close()
            raise

    def start(self) -> int:
        """Start accepting; return the bound port."""
        self._gate.start()
        return self.port

    def close(self) -> None:
        """Close the listener and every socket (reader threads then exit)."""
        with self._lock:
            self._closed = True
            conns = list(self._all)
        self._gate.close()
        self._listener.close()
        for conn in conns:
            conn.alive = False
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.sock.close()
            conn.jobs.put(None)
        self._receive.clear()

    # -- sending

    def new_transfer_id(self) -> int:
        """A transfer id unique among this worker's transfers."""
        with self._lock:
            self._next_id += 1
            return self._next_id

    def send(self, peer_id: int, address: tuple[str, int],
             buffers: list[tuple[int, memoryview]],
             on_error: Callable[[RpcPeerLost], None]) -> None:
        """Queue `(transfer_id, buffer)` pairs for `peer_id`, dialing it first if needed.

        When the channel is idle the calling thread sends at once (no hand-off); while
        another send is under way the buffers queue for the channel's sender thread and the
        caller returns (like TensorPipe, arrays must not change until the call's Future
        completes). A send that fails reports through `on_error`.

        Raises:
            RpcPeerLost: the channel cannot be opened (names the peer).
        """
        conn = self._conn_to(peer_id, address)
        with self._lock:
            inline = conn.queued == 0 and conn.send_lock.acquire(blocking=False)
            if not inline:
                conn.queued += 1
        if not inline:
            conn.jobs.put((buffers, on_error))
            return
        try:
            self._send_job(conn, buffers, on_error)
        finally:
            conn.send_lock.release()

    def _send_loop(self, conn: _Conn) -> None:
        while True:
            job = conn.jobs.get()
            if job is None:
                return
            with conn.send_lock:
                with self._lock:
                    conn.queued -= 1
                self._send_job(conn, *job)

    def _send_job(self, conn: _Conn, buffers, on_error) -> None:
        if not conn.alive:
            on_error(RpcPeerLost(
                f"The data channel to {self._peer_label(conn.peer_id)} closed before "
                "its buffers were sent."
            ))
            return
        frames = conn.frames
        try:
            for transfer_id, buf in buffers:
                header = frames.pack(_HEADER.pack(transfer_id, buf.nbytes))
                if 0 < buf.nbytes <= _SLICE_BYTES:  # header and data in one system call
                    _send_parts(conn.sock, header + frames.pack(_bytes_view(buf)))
                else:
                    _send_parts(conn.sock, header)
                    frames.send(conn.sock, buf)
                metrics.BYTES_SENT.inc(buf.nbytes + _HEADER.size)
        except OSError as exc:
            self._drop(conn, f"sending failed: {exc}")
            on_error(RpcPeerLost(
                f"The data channel to {self._peer_label(conn.peer_id)} broke while "
                f"sending: {exc}"
            ))

    def connect(self, peer_id: int, address: tuple[str, int]) -> None:
        """Open the channel to `peer_id` now (init does this for one side of each pair)."""
        self._conn_to(peer_id, address)

    def _conn_to(self, peer_id: int, address: tuple[str, int]) -> _Conn:
        with self._lock:
            conn = self._conns.get(peer_id)
            if conn is not None and conn.alive:
                return conn
            dial_lock = self._dial_locks.setdefault(peer_id, threading.Lock())
        with dial_lock:
            with self._lock:
                conn = self._conns.get(peer_id)
                if conn is not None and conn.alive:
                    return conn
            try:
                sock, link = auth.dial_link(
                    lambda left: socket.create_connection(address, timeout=left), self._token,
                    PURPOSE, CONNECT_TIMEOUT_S, prepare=_tune,
                    peer=self._peer_label(peer_id) or f"worker id {peer_id}")
                frames = _Frames(link)
                _send_parts(sock, frames.pack(_ID.pack(self.worker_id)))
                sock.settimeout(None)
            except (OSError, AuthenticationError) as exc:
                raise RpcPeerLost(
                    f"Worker {self.name!r} could not open its data channel to "
                    f"{self._peer_label(peer_id)} at {address[0]}:{address[1]}: {exc}"
                ) from exc
            conn = _Conn(sock, peer_id, frames)
            self._register(conn, replace=True)
            return conn

    # -- receiving

    def _admitted(self, sock: socket.socket, peer: str, link: Link) -> None:
        """Gatekeeper callback: serve an authenticated connection on a thread of its own."""
        threading.Thread(target=self._serve, args=(sock, peer, link), daemon=True,
                         name=f"shoal-rpc-data-{self.name}").start()

    def _serve(self, sock: socket.socket, peer: str, link: Link) -> None:
        frames = _Frames(link)
        try:
            sock.settimeout(CONNECT_TIMEOUT_S)
            raw = bytearray(_ID.size)
            frames.receive_into(sock, memoryview(raw))
            (peer_id,) = _ID.unpack(raw)
            label = self._peer_label(peer_id)
            if label is None:
                raise AuthenticationError(f"it claims worker id {peer_id}, which this job lacks")
            frames.name_peer(f"{label} at {peer}")
            sock.settimeout(None)
            _tune(sock)
        except (OSError, AuthenticationError) as exc:
            metrics.REJECTED_DATA.inc()
            logger.warning(
                "Worker %r dropped a data-channel connection from %s before reading any "
                "data: %s", self.name, peer, exc,
            )
            sock.close()
            return
        conn = _Conn(sock, peer_id, frames)
        self._register(conn, replace=False)
        self._read_loop(conn)

    def _register(self, conn: _Conn, replace: bool) -> None:
        with self._lock:
            if self._closed:
                conn.sock.close()
                raise RpcPeerLost(f"Worker {self.name!r} is shutting down its data channels.")
            self._all.add(conn)
            current = self._conns.get(conn.peer_id)
            # An accepted socket becomes the pair's channel only if there is none: both ends
            # then send on the same socket, which carries both directions.
            if replace or current is None or not current.alive:
                self._conns[conn.peer_id] = conn
        threading.Thread(
            target=self._send_loop, args=(conn,), daemon=True,
            name=f"shoal-rpc-data-send-{self.name}",
        ).start()
        if replace:
            threading.Thread(
                target=self._read_loop, args=(conn,), daemon=True,
                name=f"shoal-rpc-data-{self.name}",
            ).start()

    def _read_loop(self, conn: _Conn) -> None:
        mark_io_thread()
        header = bytearray(_HEADER.size)
        header_view = memoryview(header)
        frames = conn.frames
        try:
            while True:
                frames.receive_into(conn.sock, header_view)
                transfer_id, nbytes = _HEADER.unpack(header)
                if nbytes > MAX_TRANSFER_BYTES:
                    raise ConnectionError(
                        f"it announced a transfer of {nbytes} bytes, above the "
                        f"{MAX_TRANSFER_BYTES}-byte bound"
                    )
                try:
                    array = self._receive.get(nbytes)
                except MemoryError as exc:
                    raise ConnectionError(
                        f"no memory for its transfer of {nbytes} bytes"
                    ) from exc
                frames.receive_into(conn.sock, memoryview(array).cast("B"))
                metrics.BYTES_RECEIVED.inc(nbytes + _HEADER.size)
                self._on_transfer(conn.peer_id, transfer_id, array)
        except IntegrityError as exc:
            metrics.REJECTED_DATA.inc()
            logger.warning("Worker %r: %s", self.name, exc)
            if conn.alive:
                self._drop(conn, str(exc))
        except (OSError, ValueError) as exc:
            if conn.alive:
                self._drop(conn, str(exc))

    def _drop(self, conn: _Conn, reason: str) -> None:
        with self._lock:
            was_alive, conn.alive = conn.alive, False
            self._all.discard(conn)
            if self._conns.get(conn.peer_id) is conn:
                del self._conns[conn.peer_id]
            closed = self._closed
        try:
            conn.sock.close()
        except OSError:
            pass
        conn.jobs.put(None)
        if was_alive and not closed:
            logger.info("The data channel of %r to %s closed: %s",
                        self.name, self._peer_label(conn.peer_id), reason)
            self._on_dead(conn.peer_id, reason)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
