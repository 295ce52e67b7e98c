"""A dialed stream driven through grpcio's Cython layer instead of its thread-based client API.

Why: for a bidirectional stream, grpcio's public client API puts two of its own threads on
every round trip. A frame a caller sends goes to the thread that iterates the request
generator, which starts the gRPC write and then sleeps until the channel's spin thread tells
it the write finished; a reply is seen by that spin thread, which wakes whoever waits in the
response iterator. Each hand-off is a thread wake-up (about 30 us on this kind of machine,
where a 64-byte rpc_sync takes about 330 us). Here the caller starts the write itself, and the
stream's reader waits on the call's own completion queue: it sees both the reply and the end
of the write, with no thread in between.

What is used from `grpc._cython.cygrpc`: `Channel.segregated_call` (a call with its own
completion queue: grpcio's single-threaded unary-stream calls are built on it),
`SegregatedCall.operate`, `next_event` and `cancel`, and the operation classes. They are
private to grpcio, so `available()` checks for them, and the transport uses the public API when
they are missing, when a call cannot be made with them, or when SHOAL_RPC_GRPC_CLIENT=public.

Rules the code keeps (gRPC core's and cygrpc's):
- one send operation at a time per call: frames that come while one is in flight wait in the
  outbox and leave together, as one `Batch`, when the completion is read;
- a caller writes its frame itself only when the stream is quiet: the sender says whether
  other calls are in flight on it, and the previous send began at least `burst_gap_s` ago.
  Otherwise (many rpc_async calls in flight) the call's writer thread sends what has queued:
  it gets the GIL only when the callers pause, so one gRPC write carries many frames, and the
  C part of the write runs beside the callers' Python. Written one by one by their callers,
  each frame would cost a whole gRPC write (about 40 us here) on the caller's thread, and
  async throughput fell to a third (bench/rpc.py async_64B_x64);
- the reader only reads: when a send completes with frames waiting, it wakes the writer.
- `next_event` may only be called while an operation is outstanding: cygrpc destroys the
  completion queue with the last one. `_outstanding` counts them; it changes under `_lock`,
  which is also held around every `operate`, so it is never below cygrpc's own count.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

import grpc

logger = logging.getLogger(__name__)

try:
    from grpc._cython import cygrpc
except ImportError:  # a grpcio laid out differently
    cygrpc = None

# SHOAL_RPC_GRPC_CLIENT=public forces grpcio's public client API (to rule this module out).
ENV_CLIENT = "SHOAL_RPC_GRPC_CLIENT"
_NO_FLAGS = 0
_START, _HEADERS, _STATUS, _RECEIVE, _SEND = "start", "headers", "status", "receive", "send"
_STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
_NEEDED = ("SendInitialMetadataOperation", "ReceiveInitialMetadataOperation",
           "ReceiveStatusOnClientOperation", "ReceiveMessageOperation", "SendMessageOperation",
           "PropagationConstants", "StatusCode")
_disabled_reason: Optional[str] = None


def available() -> bool:
    """True when dialed streams use this module (see the module docstring)."""
    if _disabled_reason is not None:
        return False
    choice = os.environ.get(ENV_CLIENT, "direct")
    if choice not in ("direct", "public"):
        raise ValueError(f"{ENV_CLIENT} must be 'direct' or 'public', got {choice!r}.")
    return choice == "direct" and cygrpc is not None and all(
        hasattr(cygrpc, name) for name in _NEEDED)


def disable(reason: str) -> None:
    """Use the public API from now on in this process (this grpcio does not fit)."""
    global _disabled_reason
    if _disabled_reason is None:
        logger.warning("RPC streams fall back to grpcio's public client API (about 50 us "
                       "more per round trip): %s", reason)
    _disabled_reason = reason


class StreamEnded(Exception):
    """The call ended with a non-OK status; str() is 'CODE: details' like grpc.RpcError's."""


