"""The workers' store port (MASTER_PORT): shoal's authenticated store and torch's protocol on
one listener.

A worker finds its store at MASTER_ADDR:MASTER_PORT whether it is a shoal script (shoal's
TCPStore: the server greets first, then an HMAC challenge and tagged frames) or an unchanged
torch script (torch's C++ TCPStore client: it speaks first, VALIDATE with torch's magic number,
and authenticates nothing). `WorkerStoreDoor` listens on that port (bound to port 0 on the
address it is given) and tells the two apart by who speaks first:

- a client that sends torch's VALIDATE within `SNIFF_S` is served torch's protocol here
  (`agent.torch_store`), with keys of its own: a torch client can read and write only torch's
  keys, never shoal's;
- a client that stays silent is a shoal client waiting for the greeting: the door connects it
  to shoal's `TCPStoreServer` (on the same host, port 0) and pumps bytes both ways. The
  handshake and the frame tags run end to end between the worker and that server, so the door
  neither needs nor learns anything it could forge;
- anything else (a first byte that is not VALIDATE, a wrong magic number) is dropped.

A shoal client pays the sniff window once per connection it opens (one or two per worker). A
torch client that the scheduler stalls for longer than that between its connect and its first
send is greeted as a shoal client, fails torch's ping check and reconnects: torch's client
retries its connection until its timeout (after about 0.6 s), so the cost is one retry, never a
failure. The window is `SNIFF_S` for a job's first round; a round after one whose door relayed
shoal clients and met no torch client (`met_torch`) is the same script restarted, and the agent
opens its door with `RESTART_SNIFF_S`, which a restarted shoal worker pays instead.
"""

from __future__ import annotations

import logging
import resource
import selectors
import socket
import threading
import time
from typing import Optional

from shoal.collectives.store.server import TCPStoreServer
from shoal.core import auth
from shoal.elastic.agent.logs import RepeatLimiter
from shoal.elastic.agent.torch_store import (
    ProtocolError,
    Query,
    TorchConnection,
    TorchStoreState,
)

logger = logging.getLogger(__name__)

__all__ = ["RESTART_SNIFF_S", "SNIFF_S", "WorkerStoreDoor"]

# How long a new connection may stay silent and still be taken for a torch client; torch's
# client sends its 10-byte VALIDATE+PING in the same call that connects.
SNIFF_S = 0.1
# The window after a round of shoal clients only: a torch client still speaks within it unless
# the scheduler stalls it between two calls of its connect routine (and it then retries).
RESTART_SNIFF_S = 0.01
# A relay stops reading from one side while this much waits to go to the other; a torch client
# is not read while this much of its replies waits to go out.
_RELAY_HIGH_WATER = 4 * 1024 * 1024
# Connections from one address not yet proven (sniffing, torch's, or relayed before shoal's
# verdict): enough for every worker of a large node, few enough that a flood from one address
# leaves room for the others. shoal's store limits pending handshakes per source too, but
# behind the door every relayed client comes from the door's own address.
MAX_UNPROVEN_PER_SOURCE = 128
# Server-to-client bytes of shoal's handshake (greeting, then the verdict): once they have
# passed, the client proved the secret or was turned away and closed.
_SHOAL_HANDSHAKE_BYTES = auth.GREETING_BYTES + auth.DIGEST_BYTES
_RECV = 256 * 1024
_SELECT_S = 0.05
_WAKE = object()  # the selector key of the door's wake-up socket


class _Peer:
    """One socket of the door: its output queue, and what it is (pending, torch, relay)."""

    def __init__(self, sock: socket.socket, name: str, deadline: float = 0.0):
        self.sock = sock
        self.name = name
        self.deadline = deadline  # of the sniff, while pending
        self.out = bytearray()
        self.torch: Optional[TorchConnection] = None
        self.partner: Optional["_Peer"] = None  # the other end of a relay
        self.closing = False  # close once `out` is sent
        self.upstream = False  # the door's own connection to shoal's server
        self.mask = selectors.EVENT_READ  # what the selector watches (0: unregistered)
        self.source = name.rsplit(":", 1)[0]
        self.from_server = 0  # bytes relayed from shoal's server to this client, up to a bound

    def send(self, data: bytes) -> None:
        self.out += data


