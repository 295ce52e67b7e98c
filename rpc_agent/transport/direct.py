"""Both ends of the RPC stream driven through grpcio's Cython layer instead of its
thread-based API.

Why: grpcio's public API puts threads of its own between the socket and the code that reads
or writes, and each hand-off is a thread wake-up (about 30 us on this kind of machine, more
when the two threads sit on different CPUs):
- client: a frame goes to the thread that iterates the request generator, which starts the
  write and then sleeps until the channel's spin thread reports it done; a reply is seen by
  that spin thread, which wakes the reader;
- server: a message is seen by the server's polling thread, which wakes the handler's
  reader; a reply's write blocks its sender until the polling thread reports it done.
Here a quiet caller starts the write itself, and each stream's reader waits on a completion
queue that belongs to its call alone (a client call from `Channel.segregated_call`, a server
call requested onto a queue of its own), seeing both its messages and its writes' ends with
nobody in between. rpc_sync of 64 bytes went from about 0.33 ms to 0.25 ms (bench/rpc.py).

What is used from `grpc._cython.cygrpc`: `Channel.segregated_call` (grpcio's single-threaded
unary-stream calls are built on it) and `SegregatedCall.operate/next_event/cancel`;
`Server`, `CompletionQueue`, `request_call` and `Call.start_server_batch/cancel/peer` (the
accepting server, transport/direct_server.py); the operation classes. They are private to
grpcio, so `available()` checks for them, and the transport uses the public API when they are
missing, when a client call cannot be made with them, or when SHOAL_RPC_GRPC=public.

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
- when a send completes with frames waiting, the reader that saw it sends them at once (as one
  message): waking the writer for them cost a thread switch on the path of a frame sent just
  behind another;
- a completion queue is polled only while an operation on it is outstanding (cygrpc
  destroys a segregated call's queue with its last one; a server call's queue, once dropped,
  is pumped to its end with the GIL held). `_outstanding` counts them; it changes under
  `_lock`, which is also held around every operation started, so it is never below gRPC's
  own count.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional

import grpc

from shoal.core.config import SettingError
from shoal.rpc_agent import settings
from shoal.rpc_agent._threads import BurstWriter

if TYPE_CHECKING:
    from shoal.rpc_agent.transport.direct_server import Accepted

logger = logging.getLogger(__name__)

try:
    from grpc._cython import cygrpc
except ImportError:  # a grpcio laid out differently
    cygrpc = None

# Its variable set to public forces grpcio's public API at both ends (to rule this module out).
ENV_LAYER = settings.GRPC_LAYER.name
NO_FLAGS = 0
# Tags of a call's batches (a status sent or received is tagged STATUS at both ends).
_START, _HEADERS, STATUS, _RECEIVE, _SEND, _CLOSE = (
    "start", "headers", "status", "receive", "send", "close")
CALL_OK = 0  # grpc_call_error GRPC_CALL_OK
_STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
_NEEDED = ("SendInitialMetadataOperation", "ReceiveInitialMetadataOperation",
           "ReceiveStatusOnClientOperation", "ReceiveMessageOperation", "SendMessageOperation",
           "ReceiveCloseOnServerOperation", "SendStatusFromServerOperation",
           "PropagationConstants", "StatusCode", "CompletionType", "CompletionQueue", "Server")
_disabled_reason: Optional[str] = None


def available() -> bool:
    """True when streams use this module (see the module docstring)."""
    if _disabled_reason is not None:
        return False
    setting = settings.GRPC_LAYER
    try:
        choice = setting.get()
    except SettingError as exc:
        raise SettingError(f"{setting.name} must be 'direct' or 'public', got "
                           f"{setting.raw()!r}.") from exc
    return choice == "direct" and cygrpc is not None and all(
        hasattr(cygrpc, name) for name in _NEEDED)


# What using cygrpc raises where this grpcio's private layer differs from what is used here.
PRIVATE_LAYER_ERRORS = (TypeError, AttributeError)


def disable(exc: BaseException) -> None:
    """Use the public API from now on in this process: this grpcio does not fit (`exc`, one of
    PRIVATE_LAYER_ERRORS, says how)."""
    global _disabled_reason
    reason = f"{type(exc).__name__}: {exc}"
    if _disabled_reason is None:
        logger.warning("New RPC streams fall back to grpcio's public API (about 80 us more "
                       "per round trip): %s", reason)
    _disabled_reason = reason


class StreamEnded(Exception):
    """The call ended with a non-OK status; str() is 'CODE: details' like grpc.RpcError's."""


