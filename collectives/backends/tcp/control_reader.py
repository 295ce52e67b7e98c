"""How a control connection's bytes become checked frames (`ControlReader`), for the control
channel (`control.ControlChannel`), which owns the connections and acts on the messages."""

from __future__ import annotations

import select
import socket
import threading
from typing import Optional

from shoal.collectives.backends.tcp import wire
from shoal.collectives.backends.tcp.framing import TAG
from shoal.core.channel import Link

__all__ = ["ControlReader", "JOIN_MAX_BYTES", "body_parts", "recv_some"]


def recv_some(sock: socket.socket, buf: bytearray, start: int) -> int:
    """Read what is waiting into `buf[start:]` without blocking; 0 means the peer closed.

    Raises:
        BlockingIOError: nothing is waiting.
    """
    view = memoryview(buf)[start:]
    return sock.recv_into(view, len(view), socket.MSG_DONTWAIT)


# A message whose payload is at most this long is one frame (`wire.CONTROL_JOINED_MAGIC`: one
# AES call); a longer body is tagged as two parts, so its payload is not copied to be joined.
JOIN_MAX_BYTES = 64 * 1024


def body_parts(body, fp_len: int) -> tuple:
    """The parts a received body's tag covers (see JOIN_MAX_BYTES)."""
    if fp_len and len(body) - fp_len > JOIN_MAX_BYTES:
        return (body[:fp_len], body[fp_len:])
    return (body,)


class ControlReader:
    """Incremental reader of one non-blocking control connection: it fills `buf` (the frame
    being read, then its tag) up to `got` bytes; `stage` says which frame of a message that is
    (0 the header; 1 a split message's body: `fp_len` bytes of fingerprint, then the payload;
    2 a joined frame whole, its header and first bytes read at stage 0)."""

    __slots__ = ("peer", "sock", "fd", "link", "buf", "got", "stage", "kind", "aux", "fp_len",
                 "lock", "dropped", "poller", "mode", "quiet_until")

    def __init__(self, peer: int, sock: socket.socket, link: Link):
        self.peer = peer
        self.sock = sock
        self.fd = sock.fileno()
        self.link = link
        # Held by whichever thread reads the connection: the service thread, or a receiver
        # reading its own source while it waits (`ControlChannel.take_p2p_reading`).
        self.lock = threading.Lock()
        self.dropped = False  # failed or closed: never watched again
        self.poller: Optional[select.poll] = None  # a receiver's wait for this connection
        self.mode = 0  # what the service thread watches (`control`: 0 is none yet)
        self.quiet_until = 0.0  # when a _QUIET connection is armed again (time.monotonic)
        self.got = 0
        self.kind = self.aux = self.fp_len = 0
        self.next_header()

    def next_header(self) -> None:
        """Read a message's header next."""
        self.stage = 0
        self.buf = bytearray(wire.CONTROL_HEADER.size + TAG)
        self.got = 0

    def expect_joined(self, nbytes: int) -> None:
        """Read the rest of a joined frame (`wire.CONTROL_JOINED_MAGIC`) whose header and first
        bytes are in `buf`: `nbytes` of fingerprint and payload, then its tag."""
        head = self.buf
        self.stage = 2
        self.buf = bytearray(wire.CONTROL_HEADER.size + nbytes + TAG)
        self.buf[:len(head)] = head

    def expect(self, stage: int, nbytes: int) -> None:
        """Read the message's frame `stage` of `nbytes` (and its tag) next."""
        self.stage = stage
        self.buf = bytearray(nbytes + TAG)
        self.got = 0

    def contents(self):
        """The frame just read, checked (decrypted if sealed).

        Raises:
            IntegrityError: its tag does not verify.
        """
        opener = self.link.opener
        if self.stage == 1 and opener.encrypt:
            return memoryview(opener.open(self.buf))
        view = memoryview(self.buf)
        body = view[:-TAG]
        if self.stage == 2:  # one part: header, fingerprint, payload
            opener.check((body,), view[-TAG:])
            return body[wire.CONTROL_HEADER.size:]
        opener.check(body_parts(body, self.fp_len if self.stage == 1 else 0), view[-TAG:])
        return body
