"""`Stream`: one authenticated gRPC stream to one peer, as the agent sees it.

`send` takes a serialized `Frame` from any thread; frames that come during a write or in a burst
leave together as one gRPC message (a `Batch`), so that under load one gRPC write, which costs
far more CPU than a frame, carries many calls.

How frames leave depends on which of grpcio's layers carries the stream (the transport decides,
transport/grpc.py):
- grpcio's Cython layer (transport/direct.py), the default: a dialed stream's `DirectCall` or an
  accepted stream's `ServerCall` is the stream's `pump`; a caller alone on the stream writes its
  frame itself, and the pump's writer thread sends bursts.
- grpcio's public API, where that private layer does not fit (or SHOAL_RPC_GRPC=public): a
  dialed stream's frames go on its request queue, which the one thread gRPC runs to send the
  stream's requests drains into coalesced messages (`public_requests`); an accepted stream
  writes through grpcio's non-blocking handler form (`attach_writer`), from the thread with the
  frame when the stream is idle and by the stream's writer thread during a write or a burst.

Who reads the stream is `readers` (transport/readers.py).

Every message after the server's first carries the stream's 16-byte tag after its bytes, or is
sealed whole (SHOAL_ENCRYPT), under the stream's `core.channel.Link` (`attach_link`):
`encode_message` adds it, so messages are tagged in the order they go out (each path has one
writer at a time), and `open_message` checks it in the order they arrive (one reader at a time),
before anything in the message is parsed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Iterator, Optional

from shoal.core.channel import TAG_BYTES, IntegrityError, Link, Opener, Sealer
from shoal.rpc_agent import metrics
from shoal.rpc_agent._threads import BurstWriter
from shoal.rpc_agent.types import CONNECT_TIMEOUT_S, RpcPeerLost
from shoal.rpc_agent.transport import direct, direct_server
from shoal.rpc_agent.transport.readers import StreamReaders

logger = logging.getLogger(__name__)

# A writer stops adding frames to one gRPC message past this size; the rest go in the next.
MAX_BATCH_BYTES = 8 * 1024 * 1024
# A frame sent this soon after the previous write ended is taken for part of a burst.
# Sync calls and their replies are a round trip (100 us or more) apart.
BURST_GAP_S = 50e-6
# A received message's body up to this size is copied out of it before its tag is checked and
# it is parsed (a copy of a few KiB costs less than the memoryview it saves); larger ones are
# read through a view.
_COPY_BODY_BYTES = 4096
_STOP = object()


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_batch(frames: list[bytes]) -> bytes:
    """A serialized `Batch` of already serialized `Frame`s.

    A repeated message field is each element's bytes behind its tag and length, so joining
    the frames here gives exactly what `Batch(frames=...).SerializeToString()` would, without
    parsing them back into messages first.
    """
    parts = []
    for frame in frames:
        parts.append(b"\x0a")  # field 1, wire type 2 (length-delimited)
        parts.append(_varint(len(frame)))
        parts.append(frame)
    return b"".join(parts)


class Stream:
    """One authenticated stream to one peer; `send` from any thread, frames go out coalesced."""

    CONNECTING, OPEN, DEAD = "connecting", "open", "dead"

    def __init__(self, peer_id: int, peer_name: str, outgoing: bool):
        self.peer_id = peer_id
        self.peer_name = peer_name
        self.outgoing = outgoing
        self.state = Stream.CONNECTING
        self.dead_reason: Optional[str] = None
        # Request ids of calls sent on this stream and not yet answered (failed if it dies).
        self.pending_ids: set[int] = set()
        self.opened = threading.Event()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        # Public API only (see the module docstring): dialed streams queue frames for
        # `public_requests`; accepted ones write through grpcio's non-blocking server callback:
        # `_write(data)` sends one message from the calling thread and returns once gRPC took
        # it (False once the RPC is over). See `send`.
        self._write: Optional[Callable[[bytes], bool]] = None
        self._outbox: list[bytes] = []
        self._writing = False
        self._writer = BurstWriter(self._write_burst, f"shoal-rpc-write-{peer_name}")
        self._last_write = 0.0
        # Where grpcio's private layer fits: a dialed stream's DirectCall (frames wait in it
        # until the server's proof checked out), or the ServerCall of an accepted stream
        # (`attach_server_call`). None on grpcio's public API.
        self.pump: Optional[direct.Pump] = (
            direct.DirectCall(self.encode_message, MAX_BATCH_BYTES, BURST_GAP_S, peer_name)
            if outgoing and direct.available() else None
        )
        self._cancel: Optional[Callable[[], None]] = None
        # The stream's keys, once its hello was answered; messages before that are not tagged.
        # Its halves are kept apart: every message reads them (no lookup through the Link).
        self._sealer: Optional[Sealer] = None
        self._opener: Optional[Opener] = None
        self.readers = StreamReaders()
        # Called once, after the stream is marked dead (the agent fails its pending calls).
        self.on_dead: Optional[Callable[["Stream"], None]] = None
        # How many frames went out in how many gRPC messages (coalescing, for tests and logs).
        self.frames_sent = 0
        self.messages_sent = 0

    def describe(self) -> str:
        """The peer as error messages name it."""
        return f"worker {self.peer_name!r} (id {self.peer_id})"

    @property
    def alive(self) -> bool:
        """True until the stream failed or was closed."""
        return self.state != Stream.DEAD

    def send(self, frame: bytes, more_coming: bool = False, waits: bool = False) -> None:
        """Queue one serialized Frame. `more_coming`: the caller is about to send another (a
        remote() is mostly followed by its to_here(), an owner's remote() reply by the fetch
        waiting on the value), so the frame is left to the stream's writer thread instead of
        written now: that thread gets the GIL only when the caller pauses, and the frames that
        came meanwhile leave with it in one gRPC message. A frame written at once would hold
        the next one back until gRPC reports the write done, which on a dialed stream is
        often only when the peer's answer arrives: one round trip each instead of one for both.
        `waits`: the caller blocks on the answer next (no burst of its own follows), so it
        writes the frame, and what queued before it, itself, unless a write is in flight.

        Raises:
            RpcPeerLost: the stream is dead (the agent reconnects on the next call).
        """
        if self.state == Stream.DEAD:
            raise RpcPeerLost(f"The RPC stream to {self.describe()} is down ({self.dead_reason}).")
        if self.pump is not None:
            # A caller alone on the stream starts the gRPC write itself (see direct.Pump).
            if not self.pump.send(frame, quiet=waits or (not more_coming and len(self.pending_ids) <= 1)):
                self.fail("the RPC ended while writing to it")
            elif self.pump.waiting() and self.readers.inline_since is not None:
                # Only a reader sees the write in flight end, and ours runs a call: let
                # another thread read now rather than after the call (or INLINE_HANDOVER_S).
                self.readers.hand_on()
            return
        if self._write is None:
            self._queue.put(frame)
            return
        # Accepted stream: a thread that finds the stream idle writes its frame itself, saving
        # the hand-off to a sending thread (a reply leaves from the thread that ran the call).
        # Frames queued meanwhile go out coalesced, by the stream's writer thread, so a caller
        # never stays to write other threads' frames. A frame that follows the last write
        # closely (a burst of rpc_async calls from one thread) also goes to the writer thread:
        # written one by one, each would cost a whole gRPC write.
        with self._lock:
            self._outbox.append(frame)
            if self._writing:
                return
            self._writing = True
            burst = more_coming or time.monotonic() - self._last_write < BURST_GAP_S
        if burst or self._write_outbox():
            self._writer.wake()

    def _write_outbox(self) -> bool:
        """Write what the outbox holds (the caller is the stream's one writer); True when more
        frames arrived meanwhile (the writer role is still held), False when it was released."""
        with self._lock:
            frames, self._outbox = self._outbox, []
        if len(frames) == 1:  # a lone frame (a reply): one message, no batching generator
            batches = (self.encode_message(frames),)
        else:
            batches = self._batches(frames)
        for data in batches:
            if not self._write(data):
                self.fail("the RPC ended while writing to it")
                break
        with self._lock:
            self._last_write = time.monotonic()
            if self._outbox and self.state != Stream.DEAD:
                return True
            self._outbox = []
            self._writing = False
            return False

    def _write_burst(self) -> bool:
        """The writer thread's turn: write until the outbox stays empty; False once dead."""
        if self.state == Stream.DEAD:
            return False
        while self._write_outbox():
            pass
        return True

    def _batches(self, frames: list[bytes]) -> Iterator[bytes]:
        """Coalesced gRPC messages of `frames`, each up to MAX_BATCH_BYTES (counted as sent)."""
        start, size = 0, 0
        for i, frame in enumerate(frames):
            if i > start and size + len(frame) > MAX_BATCH_BYTES:
                yield self.encode_message(frames[start:i])
                start, size = i, 0
            size += len(frame)
        if start < len(frames):
            yield self.encode_message(frames[start:])

    def attach_link(self, link: Link) -> None:
        """Tag (or seal) every message from now on, and check every one received, with the
        keys of this stream's handshake."""
        self._opener = link.opener
        self._sealer = link.sealer

    def open_message(self, data: bytes):
        """The Batch bytes of a received message, once its tag checks out (or it decrypts).

        Raises:
            IntegrityError: it is not the next message the peer sent with this stream's keys,
                or the stream has no keys (the caller drops the stream).
        """
        opener = self._opener
        if opener is None:
            raise IntegrityError(f"A message arrived from {self.describe()} before the "
                                 f"stream's keys were agreed. The stream is dropped.")
        if opener.encrypt:
            return opener.open(data)
        end = len(data) - TAG_BYTES
        if end < 0:
            raise IntegrityError(f"A message of {len(data)} bytes from {self.describe()} is "
                                 f"too short to carry its tag. The stream is dropped.")
        if end <= _COPY_BODY_BYTES:
            # A small message's body is copied: cheaper than a memoryview and its two slices,
            # and protobuf parses bytes faster than a view.
            body = data[:end]
            opener.check((body,), data[end:])
            return body
        view = memoryview(data)
        body = view[:end]
        opener.check((body,), view[end:])
        return body

    def encode_message(self, frames: list[bytes]) -> bytes:
        """One gRPC message carrying `frames`, tagged or sealed once the stream has keys,
        counted as sent."""
        if len(frames) == 1:
            frame = frames[0]
            data = b"\x0a" + _varint(len(frame)) + frame
        else:
            data = encode_batch(frames)
        sealer = self._sealer
        if sealer is not None:
            if sealer.encrypt:
                data = sealer.seal(data)
            else:
                data += sealer.tag((data,))
        metrics.BYTES_SENT.inc(len(data))
        self.frames_sent += len(frames)
        self.messages_sent += 1
        return data

    def public_requests(self) -> Iterator[bytes]:
        """What gRPC's sending thread iterates on a stream dialed through grpcio's public API:
        coalesced batches until the stream ends."""
        if not self.opened.wait(CONNECT_TIMEOUT_S + 1.0) or self.state != Stream.OPEN:
            return
        get, get_nowait, empty = self._queue.get, self._queue.get_nowait, self._queue.empty
        while True:
            frame = get()
            if frame is _STOP:
                return
            frames = [frame]
            size = len(frame)
            stop = False
            # This thread is the queue's only consumer: after `empty()` said no, `get_nowait`
            # cannot fail (and an empty queue costs no raised exception, which a lone frame,
            # the common case, would otherwise pay on its way out).
            while size < MAX_BATCH_BYTES and not empty():
                frame = get_nowait()
                if frame is _STOP:
                    stop = True
                    break
                frames.append(frame)
                size += len(frame)
            yield self.encode_message(frames)
            if stop or self.state == Stream.DEAD:
                return

    def queue_request(self, frame: bytes) -> None:
        """Queue a frame for `public_requests` (where a DirectCall could not start, it hands
        its frames here)."""
        self._queue.put(frame)

    def attach_writer(self, write: Callable[[bytes], bool]) -> None:
        """Write through grpcio's non-blocking server callback from now on: `write(data)` sends
        one message and returns once gRPC took it, False once the RPC is over."""
        self._write = write

    def attach_server_call(self, accepted: direct_server.Accepted) -> direct.ServerCall:
        """Carry this accepted stream over grpcio's private layer; the transport reads the
        returned call."""
        self.pump = direct.ServerCall(accepted, self.encode_message, MAX_BATCH_BYTES,
                                      BURST_GAP_S, self.peer_name)
        return self.pump

    def mark_open(self, cancel: Callable[[], None]) -> bool:
        """The peer proved itself: frames may flow, and `cancel()` ends the RPC; False if the
        stream died meanwhile."""
        with self._lock:
            if self.state == Stream.DEAD:
                return False
            self._cancel = cancel
            self.state = Stream.OPEN
        self.opened.set()
        return True

    def fail(self, reason: str) -> bool:
        """Mark the stream dead (any thread) and end it; True if this call did it."""
        with self._lock:
            if self.state == Stream.DEAD:
                return False
            self.state = Stream.DEAD
            self.dead_reason = reason
            cancel = self._cancel
        self.opened.set()
        self._queue.put(_STOP)
        self._writer.wake_if_started()
        if cancel is not None:
            try:
                cancel()
            except Exception:
                logger.debug("Cancelling the stream to %s failed", self.describe(), exc_info=True)
        if self.on_dead is not None:
            self.on_dead(self)
        return True