class WorkerStoreDoor:
    """The workers' store for one round: listen on `host:0`, serve torch clients, relay shoal
    clients to a shoal `TCPStoreServer` (authenticated with `token`); a client silent for
    `sniff_s` seconds is taken for a shoal client."""

    def __init__(self, host: str, token: str, sniff_s: float = SNIFF_S):
        self._sniff_s = sniff_s
        # What the door met: torch clients (any), shoal clients (relayed); the agent reads them.
        self.met_torch = False
        self.relayed = 0
        self._server = TCPStoreServer(host, 0, token=token).start()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._lsock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._lsock.bind((host, 0))
            self._lsock.listen(1024)
            self._lsock.setblocking(False)
        except OSError:
            self._lsock.close()
            self._server.stop()
            raise
        self.host = host
        self.port: int = self._lsock.getsockname()[1]
        self._shoal_addr = (self._server.host, self._server.port)
        self._torch = TorchStoreState()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._lsock, selectors.EVENT_READ, None)
        # close() wakes the loop at once instead of after its next select timeout.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._peers: dict[socket.socket, _Peer] = {}
        # Whoever reaches the port can send garbage: one line per few seconds says so.
        self._quiet = RepeatLimiter(logger)
        # Every client costs the door two descriptors when relayed: a share of the limit.
        self._max_clients = max(16, _descriptor_limit() // 4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"shoal-store-door-{self.port}",
                                        daemon=True)
        self._thread.start()
        logger.info("The workers' store listens on %s (MASTER_PORT): torch's clients are served "
                    "its protocol there, shoal's are relayed to the authenticated store at "
                    "%s:%d", self.address, *self._shoal_addr)

    @property
    def address(self) -> str:
        """`host:port` the workers dial (MASTER_ADDR:MASTER_PORT)."""
        return f"{self.host}:{self.port}"

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving; close every connection and the shoal server (idempotent)."""
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # the loop is gone already
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._server.stop()

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                for key, mask in self._sel.select(self._select_timeout()):
                    if key.data is _WAKE:
                        continue  # close() set _stop
                    if key.data is None:
                        self._accept()
                        continue
                    try:
                        self._serve(key.data, mask)
                    except Exception:  # one peer's fault ends that peer only
                        logger.exception("The workers' store at %s failed serving %s",
                                         self.address, key.data.name)
                        self._drop(key.data, None)
                self._sniff_expired(time.monotonic())
        except Exception:  # the door must say why it stopped, then stop
            logger.exception("The workers' store at %s stopped serving", self.address)
        finally:
            for peer in list(self._peers.values()):
                self._drop(peer, None)
            self._sel.close()
            self._lsock.close()
            self._wake_r.close()
            self._wake_w.close()

    def _select_timeout(self) -> float:
        """Until the earliest sniff ends (a silent client is relayed on time), at most
        _SELECT_S."""
        deadlines = [p.deadline for p in self._peers.values()
                     if p.torch is None and p.partner is None and not p.closing]
        if not deadlines:
            return _SELECT_S
        return min(_SELECT_S, max(0.0, min(deadlines) - time.monotonic()))

    def _accept(self) -> None:
        for _ in range(64):  # a burst of connections, without starving the others
            try:
                sock, addr = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: say so, keep serving the others
                logger.warning("The workers' store at %s cannot accept: %s", self.address, exc)
                return
            refusal = self._refusal(addr[0])
            if refusal:
                self._quiet.warning(f"The workers' store at {self.address} turned away "
                                    f"{addr[0]}:{addr[1]}: {refusal}")
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = _Peer(sock, f"{addr[0]}:{addr[1]}", time.monotonic() + self._sniff_s)
            self._peers[sock] = peer
            self._sel.register(sock, selectors.EVENT_READ, peer)

    def _refusal(self, source: str) -> Optional[str]:
        """Why a new client from `source` is turned away now, or None."""
        clients = [p for p in self._peers.values() if not p.upstream]
        if len(clients) >= self._max_clients:
            return f"{len(clients)} clients already, the most it serves at once"
        unproven = sum(1 for p in clients if p.source == source
                       and p.from_server < _SHOAL_HANDSHAKE_BYTES)
        if unproven >= MAX_UNPROVEN_PER_SOURCE:
            return (f"{unproven} connections from that address have proven nothing yet "
                    f"(at most {MAX_UNPROVEN_PER_SOURCE})")
        return None

    def _sniff_expired(self, now: float) -> None:
        for peer in [p for p in self._peers.values()
                     if p.torch is None and p.partner is None and not p.closing]:
            if now >= peer.deadline:
                self._relay_to_shoal(peer)

    def _serve(self, peer: _Peer, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(peer)
        if mask & selectors.EVENT_READ and peer.sock in self._peers:
            self._read(peer)

    def _read(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(_RECV)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(peer, f"read failed: {exc}")
            return
        if not data:
            self._drop(peer, None)
            return
        if peer.closing:
            return  # its partner is gone: nobody to tell
        if peer.partner is not None:
            if peer.upstream:
                peer.partner.from_server = min(_SHOAL_HANDSHAKE_BYTES,
                                               peer.partner.from_server + len(data))
            peer.partner.send(data)
            self._flush(peer.partner)
            return
        if peer.torch is None:
            if data[0] != Query.VALIDATE:
                self._drop(peer, f"it spoke first with byte {data[0]}, which is neither "
                                 "torch's VALIDATE nor a shoal client's silence")
                return
            peer.torch = TorchConnection(self._torch, peer.send)
            self.met_torch = True
        try:
            peer.torch.feed(data)
        except ProtocolError as exc:
            self._drop(peer, f"torch protocol error: {exc}")
            return
        self._flush_all()

    def _relay_to_shoal(self, peer: _Peer) -> None:
        try:
            upstream = socket.create_connection(self._shoal_addr, timeout=5.0)
        except OSError as exc:
            self._drop(peer, f"shoal's store at {self._shoal_addr} refused it: {exc}")
            return
        upstream.setblocking(False)
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        other = _Peer(upstream, f"shoal store for {peer.name}")
        other.upstream = True
        self.relayed += 1
        peer.partner, other.partner = other, peer
        self._peers[upstream] = other
        self._sel.register(upstream, selectors.EVENT_READ, other)

    # ------------------------------------------------------------------ writing and closing

    def _flush_all(self) -> None:
        for peer in list(self._peers.values()):
            if peer.out:
                self._flush(peer)

    def _flush(self, peer: _Peer) -> None:
        if peer.sock not in self._peers:
            return
        while peer.out:
            try:
                sent = peer.sock.send(peer.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._drop(peer, f"write failed: {exc}")
                return
            del peer.out[:sent]
        if not peer.out and peer.closing:
            self._drop(peer, None)
            return
        self._interest(peer)
        if peer.partner is not None:
            self._interest(peer.partner)

    def _interest(self, peer: _Peer) -> None:
        """Read unless the partner's queue is full (back-pressure); write while output waits."""
        if peer.sock not in self._peers:
            return
        mask = 0
        waiting = peer.out if peer.partner is None else peer.partner.out
        if len(waiting) < _RELAY_HIGH_WATER:
            mask |= selectors.EVENT_READ
        if peer.out:
            mask |= selectors.EVENT_WRITE
        if mask == peer.mask:
            return
        if not mask:
            self._sel.unregister(peer.sock)
        elif not peer.mask:
            self._sel.register(peer.sock, mask, peer)
        else:
            self._sel.modify(peer.sock, mask, peer)
        peer.mask = mask

    def _drop(self, peer: _Peer, why: Optional[str]) -> None:
        if why:
            self._quiet.warning(f"The workers' store at {self.address} dropped {peer.name}: "
                                f"{why}")
        if self._peers.pop(peer.sock, None) is None:
            return
        if peer.mask:
            self._sel.unregister(peer.sock)
        peer.sock.close()
        if peer.torch is not None:
            peer.torch.close()
        partner, peer.partner = peer.partner, None
        if partner is not None:
            partner.partner = None
            # What the other side still has to say goes out before it closes.
            partner.closing = True
            self._flush(partner)


def _descriptor_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20
