"""DirectCall (rpc_agent/transport/direct.py) against a real gRPC server in this process: frames
held until release, coalescing, message bounds, every way a call ends, and the fallback to
grpcio's public API."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from shoal.rpc_agent.transport import direct as _grpc_direct
from shoal.rpc_agent.transport import direct_server as _grpc_direct_server
from shoal.rpc_agent._generated import rpc_pb2
from shoal.rpc_agent.transport.direct import DirectCall, StreamEnded
from shoal.rpc_agent.transport.grpc import METHOD, SERVICE, GrpcTransport
from shoal.rpc_agent.transport.stream import Stream, encode_batch

TIMEOUT_S = 10.0


class _EchoServer:
    """Echoes every message; a message b"abort" ends the call with PERMISSION_DENIED and
    b"end" ends it with OK. `received` lists what arrived, in order."""

    def __init__(self):
        self.received: list[bytes] = []
        self.arrived = threading.Event()
        self._server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[
            grpc.method_handlers_generic_handler(
                SERVICE, {"Stream": grpc.stream_stream_rpc_method_handler(self._handle)})
        ])
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def _handle(self, requests, context):
        for message in requests:
            self.received.append(message)
            self.arrived.set()
            if message == b"abort":
                context.abort(grpc.StatusCode.PERMISSION_DENIED, "nope")
            if message == b"end":
                return
            yield message

    def stop(self):
        self._server.stop(grace=None).wait(TIMEOUT_S)


@pytest.fixture
def server():
    srv = _EchoServer()
    yield srv
    srv.stop()


@pytest.fixture
def channel(server):
    ch = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield ch
    ch.close()


def _frames_of(message: bytes) -> list[bytes]:
    return [bytes(f.payload) for f in rpc_pb2.Batch.FromString(message).frames]


def _frame(payload: bytes) -> bytes:
    return rpc_pb2.Frame(kind=rpc_pb2.CALL, payload=payload).SerializeToString()


class _Encoder:
    """What the stream passes as `encode`: records how many frames went in each message."""

    def __init__(self):
        self.sizes: list[int] = []

    def __call__(self, frames):
        self.sizes.append(len(frames))
        return encode_batch(frames)


def _next_with_timeout(call) -> bytes:
    """next(call) on a helper thread, so that a bug shows as a failure, not a hang."""
    box: list = []

    def read():
        try:
            box.append(("ok", next(call)))
        except BaseException as exc:  # noqa: BLE001  (handed to the test)
            box.append(("raised", exc))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(TIMEOUT_S)
    assert box, f"next() did not return within {TIMEOUT_S}s"
    kind, value = box[0]
    if kind == "raised":
        raise value
    return value


def _wait_for(condition) -> None:
    """The server registers its side of a stream just after its proof left, so the client may
    see the stream open a moment earlier: poll for the server's side (bounded)."""
    end = time.monotonic() + TIMEOUT_S
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)


def _started(channel, encode=None, max_bytes=1 << 20) -> DirectCall:
    call = DirectCall(encode or _Encoder(), max_bytes, burst_gap_s=0.0)
    call.start(channel, METHOD, ())
    return call


def test_frames_wait_for_release_then_leave_together(server, channel):
    encoder = _Encoder()
    call = _started(channel, encoder)
    for payload in (b"a", b"b", b"c"):
        assert call.send(_frame(payload))
    assert not server.arrived.wait(0.3), "a frame left before release()"
    assert call.release()
    assert _frames_of(_next_with_timeout(call)) == [b"a", b"b", b"c"]
    assert encoder.sizes == [3]
    call.cancel()


def test_after_release_each_send_arrives_in_order(server, channel):
    call = _started(channel)
    call.release()
    got = []
    for i in range(20):
        assert call.send(_frame(b"%d" % i))
        got.extend(_frames_of(_next_with_timeout(call)))
    assert got == [b"%d" % i for i in range(20)]
    call.cancel()


