"""Hostile traffic against a live worker's two ports: garbage bytes, gRPC streams without a
valid proof (missing, wrong secret, replayed, stale, for another worker or another incarnation
of it, unknown name), a malformed message from an authenticated peer, and bad data-channel
connections. Each is dropped and logged before anything is unpickled, and the worker keeps
serving. (tests/multiproc/test_rpc_stream_integrity.py covers what follows a valid hello.)"""

from __future__ import annotations

import os
import secrets
import socket
import time

import grpc
import numpy as np
import pytest

from shoal.core import auth
from shoal.core.errors import AuthenticationError
from shoal.rpc_agent._generated import rpc_pb2
from shoal.rpc_agent.transport.grpc import METHOD
from shoal.rpc_agent.transport.hello import (
    HELLO_METADATA,
    PURPOSE_CLIENT,
    check_server_answer,
    hello_signing_bytes,
)
from shoal.rpc_agent.transport.stream import encode_batch
from tests.support.rpc_workers import LOGS, RpcWorkers

TOKEN = os.environ.get("SHOAL_AUTH_TOKEN", "shoal-test-suite-token").encode()


@pytest.fixture(scope="module")
def workers():
    with RpcWorkers(2) as pool:
        yield pool
        pool.shutdown()


# w1's incarnation nonce, which every hello to it must name (set by the `ports` fixture).
_INCARNATION: dict[str, bytes] = {}


@pytest.fixture(scope="module")
def ports(workers):
    grpc_port, data_port, _INCARNATION["w1"] = workers.run(1, _ports)
    return grpc_port, data_port


def _ports():
    from shoal.rpc_agent import _current

    agent = _current.get()
    return agent.grpc_port, agent.data_port, agent.grpc_incarnation


def logs_with(text):
    return [line for line in LOGS if text in line]


def rejected():
    from prometheus_client import REGISTRY

    return {port: REGISTRY.get_sample_value("shoal_rpc_rejected_total", {"port": port}) or 0.0
            for port in ("stream", "data")}


def echo(x):
    return x


def still_serving():
    """A small call and a 1 MiB echo (data channel) from w0 to w1 and back."""
    from shoal import rpc_agent

    big = np.arange(256 * 1024, dtype=np.float32)
    ok = rpc_agent.rpc_sync("w1", echo, ("ping",), timeout=10) == "ping"
    ok &= bool((rpc_agent.rpc_sync("w1", echo, (big,), timeout=10) == big).all())
    return ok


