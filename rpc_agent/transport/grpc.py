"""The control transport: one persistent bidirectional gRPC stream per pair of workers.

grpcio's thread-based API is used, not grpc.aio: measured here, a round trip through aio from
another thread costs about 150 us of CPU against about 90 us for the thread-based API, because
every hand-off into an asyncio loop adds a self-pipe wake-up and several loop iterations.

Both ends of a stream go through grpcio's Cython layer by default (rpc_agent/_grpc_direct.py:
a `DirectCall` on a dialed stream, a `ServerCall` from the `StreamServer` on an accepted one),
with no grpcio thread between the socket and the stream's reader. A caller alone on the stream
writes its frame itself; frames that come during a write or in a burst leave together as one
gRPC message (a `Batch`), so that under load one gRPC write, which costs far more CPU than a
frame, carries many calls. Receiving: one reader thread per stream parses each Batch and hands
its frames to the agent.

Where that private layer does not fit (or SHOAL_RPC_GRPC=public), grpcio's public API serves:
a dialed stream's frames go on the stream's queue, which the one thread gRPC runs to send the
stream's requests drains into coalesced messages; an accepted stream writes through grpcio's
non-blocking handler form, from the thread with the frame when the stream is idle and by the
stream's writer thread during a write or a burst.

Authentication comes before anything is read: a client sends a signed `Hello` as metadata of
the call (timestamped, with a nonce the server remembers, bound to the target worker), the
server checks it before reading a single message, and answers with its own proof over the
client's nonce as the first frame, which the client checks before reading any other frame and
before it sends any of its own.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import struct
import threading
import time
from concurrent import futures
from typing import Callable, Iterator, Optional

# gRPC's C core reads these once, when it first starts (a first channel or server), so they are
# set before this module makes either; a value the user set wins. Both cut thread hand-offs in
# the core, measured with a bare 64-byte ping-pong between two processes and in the agent
# (see bench/rpc.py):
# - EventEngine client/listener off: the EventEngine does socket I/O on its own threads and
#   posts results to the completion queue a Python thread polls, one more hand-off per message
#   per side; the older iomgr path does the I/O on the polling thread itself.
# - the `poll` strategy: under iomgr's default `epoll1` every completion queue of the process
#   shares one epoll set, so the agent's idle server thread wakes for its client streams'
#   messages and passes them on; with `poll` each queue polls only its own connections.
GRPC_ENVIRONMENT = {
    "GRPC_EXPERIMENTS": "-event_engine_client,-event_engine_listener",
    "GRPC_POLL_STRATEGY": "poll",
}
for _name, _value in GRPC_ENVIRONMENT.items():
    os.environ.setdefault(_name, _value)

import grpc  # noqa: E402

from shoal.core import auth
from shoal.rpc_agent.transport import direct as _grpc_direct
from shoal.rpc_agent import metrics
from shoal.rpc_agent._generated import rpc_pb2
from shoal.rpc_agent._threads import (
    mark_io_thread,
    set_blocking_hook,
    unmark_io_thread as _unmark_io_thread,
)
from shoal.rpc_agent.api import (
    AUTH_WINDOW_S,
    CONNECT_TIMEOUT_S,
    MAX_GRPC_MESSAGE_BYTES,
    RpcError,
    RpcPeerLost,
)

logger = logging.getLogger(__name__)

SERVICE = "shoal.rpc.Agent"
METHOD = f"/{SERVICE}/Stream"
HELLO_METADATA = "shoal-hello-bin"
PURPOSE_CLIENT = "rpc-stream"
PURPOSE_SERVER = "rpc-stream-server"
# A writer stops adding frames to one gRPC message past this size; the rest go in the next.
MAX_BATCH_BYTES = 8 * 1024 * 1024
# A frame sent this soon after the previous write ended is taken for part of a burst.
# Sync calls and their replies are a round trip (100 us or more) apart.
_BURST_GAP_S = 50e-6
# A reader running an incoming call itself hands reading on once the call has run this long
# (at once if the call waits on a Future); the watch checks twice as often.
_INLINE_HANDOVER_S = 0.005
# The watch stops ticking after this long without an inline call, until the next one.
_WATCH_IDLE_S = 1.0
_STOP = object()

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
    # A silent peer (a partitioned host, a SIGSTOPped process) shows up within ~15 s.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
    # Reconnect to a restarted peer quickly instead of grpc's default minute-long backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    # One channel per stream: never share a TCP connection with another agent in the process.
    ("grpc.use_local_subchannel_pool", 1),
]
_SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]


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


def _hello_signing_bytes(hello: rpc_pb2.Hello) -> bytes:
    # A fixed layout rather than the protobuf encoding, which is not guaranteed canonical.
    return (
        hello.name.encode() + b"\0"
        + struct.pack("!iid", hello.id, hello.to_id, hello.timestamp)
        + hello.nonce
    )


def _server_proof(token: bytes, server_id: int, nonce: bytes) -> bytes:
    return auth.sign(token, PURPOSE_SERVER, struct.pack("!i", server_id) + nonce)


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
        # `_messages`; accepted ones write through grpcio's non-blocking server callback:
        # `_write(data)` sends one message from the calling thread and returns once gRPC took
        # it (False once the RPC is over). See `send`.
        self._write: Optional[Callable[[bytes], bool]] = None
        self._outbox: list[bytes] = []
        self._writing = False
        self._writer_wake: Optional[threading.Semaphore] = None
        self._last_write = 0.0
        # Where grpcio's private layer fits: a dialed stream's DirectCall (frames wait in it
        # until the server's proof checked out), or the ServerCall the transport attaches to
        # an accepted stream.
        self._direct: Optional[_grpc_direct.Pump] = (
            _grpc_direct.DirectCall(self._count, MAX_BATCH_BYTES, _BURST_GAP_S, peer_name)
            if outgoing and _grpc_direct.available() else None
        )
        self._cancel: Optional[Callable[[], None]] = None
        self._readers = _Readers()
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

    def send(self, frame: bytes) -> None:
        """Queue one serialized Frame.

        Raises:
            RpcPeerLost: the stream is dead (the agent reconnects on the next call).
        """
        if self.state == Stream.DEAD:
            raise RpcPeerLost(f"The RPC stream to {self.describe()} is down ({self.dead_reason}).")
        if self._direct is not None:
            # A caller alone on the stream starts the gRPC write itself (see DirectCall).
            if not self._direct.send(frame, quiet=len(self.pending_ids) <= 1):
                self.fail("the RPC ended while writing to it")
            elif self._direct.waiting() and self._readers.inline_since is not None:
                # Only a reader sees the write in flight end, and ours runs a call: let
                # another thread read now rather than after the call (or _INLINE_HANDOVER_S).
                self._readers.hand_on()
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
            burst = time.monotonic() - self._last_write < _BURST_GAP_S
        if burst or self._write_outbox():
            self._start_writer()

    def _write_outbox(self) -> bool:
        """Write what the outbox holds (the caller is the stream's one writer); True when more
        frames arrived meanwhile (the writer role is still held), False when it was released."""
        with self._lock:
            frames, self._outbox = self._outbox, []
        if len(frames) == 1:  # a lone frame (a reply): one message, no batching generator
            batches = (self._count(frames),)
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

    def _start_writer(self) -> None:
        if self._writer_wake is None:
            self._writer_wake = threading.Semaphore(0)
            threading.Thread(target=self._writer_loop, daemon=True,
                             name=f"shoal-rpc-write-{self.peer_name}").start()
        self._writer_wake.release()

    def _writer_loop(self) -> None:
        while True:
            self._writer_wake.acquire()
            if self.state == Stream.DEAD:
                return
            while self._write_outbox():
                pass

    def _batches(self, frames: list[bytes]) -> Iterator[bytes]:
        """Coalesced gRPC messages of `frames`, each up to MAX_BATCH_BYTES (counted as sent)."""
        start, size = 0, 0
        for i, frame in enumerate(frames):
            if i > start and size + len(frame) > MAX_BATCH_BYTES:
                yield self._count(frames[start:i])
                start, size = i, 0
            size += len(frame)
        if start < len(frames):
            yield self._count(frames[start:])

    def _count(self, frames: list[bytes]) -> bytes:
        if len(frames) == 1:
            frame = frames[0]
            data = b"\x0a" + _varint(len(frame)) + frame
        else:
            data = encode_batch(frames)
        metrics.BYTES_SENT.inc(len(data))
        self.frames_sent += len(frames)
        self.messages_sent += 1
        return data

    def _messages(self) -> Iterator[bytes]:
        """What gRPC's sending thread iterates on a dialed stream: coalesced batches until the
        stream ends."""
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
            data = (encode_batch(frames) if len(frames) > 1
                    else b"\x0a" + _varint(size) + frames[0])
            metrics.BYTES_SENT.inc(len(data))
            self.frames_sent += len(frames)
            self.messages_sent += 1
            yield data
            if stop or self.state == Stream.DEAD:
                return

    def _open(self, cancel: Callable[[], None]) -> bool:
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
        if self._writer_wake is not None:
            self._writer_wake.release()
        if cancel is not None:
            try:
                cancel()
            except Exception:  # noqa: BLE001
                logger.debug("Cancelling the stream to %s failed", self.describe(), exc_info=True)
        if self.on_dead is not None:
            self.on_dead(self)
        return True


class GrpcTransport:
    """The agent's gRPC server and client streams.

    Args:
        name, worker_id: this worker.
        token: the job's secret.
        host: the address to bind.
        max_streams: the most streams the server holds at once (one thread each).
        on_frames(stream, frames): called on the stream's reader with each Batch's frames; may
            return one task (an incoming call) for the reader to run after handing reading on.
        on_stream_open(stream): an incoming stream passed authentication.
        on_stream_dead(stream): a stream died (`stream.dead_reason` says why).
        peer_name(id): the registered name of worker `id`, or None if unknown.
        submit(task): runs a task on the agent's pool (when no second reader is free).
    """

    def __init__(self, *, name: str, worker_id: int, token: bytes, host: str, max_streams: int,
                 on_frames: Callable, on_stream_open: Callable, on_stream_dead: Callable,
                 peer_name: Callable[[int], Optional[str]], submit: Callable):
        self.name = name
        self.worker_id = worker_id
        self._token = token
        self._host = host
        self._on_frames = on_frames
        self._on_stream_open = on_stream_open
        self._on_stream_dead = on_stream_dead
        self._peer_name = peer_name
        self._submit = submit
        self._lock = threading.Lock()
        self._seen_nonces: dict[bytes, float] = {}
        self._channels: list[grpc.Channel] = []
        self._max_accepted = max_streams + 4
        self._accepted = 0
        self._executor: Optional[futures.ThreadPoolExecutor] = None
        # True while _server is a _grpc_direct.StreamServer (else grpcio's grpc.Server).
        self._serves_direct = False
        self._server = None
        if _grpc_direct.available():
            try:
                # Accepted calls go straight to their stream's reader (see _grpc_direct).
                self._server = _grpc_direct.StreamServer(
                    host, _SERVER_OPTIONS, METHOD, self._accept, name)
                self._serves_direct = True
            except _grpc_direct.PRIVATE_LAYER_ERRORS as exc:
                _grpc_direct.disable(exc)
        if self._server is None:
            self._server = self._public_server()
        self.port: Optional[int] = None
        self._stopped = False
        self._watch = _InlineWatch(name)

    def _public_server(self) -> grpc.Server:
        """grpcio's own server: a handler thread per stream, replies through its callback."""
        self._serves_direct = False
        self._executor = futures.ThreadPoolExecutor(
            max_workers=self._max_accepted, thread_name_prefix=f"shoal-rpc-grpc-{self.name}"
        )
        return grpc.server(
            self._executor,
            handlers=[grpc.method_handlers_generic_handler(
                SERVICE, {"Stream": grpc.stream_stream_rpc_method_handler(_NonBlocking(self))}
            )],
            options=_SERVER_OPTIONS,
            maximum_concurrent_rpcs=self._max_accepted,
        )

    def start(self) -> int:
        """Bind and start the server; return the port."""
        port = 0
        if self._serves_direct:
            try:
                port = self._server.start()
            except _grpc_direct.PRIVATE_LAYER_ERRORS as exc:
                _grpc_direct.disable(exc)
                self._server = self._public_server()
        if not self._serves_direct:
            port = self._server.add_insecure_port(f"{self._host}:0")
            if port:
                self._server.start()
        if not port:
            raise RpcError(f"Worker {self.name!r} could not bind its RPC port on {self._host}.")
        self.port = port
        return port

    def close_channels(self) -> None:
        """Cancel the streams this worker opened (its peers' servers then see them end)."""
        with self._lock:
            self._stopped = True
            channels, self._channels = self._channels, []
        for channel in channels:
            channel.close()

    def stop(self) -> None:
        """Cancel every stream and stop the server."""
        self.close_channels()
        self._watch.stop()
        if self._serves_direct:
            self._server.stop(5.0)
        else:
            self._server.stop(grace=None).wait(5.0)
            self._executor.shutdown(wait=False, cancel_futures=True)

    # -- client side

    def connect(self, peer_id: int, peer_name: str, address: str) -> Stream:
        """A new outgoing stream to `address`; it connects in the background (frames queue)."""
        stream = Stream(peer_id, peer_name, outgoing=True)
        stream.on_dead = self._on_stream_dead
        threading.Thread(
            target=self._dial, args=(stream, address), daemon=True,
            name=f"shoal-rpc-read-{self.name}-{peer_name}",
        ).start()
        return stream

    def _dial(self, stream: Stream, address: str) -> None:
        mark_io_thread()
        nonce = secrets.token_bytes(32)
        hello = rpc_pb2.Hello(
            name=self.name, id=self.worker_id, to_id=stream.peer_id,
            timestamp=time.time(), nonce=nonce,
        )
        hello.proof = auth.sign(self._token, PURPOSE_CLIENT, _hello_signing_bytes(hello))
        with self._lock:
            if self._stopped:
                stream.fail("the agent is shutting down")
                return
            channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
            self._channels.append(channel)
        call = None
        try:
            call = self._start_call(stream, channel, ((HELLO_METADATA, hello.SerializeToString()),))
            # The proof must come first and soon; a watchdog cancels a silent server.
            timer = threading.Timer(CONNECT_TIMEOUT_S, call.cancel)
            timer.daemon = True
            timer.start()
            try:
                first = next(call)
            finally:
                timer.cancel()
            batch = rpc_pb2.Batch.FromString(first)
            if (
                len(batch.frames) != 1
                or batch.frames[0].kind != rpc_pb2.HELLO
                or not auth.verify(
                    self._token, PURPOSE_SERVER, struct.pack("!i", stream.peer_id) + nonce,
                    bytes(batch.frames[0].payload),
                )
            ):
                raise RpcError("its first frame is not a valid proof of this job's secret")
        except Exception as exc:  # noqa: BLE001  (any failure is this stream's death)
            if call is not None:
                _end_call(call)
            stream.fail(f"connecting to {address} failed: {_describe(exc)}")
            channel.close()
            return
        def cancel() -> None:
            call.cancel()
            channel.close()

        if not stream._open(cancel):
            _end_call(call)
            channel.close()
            return
        if stream._direct is not None and not stream._direct.release():
            stream.fail("the RPC ended as it opened")
        self._read_loop(stream, call)

    @staticmethod
    def _start_call(stream: Stream, channel: grpc.Channel, metadata: tuple):
        """The stream's call, started: a DirectCall where it fits, else grpcio's public
        bidirectional call fed by `stream._messages()`; either is iterated for messages."""
        direct = stream._direct
        if direct is not None:
            try:
                direct.start(channel, METHOD, metadata)
                return direct
            except _grpc_direct.PRIVATE_LAYER_ERRORS as exc:
                _grpc_direct.disable(exc)
                direct.abandon(stream._queue.put)
        return channel.stream_stream(METHOD)(stream._messages(), metadata=metadata)

    # -- server side

    def _accept(self, accepted: "_grpc_direct.Accepted") -> None:
        """A call StreamServer accepted (on its accept thread): check the hello before
        reading anything, prove ourselves first, then read on a thread of the stream's own."""
        hello, reason = self._check_hello(accepted.metadata)
        if hello is None:
            self._log_rejected(accepted.peer, reason)
            self._server.reject(accepted, "unauthenticated", reason)
            return
        with self._lock:
            full = self._accepted >= self._max_accepted
            if not full:
                self._accepted += 1
        if full:
            logger.warning("Worker %r refused an RPC stream from %s: it already serves %d.",
                           self.name, accepted.peer, self._max_accepted)
            self._server.reject(accepted, "resource_exhausted", "too many RPC streams")
            return
        stream = Stream(hello.id, hello.name, outgoing=False)
        stream.on_dead = self._on_stream_dead
        proof = _server_proof(self._token, self.worker_id, hello.nonce)
        call = _grpc_direct.ServerCall(accepted, stream._count, MAX_BATCH_BYTES, _BURST_GAP_S,
                                       hello.name)
        # From here on the call has operations outstanding: whatever happens, it is read to
        # its end (a server call's queue dropped with operations outstanding hangs the
        # process), so nothing may escape to the accept loop.
        try:
            stream._direct = call
            call.send(rpc_pb2.Frame(kind=rpc_pb2.HELLO, payload=proof).SerializeToString())
            if not call.release():
                raise RpcError("the stream ended before the proof left")
            stream._open(call.cancel)
            self._on_stream_open(stream)
            threading.Thread(
                target=self._read_accepted, args=(stream, call), daemon=True,
                name=f"shoal-rpc-read-{self.name}-{hello.name}",
            ).start()
        except BaseException as exc:  # noqa: BLE001
            logger.warning("Worker %r could not take the RPC stream from %s: %s",
                           self.name, stream.describe(), _describe(exc))
            stream.fail(f"accepting it failed: {_describe(exc)}")
            call.drain()
            with self._lock:
                self._accepted -= 1

    def _read_accepted(self, stream: Stream, call: "_grpc_direct.ServerCall") -> None:
        try:
            self._read_loop(stream, call)
        finally:
            with self._lock:
                self._accepted -= 1

    def _log_rejected(self, peer: str, reason: str) -> None:
        metrics.REJECTED_STREAM.inc()
        logger.warning(
            "Worker %r dropped an RPC stream from %s: %s. Nothing it sent was read.",
            self.name, peer, reason,
        )

    def _serve_stream(self, request_iterator, context, send_response) -> None:
        hello, reason = self._check_hello(context.invocation_metadata())
        if hello is None:
            self._log_rejected(context.peer(), reason)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        stream = Stream(hello.id, hello.name, outgoing=False)
        stream.on_dead = self._on_stream_dead
        proof = _server_proof(self._token, self.worker_id, hello.nonce)

        def write(data: bytes) -> bool:
            send_response(data)  # returns once gRPC took the message (or the RPC ended)
            return context.is_active()

        # The proof goes first, before the stream is open for anyone else's frames.
        if not write(encode_batch(
            [rpc_pb2.Frame(kind=rpc_pb2.HELLO, payload=proof).SerializeToString()]
        )):
            return
        stream._write = write
        stream._open(context.cancel)
        context.add_callback(lambda: stream.fail("the RPC ended"))
        self._on_stream_open(stream)
        threading.Thread(
            target=self._serve_reads, args=(stream, request_iterator), daemon=True,
            name=f"shoal-rpc-read-{self.name}-{hello.name}",
        ).start()

    def _serve_reads(self, stream: Stream, request_iterator) -> None:
        self._read_loop(stream, request_iterator)

    def _check_hello(self, metadata) -> tuple[Optional[rpc_pb2.Hello], str]:
        raw = None
        for key, value in metadata or ():
            if key == HELLO_METADATA:
                raw = value
        if raw is None:
            return None, f"it carried no {HELLO_METADATA} proof"
        try:
            hello = rpc_pb2.Hello.FromString(raw)
        except Exception:  # noqa: BLE001  (garbage in the metadata)
            return None, "its hello metadata is not a Hello message"
        if not auth.verify(self._token, PURPOSE_CLIENT, _hello_signing_bytes(hello), hello.proof):
            return None, "its proof does not match this job's secret"
        if hello.to_id != self.worker_id:
            return None, (
                f"its proof is for worker id {hello.to_id}, not this one ({self.worker_id})"
            )
        now = time.time()
        # Written so that NaN fails: every comparison with NaN is False, and a NaN timestamp
        # must not slip past the window and make its nonce replayable forever.
        if not abs(now - hello.timestamp) <= AUTH_WINDOW_S:
            return None, (
                f"its proof is {now - hello.timestamp:+.0f}s old, outside the "
                f"{AUTH_WINDOW_S:g}s window"
            )
        with self._lock:
            for nonce, seen_at in list(self._seen_nonces.items()):
                if now - seen_at > 2 * AUTH_WINDOW_S:
                    del self._seen_nonces[nonce]
            if len(hello.nonce) != 32 or hello.nonce in self._seen_nonces:
                return None, "its proof replays a nonce already used"
            self._seen_nonces[hello.nonce] = now
        expected = self._peer_name(hello.id)
        if expected is None or expected != hello.name:
            return None, (
                f"it claims to be worker {hello.name!r} (id {hello.id}), which this job "
                "does not have"
            )
        return hello, ""

    # -- both sides

    def _read_loop(self, stream: Stream, messages) -> None:
        """Read the stream as its leader; see `_Readers` for how leadership moves."""
        mark_io_thread()
        readers = stream._readers
        self._watch.watch(readers)
        while True:
            try:
                data = next(messages)
            except StopIteration:
                stream.fail("the peer closed it")
                break
            except Exception as exc:  # noqa: BLE001
                stream.fail(_describe(exc))
                break
            task = self._handle(stream, data)
            if task is None:
                continue
            if not readers.begin_inline(self, stream, messages):
                self._submit(task)  # a call of this stream runs inline already: the pool runs it
                continue
            # Run the call here, still the leader; reading passes on only if it runs long or
            # waits on a Future (see `_Readers`).
            _unmark_io_thread()
            set_blocking_hook(readers.hand_on)
            try:
                task()
            except Exception:  # noqa: BLE001
                logger.exception("An inline RPC task on %s raised", stream.describe())
            finally:
                set_blocking_hook(None)
                mark_io_thread()
            del task
            if readers.end_inline():
                continue  # nobody took over: read on
            if not readers.wait_to_lead(stream):
                break
        readers.release_follower()
        self._watch.unwatch(readers)
        # A DirectCall or ServerCall is read to its end even when this thread leaves as a
        # follower (see _grpc_direct.Pump.drain); at once if it already ended.
        if isinstance(messages, _grpc_direct.Pump):
            messages.drain()

    def _handle(self, stream: Stream, data: bytes):
        metrics.BYTES_RECEIVED.inc(len(data))
        try:
            frames = rpc_pb2.Batch.FromString(data).frames
        except Exception:  # noqa: BLE001  (an authenticated peer sent garbage)
            metrics.REJECTED_STREAM.inc()
            logger.warning(
                "Worker %r dropped a malformed message of %d bytes from %s.",
                self.name, len(data), stream.describe(),
            )
            return None
        try:
            return self._on_frames(stream, frames)
        except Exception:  # noqa: BLE001  (one bad frame must not kill the stream)
            logger.exception("Handling frames from %s failed", stream.describe())
            return None


class _NonBlocking:
    """The stream handler in grpcio's non-blocking server form.

    grpcio calls a handler marked `experimental_non_blocking` with a `send_response_callback`
    that any thread may call to write one message (it returns once gRPC took it), instead of
    iterating a response generator on a server thread. Replies then leave from the thread that
    produced them: one thread hand-off less per reply, and no server thread held per stream.
    """

    experimental_non_blocking = True

    def __init__(self, transport: "GrpcTransport"):
        self._transport = transport

    def __call__(self, request_iterator, context, send_response_callback=None) -> None:
        if send_response_callback is None:  # a grpcio without the non-blocking form
            raise RpcError("this grpcio does not pass send_response_callback to the handler")
        self._transport._serve_stream(request_iterator, context, send_response_callback)


class _Readers:
    """Leader/follower reading of one stream by at most two threads.

    The leader reads. When a batch brings an incoming call, the leader runs that call itself
    and then reads on: no thread hand-off at all for a short call. Waking a second reader for
    every call, as this did before, cost a context switch per call that on a 2-core machine
    competed with the call itself (bench/rpc.py sync_64B, see the commit). Reading must not
    stop for long, though (a nested call's reply may come on this stream, and a dead peer must
    show), so reading passes to the follower (started on first need) when the call waits on a
    Future (`Future.wait` calls `hand_on` through the thread's blocking hook) or when it has run
    for `_INLINE_HANDOVER_S` (the transport's `_InlineWatch` calls `hand_on`). The old leader
    then waits as the follower. While one call runs inline, further calls go to the pool.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._wake = threading.Semaphore(0)
        self._follower_waiting = False
        # A follower between two states (it finished its inline call, not yet waiting) that
        # was made leader: it leads on instead of waiting.
        self._promoted = False
        self._threads = 1
        # monotonic() when the running inline call began; None when none runs.
        self.inline_since: Optional[float] = None
        self._taken = False
        self._args: Optional[tuple] = None

    def begin_inline(self, transport: "GrpcTransport", stream: Stream, messages) -> bool:
        """The leader is about to run a call itself; False if one already runs inline."""
        now = time.monotonic()
        with self._lock:
            if self.inline_since is not None:
                return False
            self._taken = False
            self._args = (transport, stream, messages)
            self.inline_since = now
        transport._watch.active(now)
        return True

    def end_inline(self) -> bool:
        """The inline call returned; True if this thread is still the leader."""
        with self._lock:
            self.inline_since = None
            self._args = None
            return not self._taken

    def hand_on(self) -> None:
        """Make another thread the leader while the inline call goes on (any thread; once)."""
        with self._lock:
            if self.inline_since is None or self._taken:
                return
            self._taken = True
            transport, stream, messages = self._args
            if self._follower_waiting:
                self._follower_waiting = False
                self._wake.release()
                return
            if self._threads >= 2:
                self._promoted = True
                return
            self._threads += 1
        threading.Thread(
            target=transport._read_loop, args=(stream, messages), daemon=True,
            name=f"shoal-rpc-read-{transport.name}-{stream.peer_name}",
        ).start()

    def wait_to_lead(self, stream: Stream) -> bool:
        """Wait as the follower until promoted; False once the stream is dead."""
        with self._lock:
            if stream.state == Stream.DEAD:
                self._threads -= 1
                return False
            if self._promoted:
                self._promoted = False
                return True
            self._follower_waiting = True
        self._wake.acquire()
        if stream.state == Stream.DEAD:
            with self._lock:
                self._threads -= 1
            return False
        return True

    def release_follower(self) -> None:
        """The leader stops (the stream died): let a waiting follower see that and exit."""
        with self._lock:
            if self._follower_waiting:
                self._follower_waiting = False
                self._wake.release()


class _InlineWatch:
    """One thread per transport that hands reading on from readers whose inline call has run
    for `_INLINE_HANDOVER_S`.

    It ticks only while inline calls happen (within `_WATCH_IDLE_S` of the last one) and sleeps
    otherwise, so a call costs it nothing but a timestamp; the first call after a quiet spell
    wakes it.
    """

    def __init__(self, name: str):
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._readers: set = set()
        self._last_active = 0.0
        self._sleeping = False
        self._stopped = False
        self._thread: Optional[threading.Thread] = None

    def watch(self, readers: _Readers) -> None:
        """Start checking `readers` (starts the thread on first use)."""
        with self._cond:
            self._readers.add(readers)
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(
                    target=self._run, daemon=True, name=f"shoal-rpc-watch-{self._name}"
                )
                self._thread.start()

    def unwatch(self, readers: _Readers) -> None:
        """Stop checking `readers` (its stream is gone)."""
        with self._cond:
            self._readers.discard(readers)

    def active(self, now: float) -> None:
        """An inline call began at `now`: keep ticking (wake the thread if it sleeps)."""
        # Written before `_sleeping` is read here, read after `_sleeping` is set in `_run`:
        # one side always sees the other.
        self._last_active = now
        if self._sleeping:
            with self._cond:
                self._cond.notify()

    def stop(self) -> None:
        """End the thread."""
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        tick = _INLINE_HANDOVER_S / 2
        while True:
            with self._cond:
                if self._stopped:
                    return
                if time.monotonic() - self._last_active > _WATCH_IDLE_S:
                    self._sleeping = True
                    if time.monotonic() - self._last_active > _WATCH_IDLE_S:
                        self._cond.wait()
                    self._sleeping = False
                    continue
                self._cond.wait(tick)
                if self._stopped:
                    return
                readers = list(self._readers)
            now = time.monotonic()
            for r in readers:
                since = r.inline_since
                if since is not None and now - since >= _INLINE_HANDOVER_S:
                    r.hand_on()


def _end_call(call) -> None:
    """Cancel a dialed call that will not be read, and read it to its end if it is ours."""
    if isinstance(call, _grpc_direct.Pump):
        call.drain()
    else:
        call.cancel()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        try:
            return f"{exc.code().name}: {exc.details()}"
        except Exception:  # noqa: BLE001
            pass
    return str(exc) or type(exc).__name__
