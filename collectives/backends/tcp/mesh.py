"""The tcp backend's connections: a full mesh of authenticated sockets, bootstrapped by a store.

Every pair of ranks shares three connections: two one-way data connections that collectives
stream arrays over (one per direction, see `_pg_wire`), and a control connection watched by
one service thread per group. The control channel
carries goodbyes, abort notices (with the reason, so every rank reports the same culprit) and
point-to-point messages. A control connection that closes without a goodbye means the peer
process died, which is how a SIGKILLed rank is noticed within milliseconds even when no
collective is reading from it.

Bootstrap: each rank listens on `host:0`, publishes `host:port` under the group's prefix, and
connects to every lower rank; the higher rank always dials, so each pair connects once. Each
new connection runs `core.auth`'s handshake (purpose "collectives") before a hello naming the
group, both ranks and the channel is read; anything else is logged and dropped.

Ranks on the same host (same kernel and network namespace) link over abstract Unix-domain
sockets instead of loopback TCP: the same handshake and framing, at about half the CPU per
byte, which on a small machine is the difference between a copy-bound and a fast ring.
SHOAL_LOCAL_TRANSPORT=tcp keeps every link on TCP. When every peer is linked over Unix
sockets, `_pg_shm` adds shared memory for large all_reduces on top of these links.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import json
import logging
import os
import selectors
import socket
import threading
import time
from typing import Callable, Optional

from shoal.collectives.backends.tcp import wire
from shoal.collectives import env
from shoal.collectives.store.api import Store
from shoal.collectives.types import (
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    PeerLost,
    StoreError,
    StoreTimeout,
)
from shoal.collectives.constants import CONNECT_HANDSHAKE_TIMEOUT_S, MAX_CONTROL_FRAME_BYTES
from shoal.core import auth
from shoal.core.admission import Gatekeeper
from shoal.core.errors import AuthenticationError

logger = logging.getLogger(__name__)

# Listen backlogs are clamped by net.core.somaxconn; a deep one lets a burst of peers (and
# strangers) queue while the gatekeeper works instead of being refused by the kernel.
_BACKLOG = 1024

ERROR_CLASSES = {
    "timeout": CollectiveTimeout,
    "peer_lost": PeerLost,
    "mismatch": CollectiveMismatch,
    "error": CollectiveError,
}


class FailureReason:
    """Why a group failed: a kind (picks the error class), a clause naming the culprits, origin."""

    __slots__ = ("kind", "cause", "origin", "culprits", "dump_path")

    def __init__(self, kind: str, cause: str, origin: int, culprits=(), dump_path=None):
        self.kind = kind if kind in ERROR_CLASSES else "error"
        self.cause = cause
        self.origin = origin
        self.culprits = tuple(culprits)
        self.dump_path = dump_path

    @property
    def error_class(self):
        return ERROR_CLASSES[self.kind]

    def to_bytes(self) -> bytes:
        return json.dumps(
            {"kind": self.kind, "cause": self.cause, "origin": self.origin,
             "culprits": list(self.culprits)}
        ).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, sender: int) -> "FailureReason":
        try:
            d = json.loads(raw.decode())
            return cls(str(d["kind"]), str(d["cause"]), int(d["origin"]),
                       [int(c) for c in d.get("culprits", [])])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return cls("error", f"rank {sender} aborted the group with an unreadable reason", sender)


def _group_id(name: str, generation: int) -> bytes:
    return hashlib.blake2b(f"{name}/{generation}".encode(), digest_size=8).digest()


def _drain(sock: socket.socket, limit: int = 1 << 20) -> None:
    """Read and drop what is already waiting on `sock` (never blocks), so closing it sends no reset."""
    left = limit
    try:
        while left > 0:
            chunk = sock.recv(min(left, 65536), socket.MSG_DONTWAIT)
            if not chunk:
                return
            left -= len(chunk)
    except OSError:  # nothing waiting (EAGAIN), or the connection is gone already
        return


class _ControlReader:
    """Incremental frame parser for one non-blocking control connection."""

    __slots__ = ("peer", "sock", "header", "got", "body", "body_got", "kind", "aux")

    def __init__(self, peer: int, sock: socket.socket):
        self.peer = peer
        self.sock = sock
        self.header = bytearray(wire.CONTROL_HEADER.size)
        self.got = 0
        self.body: Optional[bytearray] = None
        self.body_got = 0
        self.kind = 0
        self.aux = 0


class Mesh:
    """Connections of one rank to every other rank of one group, plus the control service."""

    def __init__(
        self,
        *,
        store: Store,
        rank: int,
        size: int,
        name: str,
        host: str,
        token: bytes,
        on_failure: Callable[[FailureReason], None],
    ):
        self.store = store
        self.rank = rank
        self.size = size
        self.name = name
        self.host = host
        self._token = token
        self._on_failure = on_failure
        self.tx: list[Optional[socket.socket]] = [None] * size  # data we send to each peer
        self.rx: list[Optional[socket.socket]] = [None] * size  # data we receive from each peer
        self.ctrl: list[Optional[socket.socket]] = [None] * size
        self.departed = [False] * size
        self._send_locks = [threading.Lock() for _ in range(size)]
        self._lock = threading.Condition()
        self._complete = False
        self._closing = False
        self._mail: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self.listener: Optional[socket.socket] = None
        self.unix_listener: Optional[socket.socket] = None
        self.unix_address: Optional[bytes] = None
        self.transports: list[str] = ["self"] * size
        # Whether each peer is on another host, decided once as its links are made (by the
        # address dialled or the address that dialled us): it sets their receive buffers and
        # which ring all_reduce runs over them.
        self.remote: list[bool] = [False] * size
        self.address: tuple[str, int] = (host, 0)
        self.prefix = ""
        self._group_id = b""
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._pending_register: list[_ControlReader] = []
        self._service: Optional[threading.Thread] = None
        self._gate: Optional[Gatekeeper] = None

    # ------------------------------------------------------------------ bootstrap

    def connect(self, timeout: float) -> None:
        """Listen, publish the address, dial lower ranks and wait for higher ones.

        Raises:
            CollectiveTimeout: a peer never published its address or never connected.
            CollectiveError: a peer's port refused us or failed the handshake.
        """
        deadline = time.monotonic() + timeout
        base = f"shoal/pg/{self.name}"
        try:
            joined = self.store.add(f"{base}/joins", 1)
        except StoreError as exc:
            raise CollectiveError(
                f"Rank {self.rank} could not join group '{self.name}' through the store: {exc}"
            ) from exc
        generation = (joined - 1) // self.size
        self.prefix = f"{base}/{generation}"
        self._group_id = _group_id(self.name, generation)

        self._gate = Gatekeeper(
            what=f"Rank {self.rank} of group '{self.name}'", token=self._token,
            purpose="collectives", on_admit=self._admitted,
        )
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener = listener
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted TCP sockets inherit the listener's buffers; one bound to a routable address
        # may hear from other hosts, so its receive buffer is autotuned, and `_place` fixes it
        # for peers that turn out to be on this host.
        wire.tune_socket(listener, same_host=wire.is_loopback_address(self.host))
        listener.bind((self.host, 0))
        listener.listen(_BACKLOG)
        self._gate.add_listener(listener)
        self.address = (self.host, listener.getsockname()[1])
        identity = wire.host_identity() if env.local_transport() != "tcp" else ""
        if identity and self.size > 1:
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.unix_listener = unix
            # Abstract namespace: no file to clean up; reachable only inside this netns.
            unix.bind(b"\0shoal-pg-" + os.urandom(12).hex().encode())
            unix.listen(_BACKLOG)
            self._gate.add_listener(unix)
            self.unix_address = unix.getsockname()
            self.store.set(f"{self.prefix}/unix/{self.rank}", identity.encode() + b"\n" + self.unix_address)
        # Published by every rank before its address, so once the mesh is complete every
        # rank's entry is there (see `host_identities`).
        self.store.set(f"{self.prefix}/host/{self.rank}", identity if self.unix_listener else "")
        self._gate.start()
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._service = threading.Thread(
            target=self._serve, name=f"shoal-pg-{self.name}-r{self.rank}-control", daemon=True
        )
        self._service.start()
        self.store.set(f"{self.prefix}/addr/{self.rank}", f"{self.address[0]}:{self.address[1]}")

        for peer in range(self.rank):
            self._dial(peer, deadline)
        with self._lock:
            while True:
                missing = [
                    q for q in range(self.rank + 1, self.size)
                    if self.tx[q] is None or self.rx[q] is None or self.ctrl[q] is None
                ]
                if not missing:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeout(
                        f"Rank {self.rank} of group '{self.name}' waited {timeout:g}s for "
                        f"connections from rank(s) {', '.join(map(str, missing))}, which never "
                        "connected; did every rank call init_process_group/new_group?"
                    )
                self._lock.wait(min(left, 0.5))
            self._complete = True
        for q in range(self.size):
            if q != self.rank:
                self._register_control(q)
        logger.debug("Rank %d of group %r connected to %d peers", self.rank, self.name, self.size - 1)

    def host_identities(self, timeout: float) -> list[str]:
        """Every rank's host identity ("" for a rank that uses no local sockets), read once
        the mesh is complete: `topology.from_identities` turns them into hosts."""
        keys = [f"{self.prefix}/host/{q}" for q in range(self.size)]
        try:
            return [v.decode(errors="replace") for v in self.store.multi_get(keys, timeout=timeout)]
        except StoreError as exc:
            raise CollectiveError(
                f"Rank {self.rank} of group '{self.name}' could not read the ranks' hosts from "
                f"the store: {exc}"
            ) from exc

    def _peer_address(self, peer: int, deadline: float) -> tuple[str, int]:
        left = max(0.0, deadline - time.monotonic())
        try:
            raw = self.store.get(f"{self.prefix}/addr/{peer}", timeout=left).decode()
        except StoreTimeout as exc:
            raise CollectiveTimeout(
                f"Rank {self.rank} of group '{self.name}' waited {left:.3g}s for rank {peer} to "
                "publish its address in the store; it never did (did it call "
                "init_process_group/new_group?)."
            ) from exc
        except StoreError as exc:
            raise CollectiveError(
                f"Rank {self.rank} of group '{self.name}' could not read rank {peer}'s address "
                f"from the store: {exc}"
            ) from exc
        host, _, port = raw.rpartition(":")
        return host, int(port)

    def _unix_address_of(self, peer: int) -> Optional[bytes]:
        """The peer's abstract Unix address if it shares our host and we may use it."""
        if self.unix_listener is None:
            return None
        key = f"{self.prefix}/unix/{peer}"
        try:
            if not self.store.check([key]):
                return None
            identity, _, address = self.store.get(key, timeout=5.0).partition(b"\n")
        except StoreError:
            return None
        return address if identity.decode(errors="replace") == wire.host_identity() else None

    def _dial(self, peer: int, deadline: float) -> None:
        host, port = self._peer_address(peer, deadline)
        unix_address = self._unix_address_of(peer)
        self.transports[peer] = "unix" if unix_address else "tcp"
        family = socket.AF_UNIX if unix_address else socket.AF_INET
        same_host = bool(unix_address) or wire.is_same_host_address(host, self.host)
        self.remote[peer] = not same_host

        def connect(timeout: float) -> socket.socket:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                wire.tune_socket(sock, same_host=same_host)
                sock.settimeout(min(timeout, CONNECT_HANDSHAKE_TIMEOUT_S))
                sock.connect(unix_address if unix_address else (host, port))
            except BaseException:
                sock.close()
                raise
            return sock

        for channel in wire.CHANNELS:
            sock = None
            try:
                left = max(0.1, deadline - time.monotonic())
                sock = auth.dial(connect, self._token, "collectives", left)
                sock.settimeout(min(left, CONNECT_HANDSHAKE_TIMEOUT_S))
                sock.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, self._group_id, self.rank, peer, channel))
                ack = sock.recv(1)
                if ack != wire.HELLO_ACK:
                    raise CollectiveError(
                        f"Rank {peer} of group '{self.name}' at {host}:{port} refused rank "
                        f"{self.rank}'s connection (is an older incarnation of the group still "
                        "running there?)."
                    )
                sock.settimeout(None)
                wire.set_nodelay(sock)
            except (OSError, AuthenticationError) as exc:
                if sock is not None:
                    sock.close()
                if isinstance(exc, CollectiveError):
                    raise
                where = f"{host}:{port}" + (" (over its local Unix socket)" if unix_address else "")
                raise CollectiveError(
                    f"Rank {self.rank} of group '{self.name}' could not connect to rank {peer} at "
                    f"{where}: {exc}"
                ) from exc
            except BaseException:
                if sock is not None:
                    sock.close()
                raise
            with self._lock:
                self._slots_for(channel, dialer=True)[peer] = sock

    def _slots_for(self, channel: int, dialer: bool) -> list:
        if channel == wire.CHANNEL_CONTROL:
            return self.ctrl
        sends = (channel == wire.CHANNEL_UP) == dialer
        return self.tx if sends else self.rx

    def _admitted(self, sock: socket.socket, peer: str) -> None:
        """Gatekeeper callback: read the authenticated peer's hello on a thread of its own."""
        threading.Thread(target=self._place, args=(sock, peer), daemon=True,
                         name=f"shoal-pg-{self.name}-admit").start()

    def _place(self, sock: socket.socket, peer: str) -> None:
        """Place one authenticated connection by its hello, or log and drop it."""
        where = "its local Unix socket" if peer == "local" else peer
        try:
            sock.settimeout(CONNECT_HANDSHAKE_TIMEOUT_S)
            raw = bytearray(wire.HELLO.size)
            if not wire.recv_exact(sock, memoryview(raw)):
                raise ValueError("it closed the connection before its hello")
            magic, gid, src, dst, channel = wire.HELLO.unpack(raw)
            if magic != wire.HELLO_MAGIC or gid != self._group_id:
                raise ValueError("its hello names another group or generation")
            if dst != self.rank or not self.rank < src < self.size or channel not in wire.CHANNELS:
                raise ValueError(f"its hello (from rank {src} to rank {dst}, channel {channel}) is invalid here")
            slots = self._slots_for(channel, dialer=False)
            same_host = (sock.family == socket.AF_UNIX
                         or wire.is_same_host_address(sock.getpeername()[0], self.host))
            with self._lock:
                if self._complete or self._closing or slots[src] is not None:
                    raise ValueError(f"rank {src} is already connected on that channel")
                sock.sendall(wire.HELLO_ACK)
                sock.settimeout(None)
                wire.set_nodelay(sock)
                # An accepted Unix socket inherits nothing from its listener, and a TCP one
                # from a peer on this host has the listener's autotuned receive buffer.
                if same_host:
                    wire.tune_socket(sock, same_host=True)
                slots[src] = sock
                self.transports[src] = "unix" if sock.family == socket.AF_UNIX else "tcp"
                self.remote[src] = not same_host
                self._lock.notify_all()
        except Exception as exc:  # an authenticated peer of another group or generation
            logger.warning(
                "Rank %d of group %r dropped a connection from %s on its backend port: %s",
                self.rank, self.name, where, exc,
            )
            try:
                sock.close()
            except OSError:
                pass

    # ------------------------------------------------------------------ control service

    def _register_control(self, peer: int) -> None:
        reader = _ControlReader(peer, self.ctrl[peer])
        with self._lock:
            self._pending_register.append(reader)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _serve(self) -> None:
        sel = self._selector
        while not self._closing:
            with self._lock:
                pending, self._pending_register = self._pending_register, []
            for reader in pending:
                try:
                    sel.register(reader.sock, selectors.EVENT_READ, reader)
                except (ValueError, KeyError, OSError):
                    pass
            try:
                events = sel.select(timeout=1.0)
            except (OSError, ValueError):
                return
            for key, _ in events:
                if self._closing:
                    return
                if key.data == "wake":
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except OSError:
                        pass
                else:
                    self._read_control(key.data)

    def _drop_reader(self, reader: _ControlReader) -> None:
        try:
            self._selector.unregister(reader.sock)
        except (KeyError, ValueError, OSError):
            pass

    def _read_control(self, r: _ControlReader) -> None:
        try:
            while True:
                if r.body is None:
                    view = memoryview(r.header)[r.got:]
                    k = r.sock.recv_into(view, len(view), socket.MSG_DONTWAIT)
                    if k == 0:
                        return self._control_closed(r, None)
                    r.got += k
                    if r.got < len(r.header):
                        continue
                    magic, kind, aux, length = wire.CONTROL_HEADER.unpack(r.header)
                    if magic != wire.CONTROL_MAGIC or kind not in wire.KINDS or length > MAX_CONTROL_FRAME_BYTES:
                        return self._control_garbled(r, f"header {bytes(r.header)!r}")
                    r.kind, r.aux, r.got = kind, aux, 0
                    r.body = bytearray(length)
                    r.body_got = 0
                    if length:
                        continue
                else:
                    view = memoryview(r.body)[r.body_got:]
                    k = r.sock.recv_into(view, len(view), socket.MSG_DONTWAIT)
                    if k == 0:
                        return self._control_closed(r, None)
                    r.body_got += k
                    if r.body_got < len(r.body):
                        continue
                body, r.body = r.body, None
                self._frame(r, r.kind, r.aux, body)
        except BlockingIOError:
            return
        except OSError as exc:
            return self._control_closed(r, exc)

    def _frame(self, r: _ControlReader, kind: int, aux: int, body: bytearray) -> None:
        if kind == wire.KIND_BYE:
            logger.debug("Rank %d of group %r: rank %d said goodbye", self.rank, self.name, r.peer)
            with self._lock:
                self.departed[r.peer] = True
                self._lock.notify_all()
        elif kind == wire.KIND_ABORT:
            reason = FailureReason.from_bytes(bytes(body), r.peer)
            self._on_failure(reason)
        elif kind == wire.KIND_P2P:
            if len(body) < wire.P2P_FP_LEN.size:
                return self._control_garbled(r, "a point-to-point frame shorter than its header")
            (fp_len,) = wire.P2P_FP_LEN.unpack_from(body)
            start = wire.P2P_FP_LEN.size
            fp = bytes(body[start:start + fp_len])
            payload = memoryview(body)[start + fp_len:]
            with self._lock:
                self._mail[(r.peer, aux)].append((fp, payload))
                self._lock.notify_all()

    def _control_closed(self, r: _ControlReader, exc: Optional[BaseException]) -> None:
        self._drop_reader(r)
        with self._lock:
            clean = self.departed[r.peer] or self._closing
            self._lock.notify_all()
        if clean:
            return
        how = f"its connection failed ({exc})" if exc else "its connection closed without a goodbye"
        self._on_failure(FailureReason(
            "peer_lost",
            f"rank {r.peer} was lost: {how}; the process died or was killed",
            origin=self.rank, culprits=(r.peer,),
        ))

    def _control_garbled(self, r: _ControlReader, what: str) -> None:
        self._drop_reader(r)
        logger.error("Rank %d of group %r got a malformed control frame from rank %d: %s",
                     self.rank, self.name, r.peer, what)
        self._on_failure(FailureReason(
            "error", f"rank {r.peer} sent a malformed control frame ({what})",
            origin=self.rank, culprits=(r.peer,),
        ))

    # ------------------------------------------------------------------ point to point

    def send_p2p(self, dst: int, tag: int, fp: bytes, payload: memoryview) -> None:
        """Send one tagged message to `dst` over the control connection (blocks on a full pipe)."""
        body_len = wire.P2P_FP_LEN.size + len(fp) + len(payload)
        head = wire.CONTROL_HEADER.pack(wire.CONTROL_MAGIC, wire.KIND_P2P, tag, body_len)
        sock = self.ctrl[dst]
        if sock is None:
            raise OSError(errno.ENOTCONN, "no control connection")
        with self._send_locks[dst]:
            wire.send_all(sock, [head + wire.P2P_FP_LEN.pack(len(fp)) + fp, payload])

    def take_p2p(self, src: Optional[int], tag: int, stop: Callable[[], bool], wait_s: float = 0.25):
        """Wait for a message with `tag` from `src` (or anyone); returns (src, fp, payload).

        `stop()` is polled between waits so a failed group ends the wait.
        """
        with self._lock:
            while True:
                sources = [src] if src is not None else range(self.size)
                for q in sources:
                    box = self._mail.get((q, tag))
                    if box:
                        fp, payload = box.popleft()
                        return q, fp, payload
                if stop():
                    return None
                self._lock.wait(wait_s)

    def wake_waiters(self) -> None:
        """Wake threads waiting for point-to-point messages (after a failure)."""
        with self._lock:
            self._lock.notify_all()

    # ------------------------------------------------------------------ teardown

    def _send_last_control_frame(self, frame: bytes) -> None:
        """Send `frame` to every peer's control socket (best effort, bounded), then end it."""
        for q, sock in enumerate(self.ctrl):
            if sock is None or q == self.rank:
                continue
            lock = self._send_locks[q]
            if lock.acquire(timeout=0.5):
                try:
                    sock.settimeout(1.0)
                    sock.sendall(frame)
                except OSError:
                    pass
                finally:
                    lock.release()
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def abort(self, reason: FailureReason) -> None:
        """Tell every peer why, then break the data connections so blocked calls return."""
        self._send_last_control_frame(wire.control_frame(wire.KIND_ABORT, 0, reason.to_bytes()))
        for sock in self.tx + self.rx:
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self.wake_waiters()

    def close(self) -> None:
        """Say goodbye to every peer and release every socket and thread."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._lock.notify_all()
        self._send_last_control_frame(wire.control_frame(wire.KIND_BYE, 0))
        # Closing a socket with unread bytes makes the kernel reset the connection, and a reset
        # discards what the peer has not read yet (its last collective's data, our goodbye).
        # So: end what we send with a FIN (queued data still goes first), read away whatever
        # is waiting, and only then close.
        for sock in self.tx:
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
        for sock in self.tx + self.rx:
            if sock is not None:
                _drain(sock)
                sock.close()
        self._wake()
        if self._service is not None and self._service is not threading.current_thread():
            self._service.join(timeout=2.0)
        for q, sock in enumerate(self.ctrl):
            if sock is not None:
                _drain(sock)
                sock.close()
        try:
            self._selector.close()
        except (OSError, RuntimeError):
            pass
        if self._gate is not None:
            self._gate.close()
        for listener in (self.listener, self.unix_listener):
            if listener is not None:
                listener.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
