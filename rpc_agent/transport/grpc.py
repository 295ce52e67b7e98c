"""The control transport: one persistent bidirectional gRPC stream per pair of workers.

`GrpcTransport` dials streams, accepts them, authenticates both ends and runs each stream's read
loop; `Stream` (transport/stream.py) is one stream as the agent sends on it, and
`StreamReaders` (transport/readers.py) decides which thread reads it.

grpcio's thread-based API is used, not grpc.aio: measured here, a round trip through aio from
another thread costs about 150 us of CPU against about 90 us for the thread-based API, because
every hand-off into an asyncio loop adds a self-pipe wake-up and several loop iterations.

Both ends of a stream go through grpcio's Cython layer by default (transport/direct.py: a
`DirectCall` on a dialed stream, a `ServerCall` from the `StreamServer` on an accepted one),
with no grpcio thread between the socket and the stream's reader. Receiving: one reader thread
per stream parses each Batch and hands its frames to the agent. Where that private layer does
not fit (or SHOAL_RPC_GRPC=public), grpcio's public API serves: a `grpc.Server` with a
non-blocking handler, and calls made from `Channel.stream_stream`.

Importing this module imports grpc, whose C core reads its process-wide settings right then:
the agent applies shoal's choice of them first (transport/grpc_tuning.py).

Authentication comes before anything is read: a client sends a signed `Hello` as metadata of
the call (timestamped, with a nonce the server remembers, bound to the target worker and to its
incarnation: a random nonce each worker draws when it starts and publishes beside its address,
so a hello captured off the wire opens nothing once that worker restarted), the server checks it
before reading a single message, and answers with a fresh stream nonce and its own proof over
the nonces as the first frame, which the client checks before reading any other frame and
before it sends any of its own. Every later message, both ways, carries the stream's tag (or is
sealed, SHOAL_ENCRYPT) under keys derived from the secret and the three nonces
(`core.channel`), checked before anything in it is parsed: a relay that forwarded an honest
hello can neither speak on the stream nor alter a byte of it, and the stream is dropped when
one fails.

A connection's bounds are gRPC core's own (see `server_options`): an HTTP/2 handshake within
3 s, a connection with no call for 3 s closed, and at most so many connections in total. gRPC
has no per-source bound, so none is kept here (a front accept loop would cost a relay of every
byte).
"""

from __future__ import annotations

import hmac
import logging
import resource
import secrets
import threading
import time
from concurrent import futures
from typing import Callable, Optional

import grpc

from shoal.collectives.futures import set_blocking_hook
from shoal.core import auth
from shoal.core.channel import IntegrityError
from shoal.rpc_agent import metrics
from shoal.rpc_agent._generated import rpc_pb2
from shoal.rpc_agent._threads import mark_io_thread, unmark_io_thread
from shoal.rpc_agent.types import (
    AUTH_WINDOW_S,
    CONNECT_TIMEOUT_S,
    MAX_GRPC_MESSAGE_BYTES,
    RpcError,
)
from shoal.rpc_agent.transport import direct, direct_server, grpc_tuning
from shoal.rpc_agent.transport.hello import (
    HELLO_METADATA,
    NONCE_BYTES,
    PURPOSE_CLIENT,
    check_server_answer,
    client_hello,
    hello_signing_bytes,
    server_answer,
    stream_link,
)
from shoal.rpc_agent.transport.readers import InlineWatch
from shoal.rpc_agent.transport.stream import Stream, encode_batch

logger = logging.getLogger(__name__)

SERVICE = "shoal.rpc.Agent"
METHOD = f"/{SERVICE}/Stream"

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
# A connection that has not finished its HTTP/2 handshake, or holds no call, this long is closed:
# a shoal peer opens its stream at once, and a stream without a valid hello is refused at once.
IDLE_CONNECTION_MS = 3_000
# Connections beyond the streams served that strangers may hold at once, at most this many and
# at most an eighth of the process's descriptor limit (its own files must keep opening).
SPARE_CONNECTIONS = 64
_DESCRIPTOR_SHARE = 8


