"""The control transport: one persistent bidirectional gRPC stream per pair of workers.

Everything gRPC runs on one asyncio thread (grpc.aio), which answers a round trip with fewer
thread hand-offs than grpc's thread-per-stream API. Frames are serialized by the threads that
send them and queued on their `Stream`; the stream's writer task takes every frame queued at
that moment and writes them as one gRPC message (a `Batch`), so under load one gRPC write,
which costs far more CPU than a frame, carries many calls.

Authentication comes before anything is read: a client sends a signed `Hello` as metadata of
the call (timestamped, with a nonce the server remembers, bound to the target worker), the
server checks it before reading a single message, and answers with its own proof over the
client's nonce as the first frame, which the client checks before reading any other.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import struct
import threading
import time
from typing import Callable, Optional

import grpc
from grpc import aio

from core import auth
from rpc_agent import metrics
from rpc_agent._threads import mark_io_thread
from rpc_agent._generated import rpc_pb2
from rpc_agent.api import (
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

_GRPC_OPTIONS = [
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

    def __init__(self, loop: asyncio.AbstractEventLoop, peer_id: int, peer_name: str,
                 outgoing: bool):
        self.peer_id = peer_id
        self.peer_name = peer_name
        self.outgoing = outgoing
        self.state = Stream.CONNECTING
        self.dead_reason: Optional[str] = None
        # Request ids of calls sent on this stream and not yet answered (failed if it dies).
        self.pending_ids: set[int] = set()
        self._loop = loop
        self._lock = threading.Lock()
        self._frames: list[bytes] = []
        # False while the writer is busy (or not started): senders then only append.
        self._writer_idle = False
        self._wake = asyncio.Event()
        self._writer_task: Optional[asyncio.Task] = None
        self._cancel: Optional[Callable[[], None]] = None
        self.opened = threading.Event()

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
            RpcPeerLost: the stream is dead (the caller reconnects through the agent).
        """
        with self._lock:
            if self.state == Stream.DEAD:
                raise RpcPeerLost(
                    f"The RPC stream to {self.describe()} is down ({self.dead_reason})."
                )
            self._frames.append(frame)
            if not self._writer_idle:
                return
            self._writer_idle = False
        self._loop.call_soon_threadsafe(self._wake.set)

    # -- loop-thread side

    def _start_writer(self, write: Callable, cancel: Callable[[], None]) -> None:
        self._cancel = cancel
        with self._lock:
            if self.state == Stream.DEAD:
                return
            self.state = Stream.OPEN
        self._writer_task = self._loop.create_task(self._write_loop(write))
        self.opened.set()

    async def _write_loop(self, write: Callable) -> None:
        try:
            while True:
                while True:
                    with self._lock:
                        frames = self._frames
                        if not frames:
                            self._writer_idle = True
                            break
                        total = 0
                        for i, frame in enumerate(frames):
                            total += len(frame)
                            if total > MAX_BATCH_BYTES and i > 0:
                                self._frames = frames[i:]
                                frames = frames[:i]
                                break
                        else:
                            self._frames = []
                    data = encode_batch(frames)
                    await write(data)
                    metrics.BYTES_SENT.inc(len(data))
                await self._wake.wait()
                self._wake.clear()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001  (any write failure kills the stream)
            self.fail(f"writing to it failed: {exc}")

    def fail(self, reason: str) -> bool:
        """Mark the stream dead (any thread); True if this call did it."""
        with self._lock:
            if self.state == Stream.DEAD:
                return False
            self.state = Stream.DEAD
            self.dead_reason = reason
            self._frames = []
        self.opened.set()
        try:
            self._loop.call_soon_threadsafe(self._teardown)
        except RuntimeError:  # the loop is closed: nothing left to cancel
            pass
        return True

    def _teardown(self) -> None:
        if self._writer_task is not None:
            self._writer_task.cancel()
        if self._cancel is not None:
            try:
                self._cancel()
            except Exception:  # noqa: BLE001
                logger.debug("Cancelling the stream to %s failed", self.describe(), exc_info=True)


