"""The tcp backend's connections: a full mesh of authenticated sockets, bootstrapped by a store.

Every pair of ranks shares three connections: two one-way data connections that collectives
stream arrays over (one per direction, see `wire`), and a control connection that the group's
`control.ControlChannel` serves (goodbyes, abort notices, point-to-point messages).

Bootstrap: each rank listens on `host:0`, publishes `host:port` under the group's prefix, and
connects to every lower rank; the higher rank always dials, so each pair connects once. Each
new connection runs `core.auth`'s handshake (purpose "collectives"), which gives it keys of its
own; then the dialer's hello naming the group, both ranks and the channel, and the acceptor's
acknowledgement, are the connection's first frames, tagged like every later one (`framing`).
A connection whose hello is not what it should be, or fails its tag, is logged and dropped.

Ranks on the same host (same kernel and network namespace) link over abstract Unix-domain
sockets instead of loopback TCP: the same handshake and framing (tags included: an abstract
socket is reachable by any process of the network namespace), at about half the CPU per byte,
which on a small machine is the difference between a copy-bound and a fast ring.
SHOAL_LOCAL_TRANSPORT=tcp keeps every link on TCP. When every peer is linked over Unix
sockets, `shm` adds shared memory for large all_reduces on top of these links: not a
connection, and not tagged (see `framing`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from typing import Callable, Optional

from shoal.collectives import env
from shoal.collectives.backends.tcp import wire
from shoal.collectives.backends.tcp.control import ControlChannel, drain
from shoal.collectives.backends.tcp.framing import TAG, Inbound, Outbound
from shoal.collectives.backends.tcp.reasons import FailureReason
from shoal.collectives.constants import CONNECT_HANDSHAKE_TIMEOUT_S
from shoal.collectives.store.api import Store
from shoal.collectives.types import CollectiveError, CollectiveTimeout, StoreError, StoreTimeout
from shoal.core import auth
from shoal.core.admission import Gatekeeper
from shoal.core.channel import IntegrityError, Link
from shoal.core.errors import AuthenticationError

logger = logging.getLogger(__name__)

# Listen backlogs are clamped by net.core.somaxconn; a deep one lets a burst of peers (and
# strangers) queue while the gatekeeper works instead of being refused by the kernel.
_BACKLOG = 1024

__all__ = ["Mesh"]


def _group_id(name: str, generation: int) -> bytes:
    """The id a hello names: one incarnation (generation) of one group."""
    return hashlib.blake2b(f"{name}/{generation}".encode(), digest_size=8).digest()


class Mesh:
    """Connections of one rank to every other rank of one group (`tx`/`rx` data sockets by
    peer, `control` for the control channel)."""

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
        self.tx: list[Optional[Outbound]] = [None] * size  # data we send to each peer
        self.rx: list[Optional[Inbound]] = [None] * size  # data we receive from each peer
        # Goodbyes, abort notices and point-to-point messages; its sockets are ours to make.
        self.control = ControlChannel(rank, size, name, on_failure)
        self.ctrl = self.control.socks
        self._lock = threading.Condition()
        self._complete = False
        self._closing = False
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
        self.control.start()
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
                self.control.watch(q)
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
                sock, link = auth.dial_link(connect, self._token, "collectives", left,
                                            peer=f"rank {peer}")
                sock.settimeout(min(left, CONNECT_HANDSHAKE_TIMEOUT_S))
                hello = wire.HELLO.pack(wire.HELLO_MAGIC, self._group_id, self.rank, peer, channel)
                wire.send_all(sock, [hello, link.sealer.tag((hello,))])
                ack = bytearray(len(wire.HELLO_ACK) + TAG)
                if not wire.recv_exact(sock, memoryview(ack)) or ack[:1] != wire.HELLO_ACK:
                    raise CollectiveError(
                        f"Rank {peer} of group '{self.name}' at {host}:{port} refused rank "
                        f"{self.rank}'s connection (is an older incarnation of the group still "
                        "running there?)."
                    )
                link.opener.check((ack[:1],), ack[1:])
                sock.settimeout(None)
                wire.set_nodelay(sock)
            except (OSError, AuthenticationError) as exc:
                if sock is not None:
                    sock.close()
                if isinstance(exc, CollectiveError):
                    raise
                where = f"{host}:{port}" + (" (over its local Unix socket)" if unix_address else "")
                what = ("its acknowledgement failed its integrity check"
                        if isinstance(exc, IntegrityError) else str(exc))
                raise CollectiveError(
                    f"Rank {self.rank} of group '{self.name}' could not connect to rank {peer} at "
                    f"{where}: {what}"
                ) from exc
            except BaseException:
                if sock is not None:
                    sock.close()
                raise
            with self._lock:
                self._attach(channel, True, peer, sock, link)

    def _attach(self, channel: int, dialer: bool, peer: int, sock: socket.socket,
                link: Link) -> None:
        """Put a connection in its slot (under the lock)."""
        if channel == wire.CHANNEL_CONTROL:
            self.ctrl[peer] = sock
            self.control.links[peer] = link
        elif (channel == wire.CHANNEL_UP) == dialer:
            self.tx[peer] = Outbound(sock, link)
        else:
            self.rx[peer] = Inbound(sock, link)

    def _slots_for(self, channel: int, dialer: bool) -> list:
        if channel == wire.CHANNEL_CONTROL:
            return self.ctrl
        sends = (channel == wire.CHANNEL_UP) == dialer
        return self.tx if sends else self.rx

    def _admitted(self, sock: socket.socket, peer: str, link: Link) -> None:
        """Gatekeeper callback: read the authenticated peer's hello on a thread of its own."""
        threading.Thread(target=self._place, args=(sock, peer, link), daemon=True,
                         name=f"shoal-pg-{self.name}-admit").start()

    def _place(self, sock: socket.socket, peer: str, link: Link) -> None:
        """Place one authenticated connection by its hello, or log and drop it."""
        where = "its local Unix socket" if peer == "local" else peer
        try:
            sock.settimeout(CONNECT_HANDSHAKE_TIMEOUT_S)
            raw = bytearray(wire.HELLO.size + TAG)
            if not wire.recv_exact(sock, memoryview(raw)):
                raise ValueError("it closed the connection before its hello")
            try:
                link.opener.check((raw[:wire.HELLO.size],), raw[wire.HELLO.size:])
            except IntegrityError:
                raise ValueError("its hello failed its integrity check (altered or injected "
                                 "after the handshake)") from None
            magic, gid, src, dst, channel = wire.HELLO.unpack_from(raw)
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
                sock.sendall(wire.HELLO_ACK + link.sealer.tag((wire.HELLO_ACK,)))
                sock.settimeout(None)
                wire.set_nodelay(sock)
                # An accepted Unix socket inherits nothing from its listener, and a TCP one
                # from a peer on this host has the listener's autotuned receive buffer.
                if same_host:
                    wire.tune_socket(sock, same_host=True)
                self._attach(channel, False, src, sock, link)
                self.transports[src] = "unix" if sock.family == socket.AF_UNIX else "tcp"
                self.remote[src] = not same_host
                self._lock.notify_all()
        # An authenticated peer of another group or generation, or a broken socket: this is the
        # connection's own thread, so whatever went wrong ends here, logged, the socket closed.
        except Exception as exc:  # noqa: BLE001 - nothing may escape this thread unlogged
            logger.warning(
                "Rank %d of group %r dropped a connection from %s on its backend port: %s",
                self.rank, self.name, where, exc,
            )
            try:
                sock.close()
            except OSError:
                pass

    @property
    def departed(self) -> list[bool]:
        """By rank: whether that peer said goodbye (it destroyed its process group)."""
        return self.control.departed

    # ------------------------------------------------------------------ teardown

    def abort(self, reason: FailureReason) -> None:
        """Tell every peer why, then break the data connections so blocked calls return."""
        self.control.send_last_message(wire.KIND_ABORT, reason.to_bytes())
        for end in self.tx + self.rx:
            if end is not None:
                try:
                    end.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self.control.wake_waiters()

    def close(self) -> None:
        """Say goodbye to every peer and release every socket and thread."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._lock.notify_all()
        self.control.say_goodbye()
        # Closing a socket with unread bytes makes the kernel reset the connection, and a reset
        # discards what the peer has not read yet (its last collective's data, our goodbye).
        # So: end what we send with a FIN (queued data still goes first), read away whatever
        # is waiting, and only then close.
        for end in self.tx:
            if end is not None:
                try:
                    end.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
        for end in self.tx + self.rx:
            if end is not None:
                drain(end.sock)
                end.sock.close()
        self.control.close()
        if self._gate is not None:
            self._gate.close()
        for listener in (self.listener, self.unix_listener):
            if listener is not None:
                listener.close()