class _Touch:
    """Unpickling this creates a directory: proof that a payload was (not) unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _evil_batch(marker: str) -> bytes:
    import pickle

    payload = pickle.dumps((_Touch(marker), (), None), protocol=5)
    frame = rpc_pb2.Frame(kind=rpc_pb2.CALL, request_id=1, function="x", payload=payload)
    return encode_batch([frame.SerializeToString()])


def _hello(token=TOKEN, name="w0", worker_id=0, to_id=1, timestamp=None, nonce=None,
           incarnation=None, message=False):
    hello = rpc_pb2.Hello(name=name, id=worker_id, to_id=to_id,
                          timestamp=time.time() if timestamp is None else timestamp,
                          nonce=nonce or secrets.token_bytes(32),
                          server_nonce=_INCARNATION["w1"] if incarnation is None else incarnation)
    hello.proof = auth.sign(token, PURPOSE_CLIENT, hello_signing_bytes(hello))
    return hello if message else hello.SerializeToString()


def _open_stream(port: int, metadata, batches, hold=None):
    """Open a stream, send `batches`, return the first reply or the gRPC error code.

    With `hold`, the stream stays open (sending nothing more) until `hold()` is true.
    """
    import threading

    release = threading.Event()

    def requests():
        yield from batches
        release.wait(15)

    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        call = channel.stream_stream(METHOD)(requests(), metadata=metadata, timeout=20)
        try:
            first = next(call)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
        if hold is not None:
            deadline = time.monotonic() + 10
            while not hold() and time.monotonic() < deadline:
                time.sleep(0.05)
        release.set()
        call.cancel()
        return "answered", first
    finally:
        channel.close()


def test_garbage_bytes_to_the_grpc_port_leave_the_worker_serving(workers, ports):
    grpc_port, _ = ports
    for junk in (os.urandom(4096), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 100):
        with socket.create_connection(("127.0.0.1", grpc_port), timeout=5) as sock:
            sock.sendall(junk)
            sock.settimeout(2)
            try:
                sock.recv(1024)
            except (socket.timeout, ConnectionError):
                pass
    assert workers.run(0, still_serving) is True


# Proofs are built when the test runs, not at collection: a proof minted at import time goes
# stale (120 s window) when the rest of the suite runs first.
@pytest.mark.parametrize("case,make_metadata,reason", [
    ("no proof", lambda: (), "it carried no shoal-hello-bin proof"),
    ("garbage proof", lambda: ((HELLO_METADATA, b"\x01\x02garbage"),),
     "its hello metadata is not a Hello message"),
    ("wrong secret", lambda: ((HELLO_METADATA, _hello(token=b"some other secret")),),
     "its proof does not match this job's secret"),
    ("stale", lambda: ((HELLO_METADATA, _hello(timestamp=time.time() - 3600)),),
     "outside the 120s window"),
    ("other worker", lambda: ((HELLO_METADATA, _hello(to_id=0)),),
     "its proof is for worker id 0, not this one (1)"),
    ("other incarnation", lambda: ((HELLO_METADATA, _hello(incarnation=b"\x07" * 32)),),
     "its proof is for another incarnation of this worker"),
    ("unknown name", lambda: ((HELLO_METADATA, _hello(name="mallory")),),
     "it claims to be worker 'mallory' (id 0), which this job does not have"),
])
def test_streams_without_a_valid_proof_are_dropped_unread(workers, ports, tmp_path, case,
                                                          make_metadata, reason):
    grpc_port, _ = ports
    metadata = make_metadata()
    marker = str(tmp_path / "unpickled")
    before = workers.run(1, rejected)["stream"]
    code, details = _open_stream(grpc_port, metadata, [_evil_batch(marker)] * 3)
    assert code == grpc.StatusCode.UNAUTHENTICATED, (code, details)
    assert reason in details
    assert not os.path.exists(marker)
    assert workers.run(1, rejected)["stream"] == before + 1
    assert any(reason in line and "Nothing it sent was read" in line
               for line in workers.run(1, logs_with, "dropped an RPC stream"))
    assert workers.run(0, still_serving) is True


def test_a_replayed_proof_is_rejected(workers, ports, tmp_path):
    grpc_port, _ = ports
    hello = _hello()
    first = _open_stream(grpc_port, ((HELLO_METADATA, hello),), [])
    assert first[0] == "answered"  # the genuine proof opens a stream (the test knows the secret)
    marker = str(tmp_path / "unpickled")
    code, details = _open_stream(grpc_port, ((HELLO_METADATA, hello),), [_evil_batch(marker)])
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "replays a nonce already used" in details
    assert not os.path.exists(marker)
    assert workers.run(0, still_serving) is True


def test_a_malformed_message_from_an_authenticated_peer_is_dropped(workers, ports):
    import queue

    grpc_port, _ = ports
    garbage = b"\xff\xff\xff\xff not a batch"
    before = workers.run(1, rejected)["stream"]
    hello = _hello(message=True)
    out = queue.SimpleQueue()
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        call = channel.stream_stream(METHOD)(iter(out.get, None), timeout=20,
                                             metadata=((HELLO_METADATA, hello.SerializeToString()),))
        link = check_server_answer(TOKEN, hello, next(call), "w1")
        out.put(garbage + link.sealer.tag((garbage,)))  # a genuine peer's garbage
        deadline = time.monotonic() + 10
        while not workers.run(1, logs_with, "a malformed message of 16"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        out.put(None)
        call.cancel()
    assert workers.run(1, logs_with, "dropped a malformed message of 16 bytes from worker 'w0'")
    assert workers.run(1, rejected)["stream"] >= before + 1
    assert workers.run(0, still_serving) is True


def _closed_by_peer(sock: socket.socket) -> bool:
    """The peer closed the connection, after at most the handshake's REFUSED verdict."""
    sock.settimeout(5)
    try:
        got = sock.recv(64)
        if got == auth.REFUSED:
            got = sock.recv(64)
        return got == b""
    except ConnectionResetError:  # closed with our bytes unread
        return True


def test_the_data_port_drops_garbage_wrong_secrets_and_unknown_workers(workers, ports):
    _, data_port = ports
    before = workers.run(1, rejected)["data"]
    # Garbage instead of the handshake answer.
    with socket.create_connection(("127.0.0.1", data_port), timeout=5) as sock:
        sock.recv(auth.GREETING_BYTES)
        sock.sendall(os.urandom(64))
        assert _closed_by_peer(sock)  # closed without a proof
    # The wrong secret fails the mutual handshake.
    with socket.create_connection(("127.0.0.1", data_port), timeout=5) as sock:
        with pytest.raises(AuthenticationError):
            auth.client_handshake(sock, b"not the job's secret", "rpc-data")
    # The right secret but a worker id the job does not have.
    with socket.create_connection(("127.0.0.1", data_port), timeout=5) as sock:
        link = auth.client_handshake(sock, TOKEN, "rpc-data")
        claim = (99).to_bytes(4, "big")
        sock.sendall(claim + link.sealer.tag((claim,)))
        assert _closed_by_peer(sock)
    deadline = time.monotonic() + 10
    while workers.run(1, rejected)["data"] < before + 3:
        assert time.monotonic() < deadline, workers.run(1, rejected)
        time.sleep(0.05)
    # The garbage and the wrong secret both fail the proof; the first is logged at once, the
    # second is counted into the next rate-limited summary line.
    lines = workers.run(1, logs_with, "data channel turned away a connection from 127.0.0.1")
    assert any(line.endswith(": wrong secret") for line in lines), lines
    lines = workers.run(1, logs_with, "dropped a data-channel connection")
    assert any("claims worker id 99, which this job lacks" in line for line in lines), lines
    assert workers.run(0, still_serving) is True
