"""Point-to-point payloads through shared memory, for groups whose ranks share one host.

Over the control channel a large message costs a copy into the kernel, one out of it into a
fresh buffer of the receiver's control thread, and one more into the receiving array. Here the
sender copies the payload into its ring for the receiver (a part of its own region, `shm`)
and sends only a small descriptor over the control channel, as a point-to-point message of
its own (so tags, ordering, any-source receives, the integrity tags and a lost peer's error
all work as before); the receiver copies the payload straight out of the sender's region into
its array. Two copies, no kernel buffers, no thread hand-off of the bytes.

Sends stay eager (a send never waits for its receive to be posted, as over the control
channel): a message takes the ring only when it fits in the space the receiver has already
freed, and otherwise goes over the sockets as before. Ring space is handed out in order; the
receiver frees a message's bytes once it has copied them (or dropped the message), publishing
in its own region how far it has freed in each sender's ring. Messages received out of order
(another tag first) free their space when every earlier one is freed. Only the writer of a
counter or a ring ever writes it; on x86-64 an aligned 8-byte store is seen whole, and stores
are seen in program order, so a sender that reads a freed count sees the receiver done with
those bytes.
"""

from __future__ import annotations

import struct
from typing import Optional

import numpy as np

from shoal.collectives.backends.tcp.shm import SharedSlots

__all__ = ["MARK", "ShmMail", "BadDescriptor"]

# A descriptor's fingerprint starts with MARK (a byte no fingerprint of the sockets' path
# starts with); the rest is the payload's own fingerprint.
MARK = b"\x01"
# message number in this sender's ring, start in the ring, length, ring position after it
_DESC = struct.Struct("<QQQQ")


class BadDescriptor(ValueError):
    """A descriptor that names bytes outside the ring or a message already taken (internal)."""


class ShmMail:
    """This rank's point-to-point rings: what it has handed out in its rings for each peer, and
    what it has read of each peer's ring for it. Used by one operation at a time (the group's
    executor runs point-to-point operations in order)."""

    def __init__(self, slots: SharedSlots):
        self.slots = slots
        self.rank = slots.rank
        size = slots.size
        self._head = [0] * size  # ring position after the last message written, by destination
        self._sent = [0] * size  # messages written, by destination
        self._next = [0] * size  # by source: the first message not yet freed
        self._taken: list[dict[int, int]] = [{} for _ in range(size)]  # source: number -> end

    def post(self, dst: int, payload: np.ndarray) -> Optional[bytes]:
        """Copy `payload` (uint8) into the ring for `dst` and return its descriptor, or None
        when it does not fit in the space `dst` has freed (send it over the sockets)."""
        slots, n = self.slots, payload.size
        ring_bytes = slots.p2p_ring
        if n > ring_bytes:
            return None
        freed = int(slots.counters(dst)[self.rank])
        head = self._head[dst]
        pos = head % ring_bytes
        if freed == head:
            # Nothing pending: back to the ring's start, whose pages are mapped already.
            skip = (ring_bytes - pos) % ring_bytes
        else:
            skip = ring_bytes - pos if pos + n > ring_bytes else 0
            if head + skip + n - freed > ring_bytes:
                return None
        start = 0 if skip else pos
        np.copyto(slots.ring(self.rank, dst)[start:start + n], payload)
        end = head + skip + n
        self._head[dst] = end
        number = self._sent[dst]
        self._sent[dst] = number + 1
        return _DESC.pack(number, start, n, end)

    def take(self, src: int, descriptor, out: Optional[np.ndarray]) -> None:
        """Copy the message `descriptor` names out of `src`'s ring into `out` (uint8 of its
        length; None drops it), then free its bytes.

        Raises:
            BadDescriptor: it names bytes outside the ring or a message taken already.
        """
        number, start, n, end = self._checked(src, descriptor)
        if out is not None:
            np.copyto(out, self.slots.ring(src, self.rank)[start:start + n])
        taken = self._taken[src]
        taken[number] = end
        nxt, freed = self._next[src], None
        while nxt in taken:
            freed = taken.pop(nxt)
            nxt += 1
        self._next[src] = nxt
        if freed is not None:
            self.slots.counters(self.rank)[src] = freed

    def length(self, descriptor) -> int:
        """The payload length a descriptor announces (0 for one that is not a descriptor)."""
        if len(descriptor) != _DESC.size:
            return 0
        return _DESC.unpack(descriptor)[2]

    def _checked(self, src: int, descriptor) -> tuple[int, int, int, int]:
        if len(descriptor) != _DESC.size:
            raise BadDescriptor(f"a shared-memory descriptor of {len(descriptor)} bytes")
        number, start, n, end = _DESC.unpack(descriptor)
        if start + n > self.slots.p2p_ring or number < self._next[src] or number in self._taken[src]:
            raise BadDescriptor(f"a shared-memory descriptor naming message {number}, bytes "
                                f"{start}..{start + n} of a ring of {self.slots.p2p_ring}")
        return number, start, n, end
