"""Frames on the tcp backend's connections: after the handshake every byte a socket carries is
part of a frame that ends in its connection's 16-byte tag (`core.channel`), and the receiver
checks the tag before it acts on the frame.

A frame is whatever one send puts on the wire as a unit: a hello, a data header, one chunk of
payload, a control header, an abort notice. The receiver always knows a frame's length before
it reads it (from its own call, or from a header it has already checked), reads the frame and
its tag, and checks them: a frame altered, injected, dropped or replayed by anyone between the
ranks fails, and the collective fails naming the peer (`Tampered`) instead of using it.

Tags are computed as each frame goes out, not when a plan is made, so a ring's gated sends tag
the data they forward just after reducing it. One tag per frame, over the buffer as it lies:
no copy in the default mode, except that the direct path's small messages (a header and up to
8 KiB of payload) are joined into one frame, copied, so that one tag call covers both.

With SHOAL_ENCRYPT=1 (`Link.encrypt`) payload frames are sealed instead (AES-GCM: the same
length on the wire, ciphertext then tag), which costs a copy each way. Headers stay tagged in
the clear in both modes: a receiver must read a peer's header to report a mismatched call, so
what travels in the clear is the op, the shapes and dtypes and the sequence numbers, never an
array's contents.

Shared memory within a host (`shm`) is not a connection: its regions are memfds passed over
these links (the offer that carries one is a tagged frame naming the memfd's inode, so a
relay cannot swap it) and mapped only by processes of the same user.
"""

from __future__ import annotations

import socket
from typing import Optional

from shoal.collectives.backends.tcp import wire
from shoal.core import channel
from shoal.core.channel import IntegrityError

TAG = channel.TAG_BYTES
# Up to this many bytes of a direct-path body are copied beside its header, tagged as one part.
JOIN_BYTES = 8 * 1024

__all__ = ["TAG", "Tampered", "Outbound", "Inbound"]


class Tampered(Exception):
    """A frame from `peer` (a rank of the links it came on) failed its integrity check
    (internal; the group fails naming the peer)."""

    def __init__(self, peer: int, what: str):
        super().__init__(peer, what)
        self.peer = peer
        self.what = what


class Outbound:
    """The sending end of one data connection: its socket and its link's sealer."""

    __slots__ = ("sock", "_sealer", "encrypt")

    def __init__(self, sock: socket.socket, link: channel.Link):
        self.sock = sock
        self._sealer = link.sealer
        self.encrypt = link.encrypt

    def fileno(self) -> int:
        """The socket's descriptor (for select)."""
        return self.sock.fileno()

    def frame(self, data) -> list:
        """The buffers that carry payload `data` as the next frame: it and its tag, or it
        sealed in encrypt mode."""
        if self.encrypt:
            return [self._sealer.seal(data)]
        return [data, self._sealer.tag((data,))]

    def header(self, data) -> list:
        """The buffers of the next frame when `data` is a header: tagged, in the clear."""
        return [data, self._sealer.tag((data,))]

    def send_joined(self, head, body) -> None:
        """Send `head` and `body` as ONE frame under one tag, blocking (the direct path's small
        messages, whose header carries the body's length): a body of up to `JOIN_BYTES` is
        copied beside the header and tagged in one call (a 4 KiB copy costs a third of a tag
        call), a larger one is tagged in place as the frame's second part."""
        if len(body) <= JOIN_BYTES:
            data = b"".join((head, body))
            wire.send_all(self.sock, [data, self._sealer.tag((data,))])
        else:
            wire.send_all(self.sock, [head, body, self._sealer.tag((head, body))])

    def send_header(self, data, body=None) -> None:
        """Send header `data`, then `body` (if not empty) as a payload frame; blocking."""
        parts = self.header(data)
        if body is not None and len(body):
            parts += self.frame(body)
        wire.send_all(self.sock, parts)


class Inbound:
    """The receiving end of one data connection: its socket and its link's opener."""

    __slots__ = ("sock", "_opener", "encrypt", "trailer", "_stage")

    def __init__(self, sock: socket.socket, link: channel.Link):
        self.sock = sock
        self._opener = link.opener
        self.encrypt = link.encrypt
        self.trailer = memoryview(bytearray(TAG))  # the tag of the frame being read
        self._stage: Optional[bytearray] = None  # where a sealed frame lands (encrypt mode)

    def fileno(self) -> int:
        """The socket's descriptor (for select)."""
        return self.sock.fileno()

    def verify(self, peer: int, data, tag, what: str = "a data frame") -> None:
        """Check the next frame's `tag` over `data`.

        Raises:
            Tampered: it is not the frame `peer` sent next on this connection.
        """
        try:
            self._opener.check((data,), tag)
        except IntegrityError:
            raise Tampered(peer, what) from None

    def verify_joined(self, peer: int, frame, split: int, tag) -> None:
        """Check the tag of a frame sent by `Outbound.send_joined`: `frame` holds its header
        (the first `split` bytes) and its body.

        Raises:
            Tampered: as `verify`.
        """
        frame = memoryview(frame)
        parts = (frame,) if len(frame) - split <= JOIN_BYTES else (frame[:split], frame[split:])
        try:
            self._opener.check(parts, tag)
        except IntegrityError:
            raise Tampered(peer, "a collective message") from None

    def accept(self, peer: int, frame):
        """The payload of a whole payload frame as received (`frame`: its bytes then its tag),
        checked: a view of `frame` itself, or the decrypted bytes in encrypt mode.

        Raises:
            Tampered: as `verify`.
        """
        if self.encrypt:
            try:
                return self._opener.open(frame)
            except IntegrityError:
                raise Tampered(peer, "a data frame") from None
        frame = memoryview(frame)
        self.verify(peer, frame[:-TAG], frame[-TAG:])
        return frame[:-TAG]

    def landing(self, view) -> list:
        """Where the next payload frame, whose contents go to `view`, is received: `view` and
        the trailer, or (encrypt mode) a staging buffer; `land` finishes it."""
        if not self.encrypt:
            return [view, self.trailer]
        need = len(view) + TAG
        if self._stage is None or len(self._stage) < need:
            self._stage = bytearray(need)
        return [memoryview(self._stage)[:need]]

    def land(self, peer: int, view) -> None:
        """Check the payload frame received as `landing(view)` said (decrypting it into
        `view` in encrypt mode).

        Raises:
            Tampered: as `verify`.
        """
        if self.encrypt:
            try:
                self._opener.open_into(memoryview(self._stage)[:len(view) + TAG], view)
            except IntegrityError:
                raise Tampered(peer, "a data frame") from None
        else:
            self.verify(peer, view, self.trailer)

    def receive(self, peer: int, view, cover=True) -> bool:
        """Blocking: receive the next bytes into `view` and check them as `Plan.recv`'s `cover`
        says (True: a payload frame; None: a header's opening bytes, no tag yet; a buffer: the
        header these bytes end). False if the peer closed the connection first.

        Raises:
            Tampered: as `verify`.
        """
        if cover is None:
            return wire.recv_exact(self.sock, view)
        parts = self.landing(view) if cover is True else [view, self.trailer]
        if not wire.recv_parts(self.sock, parts):
            return False
        if cover is True:
            self.land(peer, view)
        else:
            self.verify(peer, cover, self.trailer, "a collective header")
        return True


def remaining(parts: list, off: int) -> list:
    """The buffers of `parts` from byte `off` on."""
    out = []
    for part in parts:
        n = len(part)
        if off >= n:
            off -= n
            continue
        out.append(memoryview(part)[off:] if off else part)
        off = 0
    return out