def test_a_message_stops_at_the_size_bound_and_the_rest_follows(server, channel):
    encoder = _Encoder()
    call = _started(channel, encoder, max_bytes=100)
    for payload in (b"x" * 40, b"y" * 40, b"z" * 40):
        call.send(_frame(payload))
    call.release()
    # The first two frames are in flight; only a reader can see that send end.
    assert call.waiting()
    first = _frames_of(_next_with_timeout(call))
    second = _frames_of(_next_with_timeout(call))
    assert (first, second) == ([b"x" * 40, b"y" * 40], [b"z" * 40])
    assert encoder.sizes == [2, 1]
    call.cancel()


def test_a_server_that_ends_with_ok_stops_iteration_every_time(server, channel):
    call = _started(channel, lambda frames: b"end")
    call.release()
    call.send(b"ignored: the encoder above sends b'end'")
    for _ in range(2):  # the queue is gone after the first: the second must not poll it
        with pytest.raises(StopIteration):
            _next_with_timeout(call)
    assert not call.send(_frame(b"late"))


def test_a_server_status_is_raised_as_code_and_details(server, channel):
    call = _started(channel, lambda frames: b"abort")
    call.release()
    call.send(b"ignored")
    with pytest.raises(StreamEnded) as info:
        _next_with_timeout(call)
    assert str(info.value) == "PERMISSION_DENIED: nope"
    with pytest.raises(StreamEnded):
        _next_with_timeout(call)


def test_cancel_ends_the_call_for_its_reader(server, channel):
    call = _started(channel)
    call.release()
    call.send(_frame(b"one"))
    assert _frames_of(_next_with_timeout(call)) == [b"one"]
    threading.Timer(0.1, call.cancel).start()
    with pytest.raises(StreamEnded) as info:
        _next_with_timeout(call)
    assert str(info.value).startswith("CANCELLED: ")


def test_a_dead_server_ends_the_call_as_unavailable(server, channel):
    call = _started(channel)
    call.release()
    call.send(_frame(b"one"))
    assert _frames_of(_next_with_timeout(call)) == [b"one"]
    server.stop()
    with pytest.raises(StreamEnded) as info:
        _next_with_timeout(call)
    assert str(info.value).split(":")[0] in ("UNAVAILABLE", "CANCELLED")


def test_the_transport_falls_back_to_the_public_api_when_the_private_layer_differs(
        server, channel, monkeypatch):
    monkeypatch.setattr(_grpc_direct, "_disabled_reason", None)
    stream = Stream(1, "w1", outgoing=True)
    assert stream.pump is not None
    stream.send(_frame(b"queued before the call"))

    def start(*args):
        raise TypeError("segregated_call() takes 10 positional arguments")

    monkeypatch.setattr(stream.pump, "start", start)
    call = GrpcTransport._start_call(stream, channel, ())
    assert not isinstance(call, DirectCall)
    assert not _grpc_direct.available()
    stream.send(_frame(b"sent after"))
    stream.mark_open(call.cancel)
    got = []
    while len(got) < 2:
        got.extend(_frames_of(_next_with_timeout(call)))
    assert got == [b"queued before the call", b"sent after"]
    # A stream made now uses the public API from the start.
    assert Stream(2, "w2", outgoing=True).pump is None
    call.cancel()


def test_the_client_choice_comes_from_the_environment(monkeypatch):
    monkeypatch.setattr(_grpc_direct, "_disabled_reason", None)
    monkeypatch.setenv(_grpc_direct.ENV_LAYER, "public")
    assert not _grpc_direct.available()
    assert Stream(1, "w1", outgoing=True).pump is None
    monkeypatch.setenv(_grpc_direct.ENV_LAYER, "direct")
    assert _grpc_direct.available()
    monkeypatch.setenv(_grpc_direct.ENV_LAYER, "fast")
    with pytest.raises(ValueError) as info:
        _grpc_direct.available()
    assert str(info.value) == "SHOAL_RPC_GRPC must be 'direct' or 'public', got 'fast'."


def test_an_accepted_stream_has_no_call_until_the_server_attaches_one():
    assert Stream(1, "w1", outgoing=False).pump is None


# ----------------------------------------------------------------------------- server side

