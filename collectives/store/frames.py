"""How the TCPStore server reads one connection's frames: without blocking, a body allocated
only as its bytes arrive, the bytes a connection holds capped per connection and across all of
them, and every frame checked under the connection's keys before it is queued.

A frame's length prefix is only a claim: a peer that announces a maximal frame and sends
nothing more holds nothing but the prefix. Small frames (up to `RECV_CHUNK`) are cut from one
growing input buffer; a larger one moves to a body of its own that grows with each read. What a
connection holds (unsplit input, a body in progress, checked frames not yet served) counts
against its own cap and a `Budget` shared by the server's connections; a read that would pass
either raises `OverBudget`, and the server drops that connection only.
"""

from __future__ import annotations

import collections
from typing import Optional

from shoal.collectives.store.wire import LENGTH, Bytes, check_length, open_payload
from shoal.core.channel import Opener

RECV_CHUNK = 256 * 1024


class OverBudget(Exception):
    """A read would take a connection, or the server, past its cap on bytes held."""


class Budget:
    """The bytes a server's connections hold in frames not yet served, and their limit."""

    __slots__ = ("limit", "held")

    def __init__(self, limit: int):
        if limit < RECV_CHUNK:
            raise ValueError(f"a store's bytes in flight need a limit of at least {RECV_CHUNK} "
                             f"bytes, got {limit}")
        self.limit = limit
        self.held = 0


class FrameReader:
    """One connection's incoming frames: `receive` reads, `pop` hands out checked bodies."""

    __slots__ = ("_opener", "_budget", "_max_held", "_inbuf", "_body", "_need", "_frames",
                 "_queued", "_held")

    def __init__(self, opener: Opener, budget: Budget, max_held: int):
        self._opener = opener
        self._budget = budget
        self._max_held = max_held
        self._inbuf = bytearray()
        self._body: Optional[bytearray] = None  # a large frame's payload, growing as it arrives
        self._need = 0  # that payload's length
        self._frames: collections.deque = collections.deque()  # checked bodies
        self._queued = 0  # their bytes
        self._held = 0  # what this reader counts against the budget now

    def __len__(self) -> int:
        """Checked frames waiting to be served."""
        return len(self._frames)

    @property
    def pending(self) -> int:
        """Bytes of a frame begun and not finished (0 between frames)."""
        return len(self._inbuf) + (len(self._body) if self._body is not None else 0)

    def receive(self, sock, scratch: memoryview) -> bool:
        """Read once from the non-blocking `sock` (through `scratch`, at least RECV_CHUNK long);
        False at the peer's EOF.

        Raises:
            BlockingIOError: nothing to read.
            OverBudget: this read would pass the connection's or the server's cap.
            FrameError: a length prefix out of bounds.
            IntegrityError: a frame failed its check; the frames before it stay queued.
            MemoryError: the body could not grow; drop the connection.
        """
        want = RECV_CHUNK if self._body is None else min(RECV_CHUNK, self._need - len(self._body))
        want = min(want, self._room())
        try:
            n = sock.recv_into(scratch, want)
            if n == 0:
                return False
            if self._body is not None:
                self._body += scratch[:n]
                if len(self._body) == self._need:
                    body, self._body = self._body, None
                    self._queue(body)
            else:
                self._inbuf += scratch[:n]
            self._split()
            return True
        finally:
            self._settle()

    def pop(self) -> Bytes:
        """The oldest checked frame body."""
        body = self._frames.popleft()
        self._queued -= len(body)
        self._settle()
        return body

    def release(self) -> None:
        """Give back every byte held (the connection is dropped)."""
        self._inbuf = bytearray()
        self._body = None
        self._frames.clear()
        self._queued = 0
        self._settle()

    def _room(self) -> int:
        mine = self._max_held - self._held
        if mine <= 0:
            raise OverBudget(
                f"holds {self._held} bytes of requests it sent without waiting for the replies, "
                f"the most one connection may")
        total = self._budget.limit - self._budget.held
        if total <= 0:
            raise OverBudget(
                f"sent more while the server's connections hold {self._budget.held} bytes of "
                f"unserved frames, its limit")
        return min(mine, total)

    def _split(self) -> None:
        buf = self._inbuf
        pos = 0
        try:
            while len(buf) - pos >= LENGTH.size:
                (length,) = LENGTH.unpack_from(buf, pos)
                check_length(length)
                start = pos + LENGTH.size
                if len(buf) - start >= length:
                    pos = start + length
                    self._queue(bytes(buf[start:pos]))
                    continue
                if length > RECV_CHUNK:
                    # the rest of a large frame grows a body of its own, not the input buffer
                    self._body, self._need = bytearray(buf[start:]), length
                    pos = len(buf)
                break
        finally:
            del buf[:pos]

    def _queue(self, payload) -> None:
        body = open_payload(self._opener, payload)
        self._frames.append(body)
        self._queued += len(body)

    def _settle(self) -> None:
        held = self.pending + self._queued
        self._budget.held += held - self._held
        self._held = held