class Pump:
    """What both ends of a stream share: `send` from any thread, `next()` from one reader at a
    time, one send in flight, an outbox, a writer thread for bursts, and `_outstanding`.

    Frames sent before `release()` wait, so that nothing of ours leaves before the peer proved
    itself (the client releases after checking the server's first frame; the server sends its
    proof first and then releases).

    Args:
        encode(frames): one gRPC message of serialized frames (the stream counts it).
        max_message_bytes: frames leave together up to this size (one frame may exceed it).
        burst_gap_s: a frame sent this soon after the previous send goes to the writer thread.
        name: for the writer thread's name.
    """

    def __init__(self, encode: Callable[[list], bytes], max_message_bytes: int,
                 burst_gap_s: float, name: str):
        self._encode = encode
        self._max_bytes = max_message_bytes
        self._burst_gap_s = burst_gap_s
        self._last_send = 0.0
        self._writer = BurstWriter(self._write_burst, f"shoal-rpc-write-{name}")
        self._lock = threading.Lock()
        self._outbox: list[bytes] = []
        # True while a send is in flight, or before release(): new frames wait in the outbox.
        self._holding = True
        self._released = False
        self._outstanding = 0
        # True between a message handed to the reader and the reader asking for the next one:
        # the next receive is started then (see `_next_message`).
        self._receive_due = False
        # Set once the call is known to be over (then the writer exits).
        self._over = False
        # Held by the one thread polling (a reader, or drain()): two pollers could both see
        # one operation outstanding and the second would poll a queue with nothing to come.
        self._poll_lock = threading.Lock()

    # -- what each end defines

    def _operate(self, operations: tuple, tag: str) -> bool:
        """Start one batch (under _lock); False when the call is over."""
        raise NotImplementedError

    def _next_event(self):
        """Block for the call's next completion (the reader, without _lock)."""
        raise NotImplementedError

    def _send_operations(self, data: bytes) -> tuple:
        return (cygrpc.SendMessageOperation(data, NO_FLAGS),)

    def _on_event(self, tag: str, event) -> None:
        """An event other than a receive or a send (under _lock)."""

    def _on_end_of_messages(self) -> None:
        """The peer sent its last message (under _lock)."""

    def _on_send_done(self) -> None:
        """A send completed (under _lock)."""

    def _end(self) -> BaseException:
        """What next() raises once nothing is outstanding."""
        raise NotImplementedError

    # -- sending

    def release(self) -> bool:
        """Let frames out (those already queued leave now); False once the call is over."""
        with self._lock:
            self._released = True
            self._holding = False
            if self._outbox:
                return self._send_outbox()
            return not self._over

    def send(self, frame: bytes, quiet: bool = True) -> bool:
        """Send one serialized frame; False once the call is over. `quiet`: no other call is
        in flight on this stream (the caller may write the frame itself; see above)."""
        with self._lock:
            if not self._accept_frame(frame):
                return True
            if self._holding:
                return not self._over
            if quiet and time.monotonic() - self._last_send >= self._burst_gap_s:
                return self._send_outbox()
        self._writer.wake()
        return True

    def _accept_frame(self, frame: bytes) -> bool:
        # Under _lock: queue the frame; False if it went elsewhere (see DirectCall.abandon).
        self._outbox.append(frame)
        return True

    def waiting(self) -> bool:
        """True when frames wait in the outbox for a send in flight to complete (only a
        reader sees that completion)."""
        return bool(self._outbox) and self._holding and self._released

    def _close(self) -> None:
        """The call is over for sending: the writer thread exits, sends return False."""
        with self._lock:
            self._over = True
        self._writer.wake_if_started()

    def drain(self) -> None:
        """Cancel the call and read it to its end (any thread; waits for a reader that polls).

        A call that nobody reads to its end keeps its gRPC call, and its completion queue,
        alive; a server call's queue, once dropped, would be pumped with the GIL held forever.
        """
        self.cancel()
        while True:
            try:
                next(self)
            except (StopIteration, StreamEnded):
                return

    def _write_burst(self) -> bool:
        """The writer thread's turn: send what waits, unless a send is in flight (its
        completion wakes the writer again); False once the call is over."""
        with self._lock:
            if self._over:
                return False
            if self._outbox and not self._holding:
                self._send_outbox()
            return True

    def _send_outbox(self) -> bool:
        # Under _lock. Takes frames up to the message bound (at least one).
        frames, size = [], 0
        for frame in self._outbox:
            if frames and size + len(frame) > self._max_bytes:
                break
            frames.append(frame)
            size += len(frame)
        del self._outbox[:len(frames)]
        if not self._operate(self._send_operations(self._encode(frames)), _SEND):
            return False  # the call is over
        self._outstanding += 1
        self._holding = True
        self._last_send = time.monotonic()
        return True

    # -- reading

    def __iter__(self) -> "Pump":
        return self

    def __next__(self) -> bytes:
        """The next message from the peer; StopIteration or StreamEnded once the call is over
        (see each end's `_end`)."""
        with self._poll_lock:
            return self._next_message()

    def _next_message(self) -> bytes:
        while True:
            with self._lock:
                if self._receive_due:
                    # Started here, when the reader (or the reader after it) asks for the next
                    # message, rather than as the last one arrived: what the reader does with a
                    # message (an inline call's reply, a caller woken) goes first; a message
                    # that comes meanwhile waits in gRPC as it would for the busy reader.
                    self._receive_due = False
                    if self._operate((cygrpc.ReceiveMessageOperation(NO_FLAGS),), _RECEIVE):
                        self._outstanding += 1
                if self._outstanding == 0:
                    self._over = True
                    raise self._end()
            event = self._next_event()
            wake_writer = False
            with self._lock:
                self._outstanding -= 1
                tag = event.tag
                if tag == _RECEIVE:
                    data = event.batch_operations[0].message() if event.success else None
                    if data is not None:
                        self._receive_due = True
                        return data
                    self._on_end_of_messages()
                elif tag == _SEND:
                    self._holding = not self._released
                    if event.success and self._outbox and not self._holding:
                        # What queued during the send leaves now, as one message, from this
                        # thread: waking the writer for it cost a thread switch on the path
                        # of a call sent right after another (remote() then to_here()).
                        self._send_outbox()
                    self._on_send_done()
                else:
                    self._on_event(tag, event)
                    if self._over:
                        wake_writer = self._writer.started  # it sees _over and exits
            if wake_writer:
                self._writer.wake()


