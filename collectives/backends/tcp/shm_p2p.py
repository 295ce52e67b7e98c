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
freed, and otherwise goes over the sockets as before. The receiver frees a message's bytes
once it has copied them (or dropped the message), publishing in its own region how many of
the bytes sent to it through the ring it has freed, counting in the order they were sent.
Messages received out of order (another tag first) free their space when every earlier one
is freed. The sender, knowing where each message it has not seen freed lies, puts the next
one at the lowest offset where it fits: a stream whose receiver trails by a message or two
keeps reusing the ring's first pages, which are mapped and most likely still cached, rather
than walking through the whole ring's cold memory. Only the writer of a
counter or a ring ever writes it; on x86-64 an aligned 8-byte store is seen whole, and stores
are seen in program order, so a sender that reads a freed count sees the receiver done with
those bytes.
"""

from __future__ import annotations

import collections
import struct
from typing import Optional

import numpy as np

from shoal.collectives.backends.tcp.shm import SharedSlots

__all__ = ["MARK", "ShmMail", "BadDescriptor"]

# A descriptor's fingerprint starts with MARK (a byte no fingerprint of the sockets' path
# starts with); the rest is the payload's own fingerprint.
MARK = b"\x01"
# message number in this sender's ring, start in the ring, length, the bytes sent through the
# ring up to and with it (what the receiver publishes as freed once it and those before it are)
_DESC = struct.Struct("<QQQQ")
# Messages of one ring not yet seen freed: a sender this far ahead of its receiver sends the
# rest over the sockets (its receiver is not waiting for a copy), and placing one stays cheap.
MAX_PENDING = 64


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
        self._head = [0] * size  # bytes written to each destination's ring, ever
        self._sent = [0] * size  # messages written, by destination
        # By destination: (bytes written up to and with it, start, length) of each message not
        # yet seen freed, in the order sent.
        self._pending: list[collections.deque] = [collections.deque() for _ in range(size)]
        self._next = [0] * size  # by source: the first message not yet freed
        self._taken: list[dict[int, int]] = [{} for _ in range(size)]  # source: number -> end

    def post(self, dst: int, payload: np.ndarray) -> Optional[bytes]:
        """Copy `payload` (uint8) into the ring for `dst` and return its descriptor, or None
        when it does not fit in the space `dst` has freed (send it over the sockets)."""
        slots, n = self.slots, payload.size
        ring_bytes = slots.p2p_ring
        if n > ring_bytes:
            return None
        pending = self._pending[dst]
        if pending:
            freed = int(slots.counters(dst)[self.rank])
            while pending and pending[0][0] <= freed:
                pending.popleft()
        start = _lowest_gap(pending, n, ring_bytes)
        if start is None:
            return None
        np.copyto(slots.ring(self.rank, dst)[start:start + n], payload)
        end = self._head[dst] + n
        self._head[dst] = end
        pending.append((end, start, n))
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


def _lowest_gap(pending, n: int, ring_bytes: int) -> Optional[int]:
    """The lowest offset of a ring of `ring_bytes` where `n` bytes fit beside the `pending`
    messages ((sent, start, length) each); None when they fit nowhere or too many wait."""
    if not pending:
        return 0
    if len(pending) == 1:
        _, start, length = pending[0]
        if n <= start:
            return 0
        return start + length if start + length + n <= ring_bytes else None
    if len(pending) >= MAX_PENDING:
        return None
    pos = 0
    for start, length in sorted((start, length) for _, start, length in pending):
        if start - pos >= n:
            return pos
        pos = max(pos, start + length)
    return pos if ring_bytes - pos >= n else None