class GrpcTransport:
    """The agent's gRPC server and client streams, all on one asyncio thread.

    Args:
        name, worker_id: this worker.
        token: the job's secret.
        host: the address to bind.
        on_frames(stream, frames): called on the loop thread with each received Batch's frames.
        on_stream_open(stream): an incoming stream passed authentication.
        on_stream_dead(stream): a stream died (`stream.dead_reason` says why).
        peer_name(id): the registered name of worker `id`, or None if unknown.
    """

    def __init__(self, *, name: str, worker_id: int, token: bytes, host: str,
                 on_frames: Callable, on_stream_open: Callable, on_stream_dead: Callable,
                 peer_name: Callable[[int], Optional[str]]):
        self.name = name
        self.worker_id = worker_id
        self._token = token
        self._host = host
        self._on_frames = on_frames
        self._on_stream_open = on_stream_open
        self._on_stream_dead = on_stream_dead
        self._peer_name = peer_name
        self._seen_nonces: dict[bytes, float] = {}
        self._channels: dict[str, aio.Channel] = {}
        self._server: Optional[aio.Server] = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._run_loop, name=f"shoal-rpc-io-{name}", daemon=True
        )
        self.port: Optional[int] = None

    # -- lifecycle (any thread but the loop's)

    def _run_loop(self) -> None:
        mark_io_thread()
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _run(self, coro, timeout: float):
        if threading.current_thread() is self._thread:
            raise RpcError("Internal error: a blocking transport call on the RPC io thread.")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> int:
        """Start the io thread and the server; return the bound port."""
        self._thread.start()
        self.port = self._run(self._start_server(), CONNECT_TIMEOUT_S)
        return self.port

    async def _start_server(self) -> int:
        handler = grpc.method_handlers_generic_handler(
            SERVICE, {"Stream": grpc.stream_stream_rpc_method_handler(self._serve_stream)}
        )
        self._server = aio.server(options=_SERVER_OPTIONS)
        self._server.add_generic_rpc_handlers((handler,))
        port = self._server.add_insecure_port(f"{self._host}:0")
        if not port:
            raise RpcError(f"Worker {self.name!r} could not bind its RPC port on {self._host}.")
        await self._server.start()
        return port

    def stop(self, timeout: float = 5.0) -> None:
        """Close every stream and the server, then end the io thread."""
        if not self._thread.is_alive():
            return
        try:
            self._run(self._stop(), timeout)
        except Exception:  # noqa: BLE001  (stopping must not raise over a half-dead peer)
            logger.debug("Stopping the RPC transport of %s failed", self.name, exc_info=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()

    async def _stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
        for channel in self._channels.values():
            await channel.close(grace=None)
        self._channels.clear()

    # -- client side

    def connect(self, peer_id: int, peer_name: str, address: str) -> Stream:
        """A new outgoing stream to `address`, connecting in the background (frames queue)."""
        stream = Stream(self.loop, peer_id, peer_name, outgoing=True)
        asyncio.run_coroutine_threadsafe(self._dial(stream, address), self.loop)
        return stream

    async def _dial(self, stream: Stream, address: str) -> None:
        nonce = secrets.token_bytes(32)
        hello = rpc_pb2.Hello(
            name=self.name, id=self.worker_id, to_id=stream.peer_id,
            timestamp=time.time(), nonce=nonce,
        )
        hello.proof = auth.sign(self._token, PURPOSE_CLIENT, _hello_signing_bytes(hello))
        call = None
        try:
            channel = self._channels.get(address)
            if channel is None:
                channel = aio.insecure_channel(address, options=_GRPC_OPTIONS)
                self._channels[address] = channel
            call = channel.stream_stream(METHOD)(
                metadata=((HELLO_METADATA, hello.SerializeToString()),)
            )
            first = await asyncio.wait_for(call.read(), CONNECT_TIMEOUT_S)
            if first is aio.EOF:
                raise RpcError("it closed the stream before proving itself")
            batch = rpc_pb2.Batch.FromString(first)
            if (
                len(batch.frames) != 1
                or batch.frames[0].kind != rpc_pb2.HELLO
                or not auth.verify(
                    self._token, PURPOSE_SERVER, struct.pack("!i", stream.peer_id) + nonce,
                    _proof_of(batch.frames[0]),
                )
            ):
                raise RpcError("its first frame is not a valid proof of this job's secret")
        except asyncio.CancelledError:
            stream.fail("the agent is shutting down")
            raise
        except Exception as exc:  # noqa: BLE001  (any failure is this stream's death)
            reason = _describe_grpc_error(exc)
            if call is not None:
                call.cancel()
            if stream.fail(f"connecting to {address} failed: {reason}"):
                self._on_stream_dead(stream)
            return
        stream._start_writer(call.write, call.cancel)
        await self._read_loop(stream, call.read)

    # -- server side

    async def _serve_stream(self, request_iterator, context) -> None:
        hello, reason = self._check_hello(context.invocation_metadata())
        if hello is None:
            metrics.REJECTED_STREAM.inc()
            logger.warning(
                "Worker %r dropped an RPC stream from %s: %s. Nothing it sent was read.",
                self.name, context.peer(), reason,
            )
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
            return
        proof = _server_proof(self._token, self.worker_id, hello.nonce)
        await context.write(
            encode_batch([rpc_pb2.Frame(kind=rpc_pb2.HELLO, payload=proof).SerializeToString()])
        )
        stream = Stream(self.loop, hello.id, hello.name, outgoing=False)
        stream._start_writer(context.write, lambda: None)
        self._on_stream_open(stream)
        await self._read_loop(stream, context.read)

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
            return None, f"its proof is for worker id {hello.to_id}, not this one ({self.worker_id})"
        now = time.time()
        if abs(now - hello.timestamp) > AUTH_WINDOW_S:
            return None, (
                f"its proof is {now - hello.timestamp:+.0f}s old, outside the "
                f"{AUTH_WINDOW_S:g}s window"
            )
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

    async def _read_loop(self, stream: Stream, read: Callable) -> None:
        reason = "the peer closed it"
        try:
            while True:
                data = await read()
                if data is aio.EOF:
                    break
                metrics.BYTES_RECEIVED.inc(len(data))
                try:
                    frames = rpc_pb2.Batch.FromString(data).frames
                except Exception:  # noqa: BLE001  (an authenticated peer sent garbage)
                    metrics.REJECTED_STREAM.inc()
                    logger.warning(
                        "Worker %r dropped a malformed message of %d bytes from %s.",
                        self.name, len(data), stream.describe(),
                    )
                    continue
                try:
                    self._on_frames(stream, frames)
                except Exception:  # noqa: BLE001  (one bad frame must not kill the stream)
                    logger.exception("Handling frames from %s failed", stream.describe())
        except asyncio.CancelledError:
            reason = "it was cancelled (the peer went away or the agent is shutting down)"
            if stream.fail(reason):
                self._on_stream_dead(stream)
            raise
        except Exception as exc:  # noqa: BLE001
            reason = _describe_grpc_error(exc)
        if stream.fail(reason):
            self._on_stream_dead(stream)


def _proof_of(frame) -> bytes:
    return bytes(frame.payload)


def _describe_grpc_error(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        try:
            return f"{exc.code().name}: {exc.details()}"
        except Exception:  # noqa: BLE001
            pass
    if isinstance(exc, asyncio.TimeoutError):
        return f"no proof arrived within {CONNECT_TIMEOUT_S:g}s"
    return str(exc) or type(exc).__name__