class DirectCall(Pump):
    """The dialing end: a call started on a channel with its own completion queue."""

    def __init__(self, encode: Callable[[list], bytes], max_message_bytes: int,
                 burst_gap_s: float, name: str = "stream"):
        super().__init__(encode, max_message_bytes, burst_gap_s, name)
        self._call = None
        self._status: Optional[tuple[int, str]] = None
        # Set by abandon(): where frames go instead (the public API's request queue).
        self._sink: Optional[Callable[[bytes], None]] = None

    def start(self, channel: grpc.Channel, method: str, metadata: tuple) -> None:
        """Start the call on `channel` (raises TypeError or AttributeError when this grpcio's
        private layer differs from what this module expects)."""
        operations = (
            ((cygrpc.SendInitialMetadataOperation(metadata, NO_FLAGS),), _START),
            ((cygrpc.ReceiveInitialMetadataOperation(NO_FLAGS),), _HEADERS),
            ((cygrpc.ReceiveStatusOnClientOperation(NO_FLAGS),), STATUS),
            ((cygrpc.ReceiveMessageOperation(NO_FLAGS),), _RECEIVE),
        )
        with self._lock:
            # grpcio's Cython channel, behind its public one: what this module drives.
            self._call = channel._channel.segregated_call(  # noqa: SLF001  (see above)
                cygrpc.PropagationConstants.GRPC_PROPAGATE_DEFAULTS, method.encode(), None,
                None, metadata, None, operations, None, None,
            )
            self._outstanding = len(operations)

    def abandon(self, sink: Callable[[bytes], None]) -> None:
        """The call could not start: hand the queued frames, and every later one, to
        `sink`."""
        with self._lock:
            for frame in self._outbox:
                sink(frame)
            self._outbox = []
            self._sink = sink

    def _accept_frame(self, frame: bytes) -> bool:
        if self._sink is not None:
            self._sink(frame)
            return False
        self._outbox.append(frame)
        return True

    def _operate(self, operations: tuple, tag: str) -> bool:
        return self._call.operate(operations, tag)

    def _next_event(self):
        return self._call.next_event()

    def _on_event(self, tag: str, event) -> None:
        if tag == STATUS:
            operation = event.batch_operations[0]
            self._status = (operation.code(), operation.details() or "")
            self._over = True

    def _end(self) -> BaseException:
        code, details = self._status if self._status is not None else (None, "")
        if code == 0:
            return StopIteration()
        return StreamEnded(f"{_status_name(code)}: {details}")

    def cancel(self) -> None:
        """End the call (any thread); the reader then sees it end."""
        with self._lock:
            call = self._call
        self._close()
        if call is not None:
            call.cancel(cygrpc.StatusCode.cancelled, "Cancelled by this worker")