class _DirectServer:
    """A StreamServer whose calls echo every message back (raw, not re-batched) on a reader
    thread each; `ends` collects how each call's reading ended."""

    def __init__(self, accept=None):
        self.ends: list[str] = []
        self.ended = threading.Event()
        self.calls: list[_grpc_direct.ServerCall] = []
        self._accept = accept
        self.server = _grpc_direct_server.StreamServer("127.0.0.1", [], METHOD, self._on_call, "test")
        self.port = self.server.start()

    def _on_call(self, accepted):
        if self._accept is not None and not self._accept(accepted):
            return
        call = _grpc_direct.ServerCall(accepted, b"".join, 1 << 20, 0.0, "test")
        call.release()
        self.calls.append(call)
        threading.Thread(target=self._echo, args=(call,), daemon=True).start()

    def _echo(self, call):
        try:
            for message in call:
                call.send(message)
            self.ends.append("stop")
        except StreamEnded as exc:
            self.ends.append(str(exc))
        self.ended.set()


@pytest.fixture
def direct_server():
    srv = _DirectServer()
    yield srv
    srv.server.stop(TIMEOUT_S)


def _public_call(port, requests, method=METHOD, metadata=()):
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return channel, channel.stream_stream(method)(iter(requests), metadata=metadata,
                                                  timeout=TIMEOUT_S)


def _status_of(port, method=METHOD) -> tuple:
    """The (code, details) that a one-message call from grpcio's public client ends with."""
    channel, call = _public_call(port, [b"never read"], method=method)
    try:
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        return info.value.code(), info.value.details()
    finally:
        channel.close()


def test_a_server_call_echoes_and_ends_with_ok_when_the_client_half_closes(direct_server):
    channel, call = _public_call(direct_server.port, [b"one", b"two", b"three"])
    # Echoes that queue behind a send in flight leave together (joined here).
    assert b"".join(call) == b"onetwothree"
    assert call.code() == grpc.StatusCode.OK
    assert direct_server.ended.wait(TIMEOUT_S)
    assert direct_server.ends == ["stop"]
    channel.close()


def test_a_direct_client_and_a_direct_server_talk_both_ways(direct_server):
    channel = grpc.insecure_channel(f"127.0.0.1:{direct_server.port}")
    call = _started(channel)
    call.release()
    for i in range(50):
        call.send(_frame(b"%d" % i))
        assert _frames_of(_next_with_timeout(call)) == [b"%d" % i]
    call.cancel()
    with pytest.raises(StreamEnded):
        _next_with_timeout(call)
    assert direct_server.ended.wait(TIMEOUT_S)
    assert direct_server.ends[0].startswith("CANCELLED: ")
    channel.close()


def test_a_rejected_call_gets_its_status_and_nothing_is_read():
    def accept(accepted):
        srv.server.reject(accepted, "unauthenticated", "no proof")
        return False

    srv = _DirectServer(accept)
    try:
        assert _status_of(srv.port) == (grpc.StatusCode.UNAUTHENTICATED, "no proof")
    finally:
        srv.server.stop(TIMEOUT_S)


def test_another_method_is_unimplemented(direct_server):
    assert _status_of(direct_server.port, method="/shoal.rpc.Agent/Other") == (
        grpc.StatusCode.UNIMPLEMENTED, "unknown method")


def test_stopping_the_server_ends_its_calls_on_both_sides():
    srv = _DirectServer()
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    call = _started(channel)
    call.release()
    call.send(_frame(b"up"))
    assert _frames_of(_next_with_timeout(call)) == [b"up"]
    srv.server.stop(TIMEOUT_S)
    assert not srv.server.running, "the accept thread did not end"
    assert srv.ended.wait(TIMEOUT_S)
    assert srv.ends[0].startswith("CANCELLED: ")
    with pytest.raises(StreamEnded):
        _next_with_timeout(call)
    channel.close()


