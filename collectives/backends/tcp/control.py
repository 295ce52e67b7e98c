"""The control channel of a tcp group: one connection per peer, served by one thread per group.

It carries goodbyes, abort notices (with the reason, so every rank reports the same culprit) and
point-to-point messages. A control connection that closes without a goodbye means the peer
process died, which is how a SIGKILLed rank is noticed within milliseconds even when no
collective is reading from it. The mesh (`mesh.Mesh`) makes the connections; this module reads
and writes them once the mesh is complete.

A message whose payload is at most JOIN_MAX_BYTES (and not sealed) is one frame: a header,
its fingerprint and payload, and the connection's tag (`framing`); the reader bounds the
header's lengths before it reads the rest and checks the tag before it obeys. A longer or
sealed (SHOAL_ENCRYPT) message is a header frame, checked before it sizes the body, then its
body frame. A frame that fails drops the connection and fails the group naming the peer. A
point-to-point receiver reads its source's connection itself (`take_p2p_reading`); for a
short while after, the service thread watches that connection only for its end (`_QUIET`).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import select
import socket
import threading
import time
from typing import Callable, Optional

from shoal.collectives.backends.tcp import wire
from shoal.collectives.backends.tcp.control_reader import JOIN_MAX_BYTES, ControlReader, recv_some
from shoal.collectives.backends.tcp.reasons import FailureReason
from shoal.collectives.backends.tcp.vm_p2p import Readies
from shoal.collectives.constants import MAX_CONTROL_FRAME_BYTES, MAX_FINGERPRINT_BYTES
from shoal.core.channel import IntegrityError, Link

logger = logging.getLogger(__name__)

__all__ = ["ControlChannel", "JOIN_MAX_BYTES", "drain"]


def drain(sock: socket.socket, limit: int = 1 << 20) -> None:
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


# What the service thread's epoll watches on a connection. ARMED: anything that arrives.
# QUIET: only the peer's end (a goodbye or an abort is always followed by a shutdown, and a
# dead process's connection closes): while a receiver that reads the connection itself
# (`take_p2p_reading`) is using it, a message for that receiver then wakes nobody but it.
# Every wake-up of the service thread costs a trip through the scheduler and a round of GIL
# hand-overs with the receiver, which at 4 ranks on 2 cores was most of a 4 KiB shift's cost.
# QUIET is one-shot, so the receiver can keep it while it waits on the connection (no epoll
# change per receive): the peer's end then wakes the service thread once, and whichever of the
# two holds the reader's lock reads it (a connection left disabled is armed at its grace's end).
_ARMED = select.EPOLLIN | select.EPOLLRDHUP
_QUIET = select.EPOLLRDHUP | select.EPOLLONESHOT
_OUT = 0  # not in the epoll set: a receiver is reading it, or it was dropped
# How long a connection stays quiet after a reading receive last used it. Past this the
# service thread watches it whole again, so a message nobody asks for (before the receive is
# posted, or while the receiving rank is itself blocked sending) still leaves the kernel's
# buffer within this bound; a pipeline that receives more often than this keeps it quiet.
QUIET_GRACE_S = 5e-3


class ControlChannel:
    """This rank's control connections in one group (`socks`, by peer, filled by the mesh), the
    thread that reads them, and the mailboxes of the point-to-point messages they bring.

    Args:
        rank, size, name: this rank, the group's size and name (for messages and threads).
        on_failure: called with the reason when a peer aborts, dies or garbles a frame.
    """

    def __init__(self, rank: int, size: int, name: str,
                 on_failure: Callable[[FailureReason], None]):
        self.rank = rank
        self.size = size
        self.name = name
        self._on_failure = on_failure
        self.socks: list[Optional[socket.socket]] = [None] * size
        self.links: list[Optional[Link]] = [None] * size  # each connection's keys
        self.departed = [False] * size  # peers that said goodbye (destroyed their group)
        self._send_locks = [threading.Lock() for _ in range(size)]
        self._cond = threading.Condition()
        self._closing = False
        self._mail: dict[tuple[int, int], collections.deque] = collections.defaultdict(
            collections.deque)
        # Messages sent and taken, by (peer, tag): the k-th message one rank sends another
        # under a tag is the k-th the other takes under it, which is how a receiver's offer
        # (`readies`, `vm_p2p`) names the message it is for.
        self.sent: collections.Counter = collections.Counter()
        self.taken: collections.Counter = collections.Counter()
        self.readies = Readies(size)  # peers' offers to be written to (under _cond)
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._readers: list[Optional[ControlReader]] = [None] * size
        self._by_fd: dict[int, ControlReader] = {}
        # Guards the readers' modes and the epoll set (`_set_mode`); `_served` counts the
        # threads waiting for the service thread to deliver a message (no connection is quiet
        # meanwhile).
        self._mode_lock = threading.Lock()
        self._served = 0
        self._service_wakes_at = float("inf")  # when its wait times out (time.monotonic)
        self._service: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ service

    def start(self) -> None:
        """Start the service thread (it reads a peer's connection once `watch` names it)."""
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._service = threading.Thread(
            target=self._serve, name=f"shoal-pg-{self.name}-r{self.rank}-control", daemon=True
        )
        self._service.start()

    def watch(self, peer: int) -> None:
        """Read `peer`'s control connection from now on."""
        reader = ControlReader(peer, self.socks[peer], self.links[peer])
        self._readers[peer] = reader
        self._by_fd[reader.fd] = reader
        self._set_mode(reader, _ARMED)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _serve(self) -> None:
        while not self._closing:
            try:
                events = self._epoll.poll(self._rearm_due())
            except (OSError, ValueError):
                return
            for fd, _mask in events:
                if self._closing:
                    return
                reader = self._by_fd.get(fd)
                if reader is None:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except OSError:
                        pass
                elif reader.lock.acquire(blocking=False):
                    # Not acquired: a receiver reads this connection itself right now and
                    # takes it out of the epoll set (`take_p2p_reading`).
                    try:
                        self._read(reader)
                    finally:
                        reader.lock.release()

    def _set_mode(self, r: ControlReader, mode: int, reading: bool = False) -> None:
        """Make the service thread watch `r` as `mode` (_ARMED, _QUIET or _OUT); a quiet
        connection starts its grace period now, and none is quiet while `_served` > 0 (armed
        then, or out of the set while a receiver is `reading` it)."""
        with self._mode_lock:
            if r.dropped:
                return
            if mode == _QUIET:
                if self._served:
                    mode = _OUT if reading else _ARMED
                else:
                    r.quiet_until = time.monotonic() + QUIET_GRACE_S
                    if r.quiet_until < self._service_wakes_at:
                        # Its wait would outlast this grace period: shorten it.
                        self._service_wakes_at = r.quiet_until
                        self._wake()
            self._switch(r, mode)

    def _switch(self, r: ControlReader, mode: int) -> None:
        """Put `r` in the epoll set as `mode` (under `_mode_lock`); left as it was when its
        socket closed meanwhile (its reader sees that itself)."""
        if mode == r.mode:
            return
        try:
            if r.mode == _OUT:
                self._epoll.register(r.fd, mode)
            elif mode == _OUT:
                self._epoll.unregister(r.fd)
            else:
                self._epoll.modify(r.fd, mode)
        except (OSError, ValueError):
            return
        r.mode = mode

    def _arm_quiet(self, until: float) -> float:
        """Arm the quiet connections whose grace period ends by `until`; the seconds until the
        next one's does (at most 1)."""
        wait = 1.0
        with self._mode_lock:
            for r in self._readers:
                if r is None or r.mode != _QUIET:
                    continue
                if r.lock.locked():  # a receiver reads it (and arms it when done if served)
                    wait = min(wait, QUIET_GRACE_S)
                    continue
                if r.quiet_until > until:
                    wait = min(wait, r.quiet_until - until)
                    continue
                self._switch(r, _ARMED)
        return wait

    def _rearm_due(self) -> float:
        # The service thread's timeout: wake when the next quiet connection's grace ends.
        now = time.monotonic()
        wait = self._arm_quiet(now)
        self._service_wakes_at = now + wait
        return wait

    def _drop_reader(self, reader: ControlReader) -> None:
        with self._mode_lock:
            self._switch(reader, _OUT)
            reader.mode = _OUT  # out of the set even if its socket closed first
            reader.dropped = True

    def _read(self, r: ControlReader, tag: Optional[int] = None) -> None:
        # Reads until nothing waits; with `tag`, stops once a point-to-point message with that
        # tag is delivered (its receiver wants no more; what still waits is read by the next
        # receive, or by the service thread once the connection is armed again).
        try:
            while True:
                if r.got < len(r.buf):
                    k = recv_some(r.sock, r.buf, r.got)
                    if k == 0:
                        return self._closed(r, None)
                    r.got += k
                    if r.got < len(r.buf):
                        continue
                if r.stage == 0 and r.buf[:4] == wire.CONTROL_JOINED_MAGIC:
                    if not self._size_joined(r):
                        return None
                    if r.got < len(r.buf):
                        continue
                try:
                    data = r.contents()
                except IntegrityError:
                    return self._tampered(r)
                if not self._advance(r, data):
                    return None
                if tag is not None and r.stage == 0 and r.kind == wire.KIND_P2P and r.aux == tag:
                    return None
        except BlockingIOError:
            return None
        except OSError as exc:
            return self._closed(r, exc)

    def _size_joined(self, r: ControlReader) -> bool:
        """A joined frame's header is in (unchecked yet): read the rest of the frame by its
        lengths, which must be a joined frame's. False when the connection was dropped."""
        _magic, kind, aux, fp_len, length = wire.CONTROL_HEADER.unpack_from(r.buf)
        if kind not in wire.KINDS or fp_len > MAX_FINGERPRINT_BYTES or length > JOIN_MAX_BYTES:
            self._tampered(r)  # no frame its peer made: those lengths go as a split message
            return False
        r.kind, r.aux, r.fp_len = kind, aux, fp_len
        if fp_len or length:
            r.expect_joined(fp_len + length)
        return True

    def _advance(self, r: ControlReader, data) -> bool:
        """Take one checked frame of a message: size the next one, or act on a whole message.
        False when the connection was dropped."""
        if r.stage == 0:
            magic, kind, aux, fp_len, length = wire.CONTROL_HEADER.unpack(data)
            if magic == wire.CONTROL_JOINED_MAGIC:  # nothing follows (`_size_joined`)
                fp_len = length = 0
            elif (magic != wire.CONTROL_MAGIC or kind not in wire.KINDS
                    or fp_len > MAX_FINGERPRINT_BYTES or length > MAX_CONTROL_FRAME_BYTES):
                self._garbled(r, f"header {bytes(data)!r}")
                return False
            r.kind, r.aux, r.fp_len = kind, aux, fp_len
            if fp_len or length:
                r.expect(1, fp_len + length)
                return True
            data = memoryview(b"")
        n = r.fp_len
        r.next_header()
        return self._frame(r, r.kind, r.aux, bytes(data[:n]), data[n:])

    def _frame(self, r: ControlReader, kind: int, aux: int, fp: bytes, payload) -> bool:
        if kind == wire.KIND_BYE:
            logger.debug("Rank %d of group %r: rank %d said goodbye", self.rank, self.name, r.peer)
            with self._cond:
                self.departed[r.peer] = True
                self._cond.notify_all()
        elif kind == wire.KIND_ABORT:
            reason = FailureReason.from_bytes(bytes(payload), r.peer)
            self._on_failure(reason)
        elif kind == wire.KIND_P2P:
            with self._cond:
                self._mail[(r.peer, aux)].append((fp, payload))
                self._cond.notify_all()
        elif kind == wire.KIND_READY:
            with self._cond:
                self.readies.file(r.peer, aux, fp, bytes(payload))
                self._cond.notify_all()
        return True

    def _closed(self, r: ControlReader, exc: Optional[BaseException]) -> None:
        self._drop_reader(r)
        with self._cond:
            clean = self.departed[r.peer] or self._closing
            self._cond.notify_all()
        if clean:
            return
        how = f"its connection failed ({exc})" if exc else "its connection closed without a goodbye"
        self._on_failure(FailureReason(
            "peer_lost",
            f"rank {r.peer} was lost: {how}; the process died or was killed",
            origin=self.rank, culprits=(r.peer,),
        ))

    def _tampered(self, r: ControlReader) -> None:
        self._drop_reader(r)
        what = "a control message header" if r.stage == 0 else "a control message"
        logger.error("Rank %d of group %r dropped its control connection from rank %d: %s "
                     "failed its integrity check", self.rank, self.name, r.peer, what)
        self._on_failure(FailureReason(
            "error", f"{what} from rank {r.peer} failed its integrity check (it was altered, "
                     "injected or replayed between the ranks); the connection was dropped",
            origin=self.rank, culprits=(r.peer,),
        ))

    def _garbled(self, r: ControlReader, what: str) -> None:
        self._drop_reader(r)
        logger.error("Rank %d of group %r got a malformed control frame from rank %d: %s",
                     self.rank, self.name, r.peer, what)
        self._on_failure(FailureReason(
            "error", f"rank {r.peer} sent a malformed control frame ({what})",
            origin=self.rank, culprits=(r.peer,),
        ))

    # ------------------------------------------------------------------ point to point

    def _message(self, dst: int, kind: int, aux: int = 0, fp: bytes = b"", payload=b"") -> list:
        """The frames of one message to `dst`, tagged now (call under its send lock)."""
        sealer = self.links[dst].sealer
        if not sealer.encrypt and len(payload) <= JOIN_MAX_BYTES:
            frame = b"".join((wire.CONTROL_HEADER.pack(
                wire.CONTROL_JOINED_MAGIC, kind, aux, len(fp), len(payload)), fp, payload))
            return [frame, sealer.tag((frame,))]
        head = wire.CONTROL_HEADER.pack(wire.CONTROL_MAGIC, kind, aux, len(fp), len(payload))
        parts = [head, sealer.tag((head,))]
        if not fp and not len(payload):
            return parts
        if sealer.encrypt:
            return parts + [sealer.seal(b"".join((fp, payload)) if fp else payload)]
        if not fp:
            return parts + [payload, sealer.tag((payload,))]
        if len(payload) <= JOIN_MAX_BYTES:
            body = b"".join((fp, payload))  # one part, one AES call (a copy of a small payload)
            return parts + [body, sealer.tag((body,))]
        return parts + [fp, payload, sealer.tag((fp, payload))]  # as `body_parts` splits it

    def send_p2p(self, dst: int, tag: int, fp: bytes, payload: memoryview,
                 kind: int = wire.KIND_P2P) -> None:
        """Send one tagged message to `dst` over the control connection (blocks on a full pipe);
        `kind` KIND_READY sends an offer instead (not counted as a message)."""
        sock = self.socks[dst]
        if sock is None:
            raise OSError(errno.ENOTCONN, "no control connection")
        with self._send_locks[dst]:
            wire.send_all(sock, self._message(dst, kind, tag, fp, payload))
        if kind == wire.KIND_P2P:
            self.sent[(dst, tag)] += 1  # (one thread at a time sends a group's messages)

    def take_p2p(self, src: Optional[int], tag: int, stop: Callable[[], bool],
                 wait_s: float = 0.25, *, until: Optional[float] = None):
        """Wait for a message with `tag` from `src` (or anyone); returns (src, fp, payload), or
        None once `stop()` or the `time.monotonic()` deadline `until` came first.

        `stop()` is polled every `wait_s` (without `until`) so a failed group ends the wait.
        The service thread delivers the message: no connection is quiet meanwhile.
        """
        if until is None:
            return self.served_wait(lambda: self._pop(src, tag), stop, wait_s)

        def done() -> bool:
            return stop() or time.monotonic() >= until

        return self.served_wait(lambda: self._pop(src, tag), done,
                                max(0.0, until - time.monotonic()))

    def served_wait(self, pop: Callable[[], Optional[tuple]], stop: Callable[[], bool],
                    wait_s: float) -> Optional[tuple]:
        """Wait until `pop()` (called under the channel's lock) finds what the service thread
        delivers, or `stop()`; `pop()`'s answer or None. No connection stays quiet meanwhile."""
        with self._mode_lock:
            self._served += 1
        try:
            self._arm_quiet(float("inf"))
            with self._cond:
                while True:
                    got = pop()
                    if got is not None:
                        return got
                    if stop():
                        return None
                    self._cond.wait(wait_s)
        finally:
            with self._mode_lock:
                self._served -= 1

    def _pop(self, src: Optional[int], tag: int):
        # The first message with `tag` from `src` (or anyone), or None; call under _cond.
        for q in ([src] if src is not None else range(self.size)):
            box = self._mail.get((q, tag))
            if box:
                fp, payload = box.popleft()
                self.taken[(q, tag)] += 1
                return q, fp, payload
        return None

    def take_p2p_reading(self, src: int, tag: int, stop: Callable[[], bool], until: float,
                         spin) -> Optional[tuple]:
        """`take_p2p` from one source until the `time.monotonic()` deadline `until`, reading
        that source's connection in this thread while it waits; None when nothing came.

        Through the service thread a small message costs two wake-ups (the kernel wakes the
        service thread, which wakes the receiver), each a trip through the scheduler that on a
        VM outlasts a whole 4 KiB exchange. Here the receiver takes the connection out of the
        service thread's epoll set, polls it for `spin`'s window (`spin.SpinPolicy`) and then
        sleeps in the kernel on it directly, processing every frame exactly as the service
        thread would (aborts, goodbyes, other tags' messages, a closed or tampered connection).
        The connection goes back to the service thread quiet (`QUIET_GRACE_S`): the next
        message, most likely this receiver's next one, wakes only whoever reads it.
        """
        r = self._readers[src]
        if r is None or r.dropped or not r.lock.acquire(blocking=False):
            return self.take_p2p(src, tag, stop, until=until)
        try:
            # What has arrived already needs no wait, nor the epoll set changed around it.
            got = self._read_now(r, src, tag)
            if got is None and not r.dropped:
                self._set_mode(r, _QUIET, reading=True)
                got = self._read_until(r, src, tag, stop, until, spin)
            return got
        finally:
            if not self._closing:
                # Quiet: the next message on it is most likely this receiver's next one, and
                # the grace period bounds how long any other waits unread. (epoll's set is
                # thread-safe: the service thread's wait sees the change at once.)
                self._set_mode(r, _QUIET)
            r.lock.release()

    def waiting(self, src: int, tag: int) -> int:
        """How many messages from `src` under `tag` wait untaken."""
        with self._cond:
            box = self._mail.get((src, tag))
            return len(box) if box else 0

    def _read_now(self, r: ControlReader, src: int, tag: int) -> Optional[tuple]:
        # The message if it is in the mailbox or on the connection already (never blocks).
        with self._cond:
            got = self._pop(src, tag)
        if got is None and not r.dropped:
            self._read(r, tag)
            with self._cond:
                got = self._pop(src, tag)
        return got

    def _read_until(self, r: ControlReader, src: int, tag: int, stop: Callable[[], bool],
                    until: float, spin) -> Optional[tuple]:
        # Called once `_read_now` found nothing: wait for bytes, then read what came.
        while True:
            left = until - time.monotonic()
            if left <= 0 or stop():
                return None
            try:
                k = spin.poll(r.sock, memoryview(r.buf)[r.got:], len(r.buf) - r.got)
            except OSError as exc:
                self._closed(r, exc)
                return None
            if k > 0:
                r.got += k
            elif k < 0:
                self._closed(r, None)
                return None
            else:
                if r.poller is None:
                    r.poller = select.poll()
                    r.poller.register(r.sock, select.POLLIN)
                r.poller.poll(left * 1000.0)
            got = self._read_now(r, src, tag)
            if got is not None or r.dropped:
                return got

    def wake_waiters(self) -> None:
        """Wake threads waiting for point-to-point messages (after a failure)."""
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ teardown

    def send_last_message(self, kind: int, payload: bytes = b"") -> None:
        """Send a message of `kind` to every peer's control socket (best effort, bounded),
        then end it."""
        for q, sock in enumerate(self.socks):
            if sock is None or q == self.rank:
                continue
            lock = self._send_locks[q]
            if lock.acquire(timeout=0.5):
                try:
                    sock.settimeout(1.0)
                    sock.sendall(b"".join(self._message(q, kind, payload=payload)))
                except OSError:
                    pass
                finally:
                    lock.release()
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def say_goodbye(self) -> None:
        """The first step of closing: from now on a closing connection is no failure, and every
        peer hears that this rank leaves."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self.send_last_message(wire.KIND_BYE)

    def close(self) -> None:
        """Stop the service thread and release the connections (after `say_goodbye`)."""
        self._closing = True
        self._wake()
        if self._service is not None and self._service is not threading.current_thread():
            self._service.join(timeout=2.0)
        for sock in self.socks:
            if sock is not None:
                drain(sock)
                sock.close()
        try:
            self._epoll.close()
        except (OSError, ValueError):
            pass
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
