"""The RPC stream after its hello (issue 34): a hello is bound to the receiving worker's
incarnation, and every later message carries the stream's tag, checked before it is parsed.

- a hello captured off the wire and replayed to the restarted worker (same secret, same worker
  ids) is refused;
- a relay that forwarded worker 0's hello to worker 1 and then sends its own CALL with a pickle:
  the pickle never runs and worker 1 drops the stream, naming the integrity failure;
- one byte altered in flight in an otherwise honest stream fails the same way.
These tests hold the job's secret (they build the honest hello as worker 0 would, which is what
a relay forwards); what they send afterwards is what a relay without the keys can send.
"""

from __future__ import annotations

import os
import pickle
import queue
import resource
import socket
import time

import grpc
import pytest

from shoal.rpc_agent._generated import rpc_pb2
from shoal.rpc_agent.transport.grpc import METHOD
from shoal.rpc_agent.transport.hello import (
    HELLO_METADATA,
    check_server_answer,
    client_hello,
)
from shoal.rpc_agent.transport.stream import encode_batch
from tests.support import fuzz_rpc_peer
from tests.support.rpc_workers import LOGS, RpcWorkers

TOKEN = os.environ.get("SHOAL_AUTH_TOKEN", "shoal-test-suite-token").encode()
WAIT_S = 10.0


def _port_and_incarnation():
    from shoal.rpc_agent import _current

    agent = _current.get()
    return agent.grpc_port, agent.grpc_incarnation


def _logs_with(text):
    return [line for line in LOGS if text in line]