def test_an_accept_callback_that_raises_gets_its_call_rejected_and_accepting_goes_on():
    failures = [RuntimeError("accept failed on purpose")]

    def accept(accepted):
        if failures:
            raise failures.pop()
        return True

    srv = _DirectServer(accept)
    try:
        assert _status_of(srv.port) == (
            grpc.StatusCode.INTERNAL, "the server failed to accept the stream")
        channel, call = _public_call(srv.port, [b"second"])
        assert b"".join(call) == b"second"
        channel.close()
    finally:
        srv.server.stop(TIMEOUT_S)
    assert not srv.server.running


_NAMES = {0: "w0", 1: "w1"}


def _transport(worker_id: int, max_streams: int, on_stream_open) -> GrpcTransport:
    """A transport of worker `worker_id` in a two-worker job that only opens streams."""
    return GrpcTransport(
        name=_NAMES[worker_id], worker_id=worker_id, token=b"k" * 32, host="127.0.0.1",
        max_streams=max_streams, on_frames=lambda stream, frames: None,
        on_stream_open=on_stream_open, on_stream_dead=lambda stream: None,
        peer_name=_NAMES.get, submit=lambda task: None)


def test_a_transport_refuses_streams_beyond_its_bound(monkeypatch):
    """max_streams=0 still leaves 4 spare streams; the fifth is refused before anything is
    read, and its dialer learns why."""
    monkeypatch.setattr(_grpc_direct, "_disabled_reason", None)
    opened = []
    server, client = _transport(1, 0, opened.append), _transport(0, 0, opened.append)
    port = server.start()
    try:
        streams = [client.connect(1, "w1", f"127.0.0.1:{port}", server.incarnation) for _ in range(5)]
        for stream in streams:
            stream.opened.wait(TIMEOUT_S)
        states = sorted(stream.state for stream in streams)
        assert states == [Stream.DEAD] + [Stream.OPEN] * 4
        dead = next(stream for stream in streams if stream.state == Stream.DEAD)
        assert dead.dead_reason.endswith("RESOURCE_EXHAUSTED: too many RPC streams")
        _wait_for(lambda: len(opened) >= 4)
        assert len(opened) == 4
    finally:
        client.stop()
        server.stop()


def test_a_transport_serves_through_grpc_server_when_the_private_server_differs(monkeypatch):
    monkeypatch.setattr(_grpc_direct, "_disabled_reason", None)

    def differs(*args, **kwargs):
        raise AttributeError("module 'cygrpc' has no attribute 'Server'")

    monkeypatch.setattr(_grpc_direct_server, "StreamServer", differs)
    opened = []
    server = _transport(1, 2, opened.append)
    assert isinstance(server._server, grpc.Server)
    assert not _grpc_direct.available()
    client = _transport(0, 2, opened.append)
    port = server.start()
    try:
        stream = client.connect(1, "w1", f"127.0.0.1:{port}", server.incarnation)
        assert stream.opened.wait(TIMEOUT_S) and stream.state == Stream.OPEN
        _wait_for(lambda: opened)
        assert len(opened) == 1 and not opened[0].outgoing
    finally:
        client.stop()
        server.stop()


def test_a_stream_that_fails_while_being_accepted_is_read_to_its_end(monkeypatch):
    """The server's proof already left when registering the stream fails: the call must be
    cancelled and drained on the spot (a server call's queue dropped with operations
    outstanding would hang the process), the dialer's stream dies, and the next one works."""
    monkeypatch.setattr(_grpc_direct, "_disabled_reason", None)
    failures = [RuntimeError("registering failed on purpose")]
    opened = []

    def on_open(stream):
        if failures:
            raise failures.pop()
        opened.append(stream)

    server, client = _transport(1, 0, on_open), _transport(0, 0, lambda stream: None)
    port = server.start()
    try:
        first = client.connect(1, "w1", f"127.0.0.1:{port}", server.incarnation)
        _wait_for(lambda: first.state == Stream.DEAD)
        assert first.state == Stream.DEAD
        assert server._accepted == 0
        second = client.connect(1, "w1", f"127.0.0.1:{port}", server.incarnation)
        assert second.opened.wait(TIMEOUT_S) and second.state == Stream.OPEN
        _wait_for(lambda: opened)
        assert len(opened) == 1 and server._accepted == 1
    finally:
        client.stop()
        server.stop()
    assert not server._server.running