def server_options(max_streams: int) -> list:
    """The server's gRPC channel arguments, bounding connections for `max_streams` streams."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    share = SPARE_CONNECTIONS if soft == resource.RLIM_INFINITY else soft // _DESCRIPTOR_SHARE
    return [
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.so_reuseport", 0),
        ("grpc.server_handshake_timeout_ms", IDLE_CONNECTION_MS),
        ("grpc.max_connection_idle_ms", IDLE_CONNECTION_MS),
        ("grpc.max_allowed_incoming_connections",
         max_streams + max(8, min(SPARE_CONNECTIONS, share))),
    ]


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
        # This process's incarnation, published beside the address: hellos must name it.
        self.incarnation = secrets.token_bytes(NONCE_BYTES)
        self._encrypt = auth.local_mode() == auth.MODE_ENCRYPTED
        self._options = server_options(self._max_accepted)
        self._executor: Optional[futures.ThreadPoolExecutor] = None
        # True while _server is a direct_server.StreamServer (else grpcio's grpc.Server).
        self._serves_direct = False
        self._server = None
        if direct.available():
            try:
                # Accepted calls go straight to their stream's reader (see transport/direct.py).
                self._server = direct_server.StreamServer(
                    host, self._options, METHOD, self._accept, name,
                    quiet_accept=grpc_tuning.poll_without_listener_engine())
                self._serves_direct = True
            except direct.PRIVATE_LAYER_ERRORS as exc:
                direct.disable(exc)
        if self._server is None:
            self._server = self._public_server()
        self.port: Optional[int] = None
        self._stopped = False
        self._watch = InlineWatch(name)

    def _public_server(self) -> grpc.Server:
        """grpcio's own server: a handler thread per stream, replies through its callback."""
        self._serves_direct = False
        self._executor = futures.ThreadPoolExecutor(
            max_workers=self._max_accepted, thread_name_prefix=f"shoal-rpc-grpc-{self.name}"
        )
        return grpc.server(
            self._executor,
            handlers=[grpc.method_handlers_generic_handler(
                SERVICE,
                {"Stream": grpc.stream_stream_rpc_method_handler(_NonBlocking(self._serve_stream))},
            )],
            options=self._options,
            maximum_concurrent_rpcs=self._max_accepted,
        )

    def start(self) -> int:
        """Bind and start the server; return the port."""
        port = 0
        if self._serves_direct:
            try:
                port = self._server.start()
            except direct.PRIVATE_LAYER_ERRORS as exc:
                direct.disable(exc)
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

    def connect(self, peer_id: int, peer_name: str, address: str, incarnation: bytes) -> Stream:
        """A new outgoing stream to `address`, whose worker published `incarnation`; it
        connects in the background (frames queue)."""
        stream = Stream(peer_id, peer_name, outgoing=True)
        stream.on_dead = self._on_stream_dead
        self._start_reader(self._dial, stream, address, incarnation)
        return stream

    def _start_reader(self, target: Callable, stream: Stream, *args) -> None:
        """Run `target(stream, *args)`, which reads `stream`, on a thread of its own."""
        threading.Thread(
            target=target, args=(stream, *args), daemon=True,
            name=f"shoal-rpc-read-{self.name}-{stream.peer_name}",
        ).start()

    def _dial(self, stream: Stream, address: str, incarnation: bytes) -> None:
        mark_io_thread()
        hello = client_hello(self._token, self.name, self.worker_id, stream.peer_id,
                             incarnation, self._encrypt)
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
            stream.attach_link(check_server_answer(self._token, hello, first, stream.describe()))
        except Exception as exc:  # noqa: BLE001  (any failure is this stream's death)
            if call is not None:
                _end_call(call)
            stream.fail(f"connecting to {address} failed: {_describe(exc)}")
            channel.close()
            return
        def cancel() -> None:
            call.cancel()
            channel.close()

        if not stream.mark_open(cancel):
            _end_call(call)
            channel.close()
            return
        if stream.pump is not None and not stream.pump.release():
            stream.fail("the RPC ended as it opened")
        self._read_loop(stream, call)

    @staticmethod
    def _start_call(stream: Stream, channel: grpc.Channel, metadata: tuple):
        """The stream's call, started: a DirectCall where it fits, else grpcio's public
        bidirectional call fed by `stream.public_requests()`; either is iterated for
        messages."""
        call = stream.pump
        if call is not None:
            try:
                call.start(channel, METHOD, metadata)
                return call
            except direct.PRIVATE_LAYER_ERRORS as exc:
                direct.disable(exc)
                call.abandon(stream.queue_request)
        return channel.stream_stream(METHOD)(stream.public_requests(), metadata=metadata)

    # -- server side

    def _accept(self, accepted: direct_server.Accepted) -> None:
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
        answer, stream_nonce = server_answer(self._token, self.worker_id, hello)
        call = stream.attach_server_call(accepted)
        # From here on the call has operations outstanding: whatever happens, it is read to
        # its end (a server call's queue dropped with operations outstanding hangs the
        # process), so nothing may escape to the accept loop.
        try:
            call.send(rpc_pb2.Frame(kind=rpc_pb2.HELLO, payload=answer).SerializeToString())
            # The answer is encoded (untagged: it carries its own proof) as it is released;
            # nobody else holds the stream yet, so every later message is tagged.
            if not call.release():
                raise RpcError("the stream ended before the proof left")
            stream.attach_link(stream_link(self._token, hello, stream_nonce, server=True,
                                           peer=stream.describe()))
            stream.mark_open(call.cancel)
            self._on_stream_open(stream)
            self._start_reader(self._read_accepted, stream, call)
        except BaseException as exc:  # noqa: BLE001
            logger.warning("Worker %r could not take the RPC stream from %s: %s",
                           self.name, stream.describe(), _describe(exc))
            stream.fail(f"accepting it failed: {_describe(exc)}")
            call.drain()
            with self._lock:
                self._accepted -= 1

    def _read_accepted(self, stream: Stream, call: direct.ServerCall) -> None:
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
        answer, stream_nonce = server_answer(self._token, self.worker_id, hello)

        def write(data: bytes) -> bool:
            send_response(data)  # returns once gRPC took the message (or the RPC ended)
            return context.is_active()

        # The proof goes first, before the stream is open for anyone else's frames.
        if not write(encode_batch(
            [rpc_pb2.Frame(kind=rpc_pb2.HELLO, payload=answer).SerializeToString()]
        )):
            return
        stream.attach_link(stream_link(self._token, hello, stream_nonce, server=True,
                                       peer=stream.describe()))
        stream.attach_writer(write)
        stream.mark_open(context.cancel)
        context.add_callback(lambda: stream.fail("the RPC ended"))
        self._on_stream_open(stream)
        self._start_reader(self._read_loop, stream, request_iterator)

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
        if not auth.verify(self._token, PURPOSE_CLIENT, hello_signing_bytes(hello), hello.proof):
            return None, "its proof does not match this job's secret"
        if hello.to_id != self.worker_id:
            return None, (
                f"its proof is for worker id {hello.to_id}, not this one ({self.worker_id})"
            )
        if not hmac.compare_digest(hello.server_nonce, self.incarnation):
            return None, (
                "its proof is for another incarnation of this worker (a hello from before a "
                "restart, replayed, or an address table that is not this run's)"
            )
        if hello.encrypt != self._encrypt:
            return None, (
                f"it {'encrypts' if hello.encrypt else 'does not encrypt'} its stream and this "
                "worker does not: set SHOAL_ENCRYPT to the same value on every process"
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
        """Read the stream as its leader; see `StreamReaders` for how leadership moves."""
        mark_io_thread()
        readers = stream.readers
        self._watch.watch(readers)

        def start_next_leader() -> None:  # once this thread's inline call is handed on
            self._start_reader(self._read_loop, stream, messages)

        def alive() -> bool:
            return stream.alive

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
                if stream.alive:
                    continue
                break  # dropped (a message failed its integrity check)
            now = time.monotonic()
            if not readers.begin_inline(now, start_next_leader):
                self._submit(task)  # a call of this stream runs inline already: the pool runs it
                continue
            self._watch.active(now)
            # Run the call here, still the leader; reading passes on only if it runs long or
            # waits on a Future (see `StreamReaders`).
            unmark_io_thread()
            set_blocking_hook(readers.hand_on)
            try:
                task()
            except Exception:
                logger.exception("An inline RPC task on %s raised", stream.describe())
            finally:
                set_blocking_hook(None)
                mark_io_thread()
            del task
            if readers.end_inline():
                continue  # nobody took over: read on
            if not readers.wait_to_lead(alive):
                break
        readers.release_follower()
        self._watch.unwatch(readers)
        # A DirectCall or ServerCall is read to its end even when this thread leaves as a
        # follower (see direct.Pump.drain); at once if it already ended.
        if isinstance(messages, direct.Pump):
            messages.drain()

    def _handle(self, stream: Stream, data: bytes):
        metrics.BYTES_RECEIVED.inc(len(data))
        try:
            body = stream.open_message(data)
        except IntegrityError as exc:
            metrics.REJECTED_STREAM.inc()
            logger.warning("Worker %r dropped its RPC stream with %s: %s Nothing in that "
                           "message was read.", self.name, stream.describe(), exc)
            stream.fail(str(exc))
            return None
        try:
            frames = rpc_pb2.Batch.FromString(body).frames
        except Exception:  # noqa: BLE001  (an authenticated peer sent garbage)
            metrics.REJECTED_STREAM.inc()
            logger.warning(
                "Worker %r dropped a malformed message of %d bytes from %s.",
                self.name, len(body), stream.describe(),
            )
            return None
        try:
            return self._on_frames(stream, frames)
        except Exception:
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

    def __init__(self, serve: Callable[..., None]):
        # GrpcTransport._serve_stream(request_iterator, context, send_response)
        self._serve = serve

    def __call__(self, request_iterator, context, send_response_callback=None) -> None:
        if send_response_callback is None:  # a grpcio without the non-blocking form
            raise RpcError("this grpcio does not pass send_response_callback to the handler")
        self._serve(request_iterator, context, send_response_callback)


def _end_call(call) -> None:
    """Cancel a dialed call that will not be read, and read it to its end if it is ours."""
    if isinstance(call, direct.Pump):
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