class ServerCall(Pump):
    """The accepting end: a call `direct_server.StreamServer` accepted onto its own completion
    queue, which
    only this call's reader polls (no server thread in between, and replies never wait for
    their write to complete)."""

    def __init__(self, accepted: "Accepted", encode: Callable[[list], bytes],
                 max_message_bytes: int, burst_gap_s: float, name: str = "stream"):
        super().__init__(encode, max_message_bytes, burst_gap_s, name)
        self._call = accepted.call
        self._queue = accepted.queue
        self._metadata_sent = False
        self._status_sent = False
        self._half_closed = False
        self._cancelled = False
        with self._lock:
            for operation, tag in ((cygrpc.ReceiveCloseOnServerOperation(NO_FLAGS), _CLOSE),
                                   (cygrpc.ReceiveMessageOperation(NO_FLAGS), _RECEIVE)):
                if self._operate((operation,), tag):
                    self._outstanding += 1

    def _operate(self, operations: tuple, tag: str) -> bool:
        return self._call.start_server_batch(operations, tag) == CALL_OK

    def _next_event(self):
        return self._queue.poll()

    def _send_operations(self, data: bytes) -> tuple:
        if self._metadata_sent:
            return (cygrpc.SendMessageOperation(data, NO_FLAGS),)
        self._metadata_sent = True  # gRPC sends the response headers with the first message
        return (cygrpc.SendInitialMetadataOperation(None, NO_FLAGS),
                cygrpc.SendMessageOperation(data, NO_FLAGS))

    def _on_event(self, tag: str, event) -> None:
        if tag == _CLOSE:
            self._cancelled = bool(event.batch_operations[0].cancelled())
            self._over = True
        # STATUS: the status left; nothing to do.

    def _on_end_of_messages(self) -> None:
        # The client half-closed: answer with OK so that the call can finish, once what was
        # queued has left (a status ends the stream: frames behind it would be lost).
        self._half_closed = True
        self._finish_when_sent()

    def _on_send_done(self) -> None:
        self._finish_when_sent()

    def _finish_when_sent(self) -> None:
        if self._half_closed and not self._outbox and not self._holding:
            self._finish(cygrpc.StatusCode.ok, b"")

    def _finish(self, code, details: bytes) -> None:
        if self._status_sent:
            return
        self._status_sent = True
        operations = (cygrpc.SendStatusFromServerOperation(None, code, details, NO_FLAGS),)
        if not self._metadata_sent:
            self._metadata_sent = True
            operations = (cygrpc.SendInitialMetadataOperation(None, NO_FLAGS),) + operations
        if self._operate(operations, STATUS):
            self._outstanding += 1

    def _end(self) -> BaseException:
        if self._cancelled:
            return StreamEnded("CANCELLED: the peer cancelled the RPC or went away")
        return StopIteration()

    def cancel(self) -> None:
        """End the call (any thread); the reader then sees it end."""
        self._close()
        self._call.cancel()


def _status_name(code: int) -> str:
    return _STATUS_NAMES.get(code, f"STATUS {code}")