class _Touch:
    """Unpickling this creates a directory: proof that a payload was (not) unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _call_frame(fn, args, request_id: int = 1, function: str = "echo") -> bytes:
    payload = pickle.dumps((fn, args, {}), protocol=5)
    return rpc_pb2.Frame(kind=rpc_pb2.CALL, request_id=request_id, function=function,
                         payload=payload).SerializeToString()


def _evil(marker: str) -> bytes:
    return encode_batch([_call_frame(_Touch(marker), (), function="evil")])


class _Client:
    """A stream to worker 1 opened with `hello`, fed from a queue."""

    def __init__(self, port: int, hello: bytes):
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.call = self._channel.stream_stream(METHOD)(
            iter(self._out.get, None), metadata=((HELLO_METADATA, hello),), timeout=3 * WAIT_S)

    def send(self, data: bytes) -> None:
        self._out.put(data)

    def end_code(self):
        """How the stream ended (reading what is left), or 'open' if it stays open."""
        try:
            for _ in self.call:
                pass
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    def close(self) -> None:
        self._out.put(None)
        self.call.cancel()
        self._channel.close()


def _wait_for(condition, what: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:g}s"
        time.sleep(0.05)
    return value


def test_a_hello_captured_before_a_restart_is_refused_after_it(tmp_path):
    with RpcWorkers(2) as first:
        port, incarnation = first.run(1, _port_and_incarnation)
        captured = client_hello(TOKEN, "w0", 0, 1, incarnation, False).SerializeToString()
        first.shutdown()
    marker = str(tmp_path / "unpickled")
    with RpcWorkers(2) as restarted:
        port, fresh = restarted.run(1, _port_and_incarnation)
        assert fresh != incarnation
        client = _Client(port, captured)
        try:
            client.send(_evil(marker))
            with pytest.raises(grpc.RpcError) as refused:
                next(client.call)
        finally:
            client.close()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "another incarnation of this worker" in refused.value.details()
        assert not os.path.exists(marker)
        restarted.shutdown()


@pytest.fixture(scope="module")
def workers():
    with RpcWorkers(2) as pool:
        yield pool
        pool.shutdown()


def _open(workers) -> tuple[_Client, rpc_pb2.Hello, bytes]:
    port, incarnation = workers.run(1, _port_and_incarnation)
    hello = client_hello(TOKEN, "w0", 0, 1, incarnation, False)
    client = _Client(port, hello.SerializeToString())
    return client, hello, next(client.call)


def test_a_relay_that_forwarded_a_hello_cannot_call(workers, tmp_path):
    marker = str(tmp_path / "unpickled")
    client, _, first = _open(workers)
    try:
        assert rpc_pb2.Batch.FromString(first).frames[0].kind == rpc_pb2.HELLO
        client.send(_evil(marker))  # the relay's own frame: it has no key to tag it with
        assert client.end_code() != grpc.StatusCode.OK
    finally:
        client.close()
    lines = _wait_for(lambda: workers.run(1, _logs_with, "failed its integrity check"),
                      "w1's log of the integrity failure")
    assert any("dropped its RPC stream with worker 'w0' (id 0)" in line for line in lines), lines
    assert not os.path.exists(marker), "w1 unpickled the relay's CALL"
    assert workers.run(0, _still_serving) is True


def test_one_byte_altered_in_flight_drops_the_stream(workers, tmp_path):
    marker = str(tmp_path / "unpickled")
    client, hello, first = _open(workers)
    try:
        link = check_server_answer(TOKEN, hello, first, "worker 'w1'")
        honest = encode_batch([_call_frame(fuzz_rpc_peer.echo, ("ping",), request_id=7)])
        client.send(honest + link.sealer.tag((honest,)))
        reply = next(client.call)
        body = memoryview(reply)[:-16]
        link.opener.check((body,), reply[-16:])
        assert rpc_pb2.Batch.FromString(body).frames[0].request_id == 7
        evil = bytearray(_evil(marker))
        message = bytes(evil) + link.sealer.tag((bytes(evil),))
        # A relay flips one byte of the function name: the pickle is intact and would run.
        altered = bytearray(message)
        altered[altered.index(b"evil")] ^= 0x20
        client.send(bytes(altered))
        assert client.end_code() != grpc.StatusCode.OK
    finally:
        client.close()
    _wait_for(lambda: any("Frame 1 from worker 'w0'" in line
                          for line in workers.run(1, _logs_with, "failed its integrity check")),
              "w1's log of the altered message")
    assert not os.path.exists(marker), "w1 unpickled the altered CALL"
    assert workers.run(0, _still_serving) is True


def _still_serving():
    from shoal import rpc_agent

    return rpc_agent.rpc_sync("w1", fuzz_rpc_peer.echo, ("ping",), timeout=10) == "ping"


# ----------------------------------------------------------------------------- idle flood

FLOOD = 300
NOFILE = 256


def _init_under_limit(nofile):
    """init_rpc as RpcWorkers does, with worker 1's descriptor limit lowered first."""
    from shoal import rpc_agent

    rank = int(os.environ["RANK"])
    if rank == 1:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
    rpc_agent.init_rpc(f"w{rank}", rank, 2, rpc_agent.RpcBackendOptions(
        init_method="env://", rpc_timeout=30, init_timeout=60))
    return rank


def _open_files(n: int) -> int:
    """How many of `n` files opened at once failed."""
    held, failed = [], 0
    try:
        for _ in range(n):
            try:
                held.append(open(os.devnull, "rb"))
            except OSError:
                failed += 1
    finally:
        for f in held:
            f.close()
    return failed


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_idle_connections_to_the_grpc_port_are_closed_and_bounded():
    with RpcWorkers(2, init=False) as pool:
        assert pool.run_all(_init_under_limit, NOFILE) == [0, 1]
        port, _ = pool.run(1, _port_and_incarnation)
        socks = []
        try:
            for _ in range(FLOOD):
                sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
                sock.setblocking(False)
                socks.append(sock)
            assert pool.run(1, _open_files, NOFILE // 2) == 0
            assert pool.run(0, _still_serving) is True
            start = time.monotonic()
            _wait_for(lambda: all(_closed(s) for s in socks),
                      f"w1 closing {FLOOD} idle connections", timeout=6.0)
            took = time.monotonic() - start
            assert took < 6.0
            assert pool.run(0, _still_serving) is True
        finally:
            for sock in socks:
                sock.close()
        pool.shutdown()