class DirectCall:
    """One bidirectional call: `send` from any thread, `next()` from one reader at a time.

    Frames sent before `release()` wait, so that nothing of ours leaves before the server
    proved itself (the transport releases after checking the first frame).

    Args:
        encode(frames): one gRPC message of serialized frames (the stream counts it).
        max_message_bytes: frames leave together up to this size (one frame may exceed it).
        burst_gap_s: a frame sent this soon after the previous send goes to the writer thread.
        name: for the writer thread's name.
    """

    def __init__(self, encode: Callable[[list], bytes], max_message_bytes: int,
                 burst_gap_s: float, name: str = "stream"):
        self._encode = encode
        self._max_bytes = max_message_bytes
        self._burst_gap_s = burst_gap_s
        self._name = name
        self._last_send = 0.0
        self._writer_wake: Optional[threading.Semaphore] = None
        self._lock = threading.Lock()
        self._outbox: list[bytes] = []
        # True while a send is in flight, or before release(): new frames wait in the outbox.
        self._holding = True
        self._released = False
        self._call = None
        self._outstanding = 0
        self._status: Optional[tuple[int, str]] = None
        # Set by abandon(): where frames go instead (the public API's request queue).
        self._sink: Optional[Callable[[bytes], None]] = None

    def start(self, channel: grpc.Channel, method: str, metadata: tuple) -> None:
        """Start the call on `channel` (raises TypeError or AttributeError when this grpcio's
        private layer differs from what this module expects)."""
        operations = (
            ((cygrpc.SendInitialMetadataOperation(metadata, _NO_FLAGS),), _START),
            ((cygrpc.ReceiveInitialMetadataOperation(_NO_FLAGS),), _HEADERS),
            ((cygrpc.ReceiveStatusOnClientOperation(_NO_FLAGS),), _STATUS),
            ((cygrpc.ReceiveMessageOperation(_NO_FLAGS),), _RECEIVE),
        )
        with self._lock:
            self._call = channel._channel.segregated_call(
                cygrpc.PropagationConstants.GRPC_PROPAGATE_DEFAULTS, method.encode(), None,
                None, metadata, None, operations, None, None,
            )
            self._outstanding = len(operations)

    def release(self) -> bool:
        """Let frames out (those already queued leave now); False once the call is over."""
        with self._lock:
            self._released = True
            self._holding = False
            if self._outbox:
                return self._send_outbox()
            return True

    def send(self, frame: bytes, quiet: bool = True) -> bool:
        """Send one serialized frame; False once the call is over. `quiet`: no other call is
        in flight on this stream (the caller may write the frame itself; see above)."""
        with self._lock:
            if self._sink is not None:
                self._sink(frame)
                return True
            self._outbox.append(frame)
            if self._holding:
                return self._status is None
            if quiet and time.monotonic() - self._last_send >= self._burst_gap_s:
                return self._send_outbox()
        self._wake_writer()
        return True

    def _wake_writer(self) -> None:
        if self._writer_wake is None:
            with self._lock:
                if self._writer_wake is None:
                    self._writer_wake = threading.Semaphore(0)
                    threading.Thread(target=self._writer_loop, daemon=True,
                                     name=f"shoal-rpc-write-{self._name}").start()
        self._writer_wake.release()

    def _writer_loop(self) -> None:
        while True:
            self._writer_wake.acquire()
            with self._lock:
                if self._status is not None or self._call is None:
                    return
                if self._outbox and not self._holding:
                    self._send_outbox()

    def _send_outbox(self) -> bool:
        # Under _lock. Takes frames up to the message bound (at least one).
        frames, size = [], 0
        for frame in self._outbox:
            if frames and size + len(frame) > self._max_bytes:
                break
            frames.append(frame)
            size += len(frame)
        del self._outbox[:len(frames)]
        data = self._encode(frames)
        if not self._call.operate((cygrpc.SendMessageOperation(data, _NO_FLAGS),), _SEND):
            return False  # the call is over
        self._outstanding += 1
        self._holding = True
        self._last_send = time.monotonic()
        return True

    def abandon(self, sink: Callable[[bytes], None]) -> None:
        """The call could not start: hand the queued frames, and every later one, to
        `sink`."""
        with self._lock:
            for frame in self._outbox:
                sink(frame)
            self._outbox = []
            self._sink = sink

    def __iter__(self) -> "DirectCall":
        return self

    def __next__(self) -> bytes:
        """The next message from the server; StopIteration when the server ended the call
        with OK, StreamEnded for any other end."""
        while True:
            with self._lock:
                if self._outstanding == 0:
                    raise self._end()
            event = self._call.next_event()
            wake_writer = False
            with self._lock:
                self._outstanding -= 1
                tag = event.tag
                if tag == _RECEIVE:
                    data = event.batch_operations[0].message()
                    if data is not None:
                        if self._call.operate(
                                (cygrpc.ReceiveMessageOperation(_NO_FLAGS),), _RECEIVE):
                            self._outstanding += 1
                        return data
                elif tag == _SEND:
                    self._holding = not self._released
                    wake_writer = bool(event.success and self._outbox and not self._holding)
                elif tag == _STATUS:
                    operation = event.batch_operations[0]
                    self._status = (operation.code(), operation.details() or "")
                    wake_writer = self._writer_wake is not None  # it sees the status and exits
            if wake_writer:
                self._wake_writer()

    def _end(self) -> BaseException:
        code, details = self._status if self._status is not None else (None, "")
        if code == 0:
            return StopIteration()
        name = _STATUS_NAMES.get(code, f"status {code}").upper()
        return StreamEnded(f"{name}: {details}")

    def cancel(self) -> None:
        """End the call (any thread); the reader then sees it end."""
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel(cygrpc.StatusCode.cancelled, "Cancelled by this worker")
