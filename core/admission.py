"""`Gatekeeper`: accepts connections on shoal's raw-socket ports and admits only proven peers.

Every raw listening socket (the TCPStore server, the collectives mesh over TCP and Unix
sockets, the RPC data channel) hands its listener to a gatekeeper. One thread per gatekeeper
drives every pending handshake (`core.auth.ServerChallenge`) without blocking, so a stranger
costs one descriptor and no thread, and only authenticated, blocking sockets reach the owner's
`on_admit`. What an unauthenticated peer can hold is bounded:

- pending handshakes, in total and per source address: when either bound is reached, the
  oldest pending handshake (of that source, or overall) is shed to make room. A shoal client
  finishes its handshake in well under a millisecond, so under a flood of idle connections the
  ones shed are the idle ones, and a client that is shed anyway retries (`core.auth.dial`);
- a short deadline for the client's proof after the greeting (`GREETING_TIMEOUT_S`);
- descriptors: when accept fails with EMFILE/ENFILE the oldest pending handshake is shed to
  free one; with none pending, the listener rests (backing off to 1 s) and then accepts again,
  instead of spinning or giving up.

Rejections are logged as one summary line per interval with counts by reason and source, so a
flood cannot fill the disk with log lines.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import resource
import selectors
import socket
import threading
import time
from typing import Callable, Optional

from shoal.core.auth import GREETING_TIMEOUT_S, REPLY_BYTES, ServerChallenge, require_secret_for

logger = logging.getLogger(__name__)

MAX_PENDING = 512
MAX_PENDING_PER_SOURCE = 128
LOG_INTERVAL_S = 10.0
_BACKOFF_S = (0.05, 1.0)
_DESCRIPTOR_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_TICK_S = 0.5
# At most this fraction (1/N) of the process's descriptor limit goes to pending handshakes of
# one gatekeeper.
_DESCRIPTOR_SHARE = 8

# Why a connection was turned away; the keys of the summary line and of `on_reject`.
SILENT = "sent no proof in time"
CLOSED = "closed before its proof"
WRONG_SECRET = "wrong secret"
SHED = "shed to make room"
NO_DESCRIPTORS = "no free descriptor"
FAILED = "connection failed"


class RejectionLog:
    """Rate-limited warnings about turned-away connections: at most one line per interval.

    The first rejection after a quiet interval is logged at once (so a single mistake, a wrong
    secret say, shows up immediately); the rest are counted and summarised at the next flush.
    """

    def __init__(self, what: str, interval: float = LOG_INTERVAL_S):
        self._what = what
        self._interval = interval
        self._lock = threading.Lock()
        self._reasons: collections.Counter = collections.Counter()
        self._sources: collections.Counter = collections.Counter()
        self._last_line = -float("inf")
        self._since = time.monotonic()

    def record(self, reason: str, source: str, peer: str = "", detail: str = "") -> None:
        """Count one rejection from `source` (an address; `peer` adds the port for the log)."""
        now = time.monotonic()
        with self._lock:
            if now - self._last_line >= self._interval and not self._reasons:
                self._last_line = now
                self._since = now
                logger.warning("%s turned away a connection from %s: %s%s", self._what,
                               peer or source, reason, f" ({detail})" if detail else "")
                return
            self._reasons[reason] += 1
            self._sources[source] += 1
        self.flush()

    def flush(self, force: bool = False) -> None:
        """Log the counted rejections if an interval has passed since the last line."""
        now = time.monotonic()
        with self._lock:
            if not self._reasons or (not force and now - self._last_line < self._interval):
                return
            total = sum(self._reasons.values())
            reasons = ", ".join(f"{n} {why}" for why, n in self._reasons.most_common())
            sources = ", ".join(f"{src} ({n})" for src, n in self._sources.most_common(3))
            more = len(self._sources) - 3
            window = now - self._since
            self._reasons.clear()
            self._sources.clear()
            self._last_line = self._since = now
        logger.warning(
            "%s turned away %d connection(s) in the last %.0fs: %s; from %s%s.",
            self._what, total, window, reasons, sources,
            f" and {more} more source(s)" if more > 0 else "",
        )


class _Pending:
    """One accepted connection whose peer has not proven the secret yet."""

    __slots__ = ("sock", "source", "peer", "deadline", "challenge", "out", "inbuf")

    def __init__(self, sock: socket.socket, source: str, peer: str, deadline: float,
                 challenge: ServerChallenge):
        self.sock = sock
        self.source = source
        self.peer = peer
        self.deadline = deadline
        self.challenge = challenge
        self.out = memoryview(challenge.greeting)
        self.inbuf = bytearray()


class _Listener:
    __slots__ = ("sock", "resume_at", "backoff")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.resume_at: Optional[float] = None  # set while resting after descriptor exhaustion
        self.backoff = _BACKOFF_S[0]


class Gatekeeper:
    """Accept on the given listeners; hand each peer that proves the secret to `on_admit`.

    Args:
        what: how log lines name the port ("TCPStore server on 127.0.0.1:29500").
        token: the job's secret.
        purpose: the handshake's purpose ("store", "collectives", "rpc-data").
        on_admit(sock, peer, link): called on the gatekeeper thread with a blocking,
            authenticated socket, "host:port" (or "local") and the connection's
            `core.channel.Link`, whose keys every later frame must carry; it must return
            quickly (hand the socket on). If it raises, the socket is closed and the error
            logged.
        on_reject(reason): called for every connection turned away (for metrics).
        greeting_timeout, max_pending, max_pending_per_source: the bounds described above.

    Raises:
        AuthenticationError (from `add_listener`): the development token on a listener bound to
            an address other machines can reach.
    """

    def __init__(
        self,
        *,
        what: str,
        token: bytes,
        purpose: str,
        on_admit: Callable[..., None],
        on_reject: Optional[Callable[[str], None]] = None,
        greeting_timeout: float = GREETING_TIMEOUT_S,
        max_pending: int = MAX_PENDING,
        max_pending_per_source: int = MAX_PENDING_PER_SOURCE,
        log_interval: float = LOG_INTERVAL_S,
    ):
        self.what = what
        self._token = token
        self._purpose = purpose
        self._on_admit = on_admit
        self._on_reject = on_reject
        self._greeting_timeout = greeting_timeout
        # Strangers must never hold most of the process's descriptors (a worker's own open()
        # failing would cost a restart), so the bounds shrink under a low `ulimit -n`.
        fair_share = max(8, _descriptor_limit() // _DESCRIPTOR_SHARE)
        self._max_pending = min(max_pending, fair_share)
        self._max_per_source = min(max_pending_per_source, self._max_pending)
        self._log = RejectionLog(what, log_interval)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._listeners: list[_Listener] = []
        # Insertion order is age order: the first entry is the oldest pending handshake.
        self._pending: "collections.OrderedDict[socket.socket, _Pending]" = collections.OrderedDict()
        self._per_source: collections.Counter = collections.Counter()
        self._closing = False
        self._thread: Optional[threading.Thread] = None
        self._warned_descriptors = False
        # Every connection turned away, by reason, since the start (for tests and monitoring).
        self.rejections: collections.Counter = collections.Counter()

    @property
    def num_pending(self) -> int:
        """Handshakes in progress now (read from any thread; for tests and monitoring)."""
        return len(self._pending)

    def add_listener(self, sock: socket.socket) -> None:
        """Serve `sock` (bound and listening); call before `start()`."""
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            require_secret_for(self._token, sock.getsockname()[0], self.what)
        sock.setblocking(False)
        listener = _Listener(sock)
        self._listeners.append(listener)
        self._sel.register(sock, selectors.EVENT_READ, listener)

    def start(self) -> "Gatekeeper":
        """Start the gatekeeper thread; returns self."""
        self._thread = threading.Thread(target=self._run, name=f"shoal-gate-{self._purpose}",
                                        daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 2.0) -> None:
        """Stop accepting and drop every pending handshake; the listeners stay the owner's."""
        self._closing = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is None:
            self._cleanup()
        elif self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        try:
            while not self._closing:
                try:
                    events = self._sel.select(self._select_timeout())
                except (OSError, ValueError):
                    if self._closing:
                        break
                    raise
                for key, mask in events:
                    if self._closing:
                        break
                    if key.data == "wake":
                        self._drain_wake()
                    elif isinstance(key.data, _Listener):
                        self._accept(key.data)
                    elif key.data.sock in self._pending:
                        # (An event for a handshake already shed earlier in this batch is stale:
                        # its socket is closed and it was counted once.)
                        self._advance(key.data, mask)
                now = time.monotonic()
                self._expire(now)
                self._resume_listeners(now)
                self._log.flush()
        except Exception:  # a bug here must not silently close the port: say so loudly
            logger.exception("%s: the gatekeeper thread failed; the port stops accepting",
                             self.what)
        finally:
            self._cleanup()

    def _cleanup(self) -> None:
        for pending in list(self._pending.values()):
            self._forget(pending)
            pending.sock.close()
        self._log.flush(force=True)
        self._sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _select_timeout(self) -> float:
        now = time.monotonic()
        wake = now + _TICK_S
        if self._pending:
            wake = min(wake, next(iter(self._pending.values())).deadline)
        for listener in self._listeners:
            if listener.resume_at is not None:
                wake = min(wake, listener.resume_at)
        return max(0.0, wake - now)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except OSError:
            pass

    # ------------------------------------------------------------------ accepting

    def _accept(self, listener: _Listener) -> None:
        # Accept a bounded batch per wakeup so one busy listener cannot starve the handshakes.
        for _ in range(64):
            try:
                sock, addr = listener.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _DESCRIPTOR_ERRNOS:
                    if self._pending:
                        self._reject(next(iter(self._pending.values())), NO_DESCRIPTORS)
                        continue
                    self._rest(listener, exc)
                    return
                if exc.errno in (errno.EBADF, errno.EINVAL):  # the owner closed the listener
                    self._unregister_listener(listener)
                    return
                # ECONNABORTED and the like: that one connection failed, the port did not.
                self.rejections[FAILED] += 1
                self._log.record(FAILED, "?", detail=str(exc))
                continue
            listener.backoff = _BACKOFF_S[0]
            self._admit_pending(sock, addr)

    def _admit_pending(self, sock: socket.socket, addr) -> None:
        if isinstance(addr, tuple) and addr:
            source, peer = str(addr[0]), f"{addr[0]}:{addr[1]}"
        else:
            source = peer = "local"
        if self._per_source[source] >= self._max_per_source:
            self._reject(next(p for p in self._pending.values() if p.source == source), SHED)
        elif len(self._pending) >= self._max_pending:
            self._reject(next(iter(self._pending.values())), SHED)
        sock.setblocking(False)
        pending = _Pending(sock, source, peer, time.monotonic() + self._greeting_timeout,
                           ServerChallenge(self._token, self._purpose))
        self._pending[sock] = pending
        self._per_source[source] += 1
        # Greet at once: a fresh socket's send buffer takes the 37 bytes, which saves the
        # client a round of the loop and means every pending handshake has been greeted.
        try:
            pending.out = pending.out[sock.send(pending.out):]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            return self._reject(pending, CLOSED, str(exc))
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if pending.out else 0)
        try:
            self._sel.register(sock, events, pending)
        except (OSError, ValueError) as exc:
            self._reject(pending, FAILED, str(exc))

    def _rest(self, listener: _Listener, exc: OSError) -> None:
        """Out of descriptors and nothing to shed: stop watching the listener for a while."""
        if not self._warned_descriptors:
            self._warned_descriptors = True
            logger.warning(
                "%s cannot accept: %s. It keeps serving the connections it has and accepts "
                "again as descriptors free up (raise `ulimit -n` if this repeats).", self.what, exc,
            )
        self.rejections[NO_DESCRIPTORS] += 1
        self._log.record(NO_DESCRIPTORS, "?")
        self._unregister_listener(listener)
        listener.resume_at = time.monotonic() + listener.backoff
        listener.backoff = min(2 * listener.backoff, _BACKOFF_S[1])

    def _unregister_listener(self, listener: _Listener) -> None:
        try:
            self._sel.unregister(listener.sock)
        except (KeyError, ValueError, OSError):
            pass

    def _resume_listeners(self, now: float) -> None:
        for listener in self._listeners:
            if listener.resume_at is not None and now >= listener.resume_at:
                listener.resume_at = None
                try:
                    self._sel.register(listener.sock, selectors.EVENT_READ, listener)
                except (KeyError, ValueError, OSError):
                    pass

    # ------------------------------------------------------------------ handshakes

    def _advance(self, pending: _Pending, mask: int) -> None:
        try:
            if mask & selectors.EVENT_WRITE and pending.out:
                sent = pending.sock.send(pending.out)
                pending.out = pending.out[sent:]
                if not pending.out:
                    self._sel.modify(pending.sock, selectors.EVENT_READ, pending)
            if mask & selectors.EVENT_READ:
                data = pending.sock.recv(REPLY_BYTES - len(pending.inbuf))
                if not data:
                    return self._reject(pending, CLOSED)
                pending.inbuf += data
                if len(pending.inbuf) == REPLY_BYTES:
                    self._judge(pending)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._reject(pending, CLOSED, str(exc))

    def _judge(self, pending: _Pending) -> None:
        verdict = pending.challenge.verdict(bytes(pending.inbuf))
        self._forget(pending)
        sock = pending.sock
        try:
            # 32 bytes on a socket whose only other traffic was our 37-byte greeting: the send
            # buffer has room, but a short blocking timeout bounds even a pathological peer.
            sock.settimeout(1.0)
            sock.sendall(verdict)
        except OSError as exc:
            sock.close()
            return self._count(CLOSED, pending, str(exc))
        if not pending.challenge.admitted:
            sock.close()
            return self._count(WRONG_SECRET, pending)
        sock.settimeout(None)
        try:
            self._on_admit(sock, pending.peer, pending.challenge.link(pending.peer))
        except Exception:
            logger.exception("%s could not take the connection from %s", self.what, pending.peer)
            sock.close()

    def _expire(self, now: float) -> None:
        while self._pending:
            oldest = next(iter(self._pending.values()))
            if oldest.deadline > now:
                return
            self._reject(oldest, SILENT, f"{self._greeting_timeout:g}s")

    def _reject(self, pending: _Pending, reason: str, detail: str = "") -> None:
        self._forget(pending)
        pending.sock.close()
        self._count(reason, pending, detail)

    def _forget(self, pending: _Pending) -> None:
        if self._pending.pop(pending.sock, None) is None:
            return
        self._per_source[pending.source] -= 1
        if self._per_source[pending.source] <= 0:
            del self._per_source[pending.source]
        try:
            self._sel.unregister(pending.sock)
        except (KeyError, ValueError, OSError):
            pass

    def _count(self, reason: str, pending: _Pending, detail: str = "") -> None:
        self.rejections[reason] += 1
        self._log.record(reason, pending.source, pending.peer, detail)
        if self._on_reject is not None:
            try:
                self._on_reject(reason)
            except Exception:
                logger.exception("%s: the rejection hook failed", self.what)


def _descriptor_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20
