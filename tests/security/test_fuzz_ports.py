"""Every listening port of shoal under a bounded, seeded fuzz: random bytes, corrupted,
truncated, replayed and wrong-secret handshakes followed by harmful payloads, slow writes,
half-closes, resets, and (where the protocol allows) a right-secret client sending garbage.

For each port: the server survives and keeps serving, nothing without the secret is admitted or
executed, descriptors and threads return to their counts before the run, and a right-secret
client doing real work meanwhile is served within OP_BOUND_S per operation. `SHOAL_FUZZ_INPUTS`
(default 2000 per port) and `SHOAL_FUZZ_SEED` tune the run (see fuzz_support.py).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import random
import secrets
import socket
import struct
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest

from tests.support import fuzz_rpc_peer
from shoal import rpc_agent
from shoal.collectives.backends.tcp import wire
from shoal.collectives.store.server import TCPStoreServer
from shoal.collectives.store.wire import LENGTH, MAX_PAYLOAD, MIN_PAYLOAD, Op, encode, seal
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.store.hash import HashStore
from shoal.collectives.store.tcp import TCPStore
from shoal.core import auth
from shoal.core.auth import GREETING_TIMEOUT_S
from shoal.core.channel import TAG_BYTES
from shoal.elastic.metrics import MetricsServer
from tests.support.fuzz import (
    CONCURRENCY,
    INPUTS,
    IO_TIMEOUT_S,
    SEED,
    Probe,
    Served,
    Target,
    Usage,
    assert_back_to,
    flip_bits,
    fuzz_handshake_port,
    fuzz_length,
    play_inputs,
    wait_until,
)
from shoal.rpc_agent._generated import rpc_pb2
from shoal.rpc_agent.types import AUTH_WINDOW_S
from shoal.rpc_agent.transport.grpc import METHOD
from shoal.rpc_agent.transport.hello import (
    HELLO_METADATA,
    PURPOSE_CLIENT,
    PURPOSE_SERVER,
    hello_signing_bytes,
)
from shoal.rpc_agent.transport.stream import encode_batch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TOKEN = secrets.token_hex(32).encode()
SENTINEL = b"fuzz/sentinel"  # only unauthenticated inputs ever try to write it
logger = logging.getLogger(__name__)
OP_TIMEOUT_S = 5.0  # the timeout the right-secret clients pass (OP_BOUND_S is what they get)


def _thread_alive(name: str) -> bool:
    return any(t.name == name and t.is_alive() for t in threading.enumerate())


def _tcp(port: int, host: str = "127.0.0.1"):
    return lambda: socket.create_connection((host, port), timeout=IO_TIMEOUT_S)


# ----------------------------------------------------------------------------- the TCPStore

STORE_PROOF_DEADLINE_S = 1.0


def _store_payloads(rng: random.Random) -> bytes:
    """Requests that would write the sentinel key if the server ever took them."""
    frames = [
        encode(Op.SET, [SENTINEL, b"pwned"]),
        encode(Op.ADD, [SENTINEL, b"1"]),
        encode(Op.COMPARE_SET, [SENTINEL, b"", b"pwned"]),
        encode(Op.MULTI_SET, [SENTINEL, b"pwned"]),
        rng.randbytes(fuzz_length(rng, 256)),
    ]
    return b"".join(rng.choices(frames, k=rng.randint(1, 3)))


def _tagged(link, frame: bytes) -> bytes:
    """`frame` (a length prefix and a body) with its tag, the connection's next."""
    return b"".join(bytes(part) for part in seal(link.sealer, frame))


def _body(link, body: bytes) -> bytes:
    """A hand-made body, framed and tagged as a right-secret client frames and tags one."""
    return _tagged(link, LENGTH.pack(len(body) + TAG_BYTES) + body)


def _altered(frame: bytes, rng: random.Random) -> bytes:
    """`frame` with a bit flipped after its length prefix (body or tag)."""
    return frame[:LENGTH.size] + flip_bits(frame[LENGTH.size:], rng, 1)


def _malformed_store_request(rng: random.Random, link) -> tuple[bytes, bool]:
    """What a right-secret client with a broken encoder might send, every frame tagged under
    its connection's keys unless the case is about the tag, and whether the server must drop
    the connection for it at once (the rest need our EOF: a frame cut short, or a request
    parked on a key nobody sets)."""
    key = b"authed/%d" % rng.randrange(1000)
    body = encode(Op.SET, [key, b"v"])[LENGTH.size:]

    def replayed() -> bytes:
        frame = _tagged(link, encode(Op.PING, []))
        return frame + frame

    kinds = [
        (lambda: rng.randbytes(fuzz_length(rng)), False),
        (lambda: LENGTH.pack(rng.randint(0, MIN_PAYLOAD - 1)) + rng.randbytes(8), True),
        (lambda: LENGTH.pack(MAX_PAYLOAD + rng.randint(1, 1 << 20)) + rng.randbytes(64), True),
        (lambda: LENGTH.pack(0xFFFFFFFF), True),
        (lambda: _tagged(link, encode(rng.choice((0, 14, 99, 255)), [key])), True),  # unknown
        (lambda: _tagged(link, encode(Op.SET, [key])), True),  # too few arguments
        (lambda: _tagged(link, encode(Op.GET, [rng.choice((b"nan", b"-1", b"soon", b"")), key])),
         True),
        (lambda: _tagged(link, encode(Op.ADD, [key, rng.choice((b"one", b"1e3", b"\xff"))])),
         True),
        (lambda: _tagged(link, encode(Op.SET, [b"", b"v"])), True),  # an empty key
        (lambda: _tagged(link, encode(Op.SET, [key, b"v"]))[:-1], False),  # cut short
        (lambda: _body(link, body + b"\x00"), True),  # a trailing byte
        (lambda: _body(link, body[:5] + (1 << 30).to_bytes(4, "big") + body[9:]), True),  # overrun
        (lambda: _altered(_tagged(link, encode(Op.SET, [key, b"v"])), rng), True),
        (lambda: encode(Op.SET, [key, b"v"]) + rng.randbytes(TAG_BYTES), True),  # a guessed tag
        (replayed, True),
        # a parked wait, then more requests than the server queues behind it
        (lambda: _tagged(link, encode(Op.WAIT, [b"30", b"authed/never"]))
         + b"".join(_tagged(link, encode(Op.PING, [])) for _ in range(20)), False),
        (lambda: _tagged(link, encode(Op.GET, [b"30", b"authed/never"])), False),  # parked
    ]
    first, must_drop = rng.choice(kinds)
    data = first() + b"".join(rng.choice(kinds)[0]() for _ in range(rng.randint(0, 2)))
    return data, must_drop


def _store_authed(p: Probe, rng: random.Random) -> None:
    data, must_drop = _malformed_store_request(rng, p.link)
    p.send(data, pieces=rng.choice((1, 1, 3)))
    if not must_drop:
        p.half_close()
    p.drain()  # the server drops the connection: for the malformed request, or at our EOF


@pytest.fixture
def store_server():
    server = TCPStoreServer("127.0.0.1", 0, token=TOKEN,
                            handshake_timeout=STORE_PROOF_DEADLINE_S).start()
    yield server
    server.stop()


def test_store_port(store_server):
    server = store_server
    gate = server._gate
    target = Target("TCPStore", _tcp(server.port), TOKEN, "store", _store_payloads,
                    authed=_store_authed)
    with TCPStore("127.0.0.1", server.port, timeout=5, token=TOKEN) as client:
        counter = itertools.count()

        def set_get():
            n = next(counter)
            client.set(f"served/{n % 50}", str(n))
            assert client.get(f"served/{n % 50}", timeout=OP_TIMEOUT_S) == str(n).encode()

        with Served("a right-secret TCPStore client", set_get) as served:
            served.wait_ops(5)
            connections = server.num_connections
            before = Usage.of()
            rejected = sum(gate.rejections.values())
            report = fuzz_handshake_port(target, proof_deadline_s=STORE_PROOF_DEADLINE_S)
            wait_until(lambda: gate.num_pending == 0, "the store's pending handshakes drain")
            wait_until(lambda: server.num_connections == connections,
                       f"the store is back to its {connections} connection(s)")
            assert_back_to(before)
        report.check()
        served.check()
        assert sum(gate.rejections.values()) - rejected == report.unauthenticated, (
            f"the gate turned away {sum(gate.rejections.values()) - rejected} connections, "
            f"not the {report.unauthenticated} strangers ({dict(gate.rejections)})")
        assert not client.check([SENTINEL]), "an unauthenticated input wrote the sentinel key"
        assert _thread_alive(f"shoal-store-{server.port}") and _thread_alive("shoal-gate-store")
    with TCPStore("127.0.0.1", server.port, timeout=5, token=TOKEN) as fresh:
        fresh.set("after", "fuzz")
        assert fresh.get("after", timeout=OP_TIMEOUT_S) == b"fuzz"
    logger.info("%s", report.summary(served))


# ----------------------------------------------------------------------------- the mesh


def _form_pair(name: str) -> list[ProcessGroupTCP]:
    """Two ranks as threads of this process, over real sockets (as tests/unit/collectives)."""
    store = HashStore()
    pgs: list = [None, None]
    errors: list = []

    def join(rank: int) -> None:
        try:
            pgs[rank] = ProcessGroupTCP(store, rank, 2, timeout=10, name=name, token=TOKEN)
        except Exception as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and all(pgs), f"the pair did not form: {errors or pgs}"
    return pgs


class _AllReduces:
    """All-reduces on both ranks of a pair: rank 1 on a thread of its own fed by a queue."""

    def __init__(self, pgs):
        self._pgs = pgs
        self._jobs: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._n = 0
        self._rank1 = threading.Thread(target=self._serve_rank1, daemon=True, name="rank-1")
        self._rank1.start()

    def _serve_rank1(self) -> None:
        while (a := self._jobs.get()) is not None:
            try:
                self._pgs[1].all_reduce(a)
                self._done.put(a)
            except Exception as exc:  # noqa: BLE001  (raised on the caller's thread)
                self._done.put(exc)

    def __call__(self) -> None:
        self._n += 1
        size = 300_000 if self._n % 4 == 0 else 1000  # large ones take the shared-memory path
        a0, a1 = np.full(size, self._n, np.float32), np.full(size, 2.0, np.float32)
        self._jobs.put(a1)
        self._pgs[0].all_reduce(a0)
        got = self._done.get(timeout=OP_TIMEOUT_S)
        if isinstance(got, Exception):
            raise got
        for a in (a0, got):
            assert a[0] == a[-1] == self._n + 2.0, (self._n, a[0], a[-1])

    def close(self) -> None:
        self._jobs.put(None)
        self._rank1.join(OP_TIMEOUT_S)


@pytest.fixture
def pair():
    pgs = _form_pair("fuzz")
    reduces = _AllReduces(pgs)
    yield pgs, reduces
    reduces.close()
    for pg in pgs:
        pg.shutdown()


def _mesh_target(listener: str, pg: ProcessGroupTCP) -> Target:
    mesh = pg._mesh
    if listener == "unix":
        if mesh.unix_address is None:
            pytest.skip("this host gives the tcp backend no same-host Unix listener")

        def connect() -> socket.socket:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(IO_TIMEOUT_S)
            sock.connect(mesh.unix_address)
            return sock
    else:
        connect = _tcp(pg.address[1], pg.address[0])

    def hello(rng: random.Random) -> bytes:
        return wire.HELLO.pack(wire.HELLO_MAGIC, mesh._group_id, 1, 0,
                               rng.choice(wire.CHANNELS))

    def payloads(rng: random.Random) -> bytes:
        """A hello impersonating rank 1, then an abort that would fail the group (with tags
        nobody made)."""
        body = b'{"kind": "error", "cause": "fuzz"}'
        head = wire.CONTROL_HEADER.pack(wire.CONTROL_MAGIC, wire.KIND_ABORT, 0, 0, len(body))
        abort = head + bytes(TAG_BYTES) + body + bytes(TAG_BYTES)
        return hello(rng) + bytes(TAG_BYTES) + rng.choice((abort, rng.randbytes(fuzz_length(rng, 512))))

    def authed(p: Probe, rng: random.Random) -> None:
        """A right-secret peer whose hello is garbage, cut short, for a full slot or for no
        slot at all (tagged with the connection's keys), or carries a tag they did not make."""
        def tagged(frame: bytes) -> bytes:
            return frame + p.link.sealer.tag((frame,))

        data = rng.choice((
            lambda: tagged(rng.randbytes(wire.HELLO.size)),
            lambda: tagged(hello(rng))[:rng.randrange(wire.HELLO.size + TAG_BYTES)],
            lambda: tagged(hello(rng)),
            lambda: hello(rng) + rng.randbytes(TAG_BYTES),
            lambda: tagged(wire.HELLO.pack(wire.HELLO_MAGIC, rng.randbytes(8), 1, 0, 0)),
            lambda: tagged(wire.HELLO.pack(wire.HELLO_MAGIC, mesh._group_id, rng.randint(-5, 5),
                                           rng.randint(-5, 5), rng.randrange(256))),
        ))()
        p.send(data)
        if len(data) < wire.HELLO.size + TAG_BYTES:
            p.half_close()  # a short hello is dropped at our EOF, a whole one at once
        p.drain()

    return Target(f"collectives mesh ({listener})", connect, TOKEN, "collectives", payloads,
                  authed=authed, authed_share=0.05)


@pytest.mark.parametrize("listener", ["tcp", "unix"])
def test_collectives_mesh_port(pair, listener):
    pgs, reduces = pair
    target = _mesh_target(listener, pgs[0])
    gate = pgs[0]._mesh._gate
    with Served("all_reduce on the 2-rank tcp group", reduces) as served:
        served.wait_ops(5)
        before = Usage.of()
        rejected = sum(gate.rejections.values())
        report = fuzz_handshake_port(target, proof_deadline_s=GREETING_TIMEOUT_S)
        wait_until(lambda: gate.num_pending == 0, "the mesh's pending handshakes drain")
        assert_back_to(before)
    report.check()
    served.check()
    assert sum(gate.rejections.values()) - rejected == report.unauthenticated, (
        f"the gate turned away {sum(gate.rejections.values()) - rejected} connections, not "
        f"the {report.unauthenticated} strangers ({dict(gate.rejections)})")
    assert all(pg.failure is None for pg in pgs), [pg.failure for pg in pgs]
    assert _thread_alive("shoal-gate-collectives")
    assert _thread_alive("shoal-pg-fuzz-r0-control")
    reduces()  # still serving after the run
    logger.info("%s", report.summary(served))


# ----------------------------------------------------------------------------- RPC


@pytest.fixture(scope="module")
def rpc_world():
    """This process as RPC worker w0 and a spawned w1 whose ports the tests attack."""
    ctx = multiprocessing.get_context("spawn")
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=30, wait_for_workers=False,
                     token=TOKEN)
    stop, results = ctx.Event(), ctx.Queue()
    peer = ctx.Process(target=fuzz_rpc_peer.peer_main, args=(store.port, TOKEN, stop, results),
                       name="fuzz-rpc-w1", daemon=True)
    peer.start()
    initialized = False
    try:
        rpc_agent.init_rpc("w0", 0, 2, rpc_agent.RpcBackendOptions(
            store=store, token=TOKEN, rpc_timeout=10, init_timeout=30))
        initialized = True
        status, detail = results.get(timeout=30)
        assert status == "ready", f"RPC worker w1 failed to start:\n{detail}"
        grpc_port, data_port = rpc_agent.rpc_sync("w1", fuzz_rpc_peer.ports, timeout=10)
        _W1_INCARNATION[:] = [rpc_agent.rpc_sync("w1", fuzz_rpc_peer.incarnation, timeout=10)]
        yield {"pid": detail, "grpc_port": grpc_port, "data_port": data_port}
    finally:
        stop.set()  # both workers shut down together: a graceful shutdown waits for the other
        if initialized:
            rpc_agent.shutdown(timeout=10)
        peer.join(30)
        if peer.is_alive():
            peer.kill()
            peer.join(5)
        store.close()


class _Echoes:
    """rpc_sync to w1: small arguments on the gRPC stream, every other call an array large
    enough to travel on the data channel."""

    def __init__(self):
        self._n = 0
        self._big = np.arange(64 * 1024, dtype=np.float32)  # 256 KiB: above the threshold

    def __call__(self) -> None:
        self._n += 1
        if self._n % 2:
            assert rpc_agent.rpc_sync("w1", fuzz_rpc_peer.echo, (self._n,),
                                      timeout=OP_TIMEOUT_S) == self._n
        else:
            got = rpc_agent.rpc_sync("w1", fuzz_rpc_peer.echo, (self._big,), timeout=OP_TIMEOUT_S)
            np.testing.assert_array_equal(got, self._big)


def _data_channel_target(port: int) -> Target:
    header = struct.Struct("!QQ")

    def payloads(rng: random.Random) -> bytes:
        """Worker w0's id and a transfer that would land in w1's buffers if admitted."""
        body = rng.randbytes(fuzz_length(rng, 1024))
        return (rng.choice((0, 1)).to_bytes(4, "big") + header.pack(rng.getrandbits(64),
                                                                    len(body)) + body)

    def authed(p: Probe, rng: random.Random) -> None:
        """A right-secret peer claiming a worker id the job lacks (its claim tagged with the
        connection's keys), or sending untagged bytes: dropped before any data."""
        worker_id = rng.choice((2, 3, 99, -1, 2**31 - 1, -2**31))
        claim = worker_id.to_bytes(4, "big", signed=True)
        if rng.random() < 0.5:
            claim += p.link.sealer.tag((claim,))
        else:  # untagged: at least a whole frame's bytes, so the check runs at once
            claim += rng.randbytes(16)
        p.send(claim + rng.randbytes(fuzz_length(rng, 256)))
        p.drain()

    return Target("RPC data channel", _tcp(port), TOKEN, "rpc-data", payloads, authed=authed,
                  authed_share=0.05)


def test_rpc_data_channel_port(rpc_world):
    pid = rpc_world["pid"]
    target = _data_channel_target(rpc_world["data_port"])
    with Served("rpc_sync to w1 (stream and data channel)", _Echoes()) as served:
        served.wait_ops(10)
        before = Usage.of(pid)
        _, rejected = rpc_agent.rpc_sync("w1", fuzz_rpc_peer.data_gate, timeout=OP_TIMEOUT_S)
        report = fuzz_handshake_port(target, proof_deadline_s=GREETING_TIMEOUT_S)
        wait_until(lambda: rpc_agent.rpc_sync("w1", fuzz_rpc_peer.data_gate,
                                              timeout=OP_TIMEOUT_S)[0] == 0,
                   "w1's data channel has no pending handshakes")
        assert_back_to(before, pid)
    report.check()
    served.check()
    _, after = rpc_agent.rpc_sync("w1", fuzz_rpc_peer.data_gate, timeout=OP_TIMEOUT_S)
    assert after - rejected == report.unauthenticated, (
        f"w1's data channel turned away {after - rejected} connections, not the "
        f"{report.unauthenticated} strangers")
    _Echoes()()
    logger.info("%s", report.summary(served))


class _Touch:
    """Unpickling this creates a directory: proof that a payload was (not) unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


# w1's incarnation nonce (rpc_world sets it): a hello to w1 must name it.
_W1_INCARNATION: list = []


def _hello(token: bytes = TOKEN, name: str = "w0", worker_id: int = 0, to_id: int = 1,
           timestamp: float | None = None, nonce: bytes | None = None,
           purpose: str = PURPOSE_CLIENT, incarnation: bytes | None = None) -> bytes:
    hello = rpc_pb2.Hello(name=name, id=worker_id, to_id=to_id,
                          timestamp=time.time() if timestamp is None else timestamp,
                          nonce=secrets.token_bytes(32) if nonce is None else nonce,
                          server_nonce=_W1_INCARNATION[0] if incarnation is None else incarnation)
    hello.proof = auth.sign(token, purpose, hello_signing_bytes(hello))
    return hello.SerializeToString()


def _hello_variant(rng: random.Random, replayed: bytes) -> tuple[str, tuple]:
    """A metadata set that must not open a stream, and its name."""
    window = AUTH_WINDOW_S + rng.uniform(1, 1e6)
    bad_nonce = rng.randbytes(rng.choice((0, 1, 16, 31, 33, 64)))
    variants = {
        "no hello": lambda: None,
        "random hello bytes": lambda: rng.randbytes(fuzz_length(rng, 1024)),
        "a hello with another secret": lambda: _hello(token=rng.randbytes(32)),
        "a hello with flipped bits": lambda: flip_bits(_hello(), rng, rng.randint(1, 3)),
        "an expired hello": lambda: _hello(timestamp=time.time() - window),
        "a hello from the future": lambda: _hello(timestamp=time.time() + window),
        "a replayed hello": lambda: replayed,
        "a hello for another worker": lambda: _hello(to_id=rng.choice((0, 2, -1, 7))),
        "a hello for another incarnation of the worker": lambda: _hello(
            incarnation=rng.randbytes(rng.choice((0, 32)))),
        "a hello naming a worker the job lacks": lambda: _hello(
            **rng.choice(({"name": "mallory"}, {"name": "w1", "worker_id": 0},
                          {"name": "w0", "worker_id": 1}, {"name": "", "worker_id": 5}))),
        "a hello with a bad nonce": lambda: _hello(nonce=bad_nonce),
        "a hello signed for the server's purpose": lambda: _hello(purpose=PURPOSE_SERVER),
    }
    name = rng.choice(list(variants))
    hello = variants[name]()
    metadata = [] if hello is None else [(HELLO_METADATA, hello)]
    if rng.random() < 0.2:  # the proof in a text header, or a stale proof before the bad one
        metadata.insert(0, rng.choice((("shoal-hello", "w0"), (HELLO_METADATA, replayed))))
    if rng.random() < 0.3:
        metadata.append((f"x-fuzz-{rng.randrange(100)}", rng.randbytes(8).hex()))
    return name, tuple(metadata)


def _evil_batches(rng: random.Random, markers: dict) -> list[bytes]:
    """Messages that create a marker directory if w1 unpickles or runs them."""
    trap = pickle.dumps((_Touch(markers["unpickled"]), (), None), protocol=5)
    call = pickle.dumps((os.mkdir, (markers["called"],), None), protocol=5)
    kinds = [
        lambda: encode_batch([rpc_pb2.Frame(kind=rpc_pb2.CALL, request_id=rng.getrandbits(32),
                                            function="x", payload=trap).SerializeToString()]),
        lambda: encode_batch([rpc_pb2.Frame(kind=rng.choice((rpc_pb2.CALL, rpc_pb2.REMOTE_CALL)),
                                            request_id=rng.getrandbits(32), function="os.mkdir",
                                            payload=call).SerializeToString()]),
        lambda: rng.randbytes(fuzz_length(rng)),
    ]
    return [rng.choice(kinds)() for _ in range(rng.randint(0, 3))]


_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _raw_grpc_bytes(rng: random.Random) -> tuple[str, bytes]:
    settings = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
    kinds = {
        "random bytes": lambda: rng.randbytes(fuzz_length(rng)),
        "the HTTP/2 preface, then random bytes": lambda: _HTTP2_PREFACE + rng.randbytes(
            fuzz_length(rng)),
        "HTTP/2 settings, then random frames": lambda: _HTTP2_PREFACE + settings + b"".join(
            rng.randint(0, 64).to_bytes(3, "big") + bytes([rng.randrange(10), rng.randrange(256)])
            + rng.randbytes(4) + rng.randbytes(rng.randint(0, 64)) for _ in range(3)),
        "an HTTP/1.1 request": lambda: b"POST /shoal.rpc.Agent/Stream HTTP/1.1\r\nHost: x\r\n"
                                       b"Content-Length: 5\r\n\r\n" + rng.randbytes(5),
    }
    name = rng.choice(list(kinds))
    return name, kinds[name]()


def _play_grpc(rng: random.Random, port: int, channels: list, replayed: bytes,
               markers: dict) -> str:
    if rng.random() < 0.3:  # raw bytes, below gRPC
        case, data = _raw_grpc_bytes(rng)
        p = Probe(socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S))
        try:
            p.send(data, pieces=rng.choice((1, 1, 4)))
            how = rng.choice(("close", "reset", "half-close"))
            if how == "half-close":
                p.half_close()
                p.drain()
            elif how == "reset":
                p.reset()
        finally:
            p.close()
        return f"raw: {case}"
    case, metadata = _hello_variant(rng, replayed)
    call = rng.choice(channels).stream_stream(METHOD)(
        iter(_evil_batches(rng, markers)), metadata=metadata, timeout=IO_TIMEOUT_S)
    try:
        first = next(call)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, (
            f"{case}: the stream ended with {exc.code()} ({exc.details()}), not UNAUTHENTICATED")
        return case
    call.cancel()
    raise AssertionError(f"{case} opened a stream: w1 answered {first[:64]!r} ({metadata!r})")


def _open_once(port: int, hello: bytes) -> bytes:
    """Open a stream with a genuine hello and return w1's first message (its proof)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        release = threading.Event()

        def requests():
            release.wait(OP_TIMEOUT_S)
            return
            yield  # a generator that sends nothing

        call = channel.stream_stream(METHOD)(requests(), metadata=((HELLO_METADATA, hello),),
                                             timeout=OP_TIMEOUT_S)
        first = next(call)
        release.set()
        call.cancel()
        return first


def test_rpc_grpc_port(rpc_world, tmp_path):
    pid, port = rpc_world["pid"], rpc_world["grpc_port"]
    markers = {"unpickled": str(tmp_path / "unpickled"), "called": str(tmp_path / "called")}
    replayed = _hello()
    assert _open_once(port, replayed), "a genuine hello did not open a stream"
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for _ in range(4)]
    try:
        with Served("rpc_sync to w1 (stream and data channel)", _Echoes()) as served:
            served.wait_ops(10)
            before = Usage.of(pid)
            rejected = rpc_agent.rpc_sync("w1", fuzz_rpc_peer.rejected_streams,
                                          timeout=OP_TIMEOUT_S)
            report = play_inputs("RPC gRPC port", INPUTS, SEED, lambda i, rng: _play_grpc(
                rng, port, channels, replayed, markers))
            assert_back_to(before, pid)
    finally:
        for channel in channels:
            channel.close()
    report.check()
    served.check()
    calls = sum(n for case, n in report.by_case.items() if not case.startswith("raw: "))
    after = rpc_agent.rpc_sync("w1", fuzz_rpc_peer.rejected_streams, timeout=OP_TIMEOUT_S)
    assert after - rejected == calls, (
        f"w1 dropped {after - rejected:g} streams unread, not the {calls} fuzz streams")
    assert not os.path.exists(markers["unpickled"]), "w1 unpickled a fuzz payload"
    assert not os.path.exists(markers["called"]), "w1 ran a fuzz call"
    _Echoes()()
    logger.info("%s", report.summary(served))


# A NaN timestamp used to pass the freshness check (abs(now - nan) > window is False), so the
# stream opened and, once its nonce left the seen-nonce table, the same hello opened streams
# again: it never expired.
def test_rpc_hello_with_a_nan_timestamp_is_refused(rpc_world):
    with pytest.raises(grpc.RpcError) as caught:
        _open_once(rpc_world["grpc_port"], _hello(timestamp=float("nan")))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, caught.value.details()


# ----------------------------------------------------------------------------- metrics HTTP

_SCRAPE = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n\r\n"


def _http_request(rng: random.Random) -> tuple[str, bytes]:
    """A request head as a broken scraper, a port scanner or an attacker might send it."""
    method = rng.choice((b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"CONNECT", b"TRACE",
                         b"OPTIONS", b"G\x00T", rng.randbytes(rng.randint(0, 12)), b""))
    path = rng.choice((b"/metrics", b"/", b"*", b"/metrics?name[]=x", b"//../etc/passwd",
                       b"/%00%ff", b"http://evil/", b"/" + b"a" * rng.randint(1, 20000),
                       rng.randbytes(rng.randint(0, 64))))
    kinds = {
        "random bytes": lambda: rng.randbytes(fuzz_length(rng)),
        "a scrape cut short": lambda: _SCRAPE[:rng.randrange(len(_SCRAPE))],
        "a bad method or path": lambda: method + b" " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        "an oversized head": lambda: _SCRAPE[:-2] + b"X-Pad: " + b"a" * rng.randint(8000, 70000)
        + b"\r\n\r\n",
        "many headers": lambda: _SCRAPE[:-2] + b"".join(
            b"X-%d: y\r\n" % i for i in range(rng.randint(50, 400))) + b"\r\n",
        "bad framing": lambda: rng.choice((
            b"GET /metrics HTTP/9.9\r\n\r\n", b"GET /metrics\r\n\r\n",
            _SCRAPE[:-2] + b"Content-Length: -1\r\n\r\n",
            _SCRAPE[:-2] + b"Content-Length: 99999999999\r\n\r\n" + rng.randbytes(100),
            _SCRAPE[:-2] + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
            _SCRAPE[:-2] + b"Accept-Encoding: gzip;q=" + rng.randbytes(20) + b"\r\n\r\n",
            b"GET /metrics HTTP/1.1\n\n", b"\r\n" * rng.randint(1, 2000))),
        "pipelined scrapes": lambda: _SCRAPE * rng.randint(2, 20),
        "a scrape": lambda: _SCRAPE,
    }
    name = rng.choice(list(kinds))
    return name, kinds[name]()


def _play_http(rng: random.Random, port: int) -> str:
    case, data = _http_request(rng)
    p = Probe(socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S))
    try:
        if rng.random() < 0.15:  # slow: the head dribbles in
            p.send(data, pieces=rng.randint(2, 10), pause=rng.choice((0.001, 0.005)))
        else:
            p.send(data)
        how = "half-close" if case == "a scrape" else rng.choice(("close", "reset", "half-close"))
        if how == "half-close":
            p.half_close()
            p.drain()  # the server answers, or not, and closes: never holds the connection
            # What a malformed head gets back (a 400, a bare HTTP/0.9 error page) is the HTTP
            # library's business; a well-formed scrape must be answered.
            reply = bytes(p.after)
            if case == "a scrape" and not reply.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")):
                raise AssertionError(f"a well-formed scrape got {reply[:80]!r} "
                                     f"({p.broken or 'then the server closed'})")
        elif how == "reset":
            p.reset()
    finally:
        p.close()
    return case


def _scrape(url: str) -> None:
    with urllib.request.urlopen(url, timeout=OP_TIMEOUT_S) as reply:
        assert reply.status == 200 and b"shoal_elastic_restarts_total" in reply.read()


@pytest.fixture
def metrics_server():
    server = MetricsServer("127.0.0.1", 0, None)
    yield server
    server.stop()


def test_metrics_port(metrics_server):
    url = metrics_server.url
    # Bounded pools (a server may answer scrapes on a small thread pool) fill up first, so that
    # what stays above the count after the fuzzing is a leak, not a pool.
    warm = [threading.Thread(target=_scrape, args=(url,)) for _ in range(CONCURRENCY)]
    for t in warm:
        t.start()
    for t in warm:
        t.join(OP_TIMEOUT_S)
    with Served("a Prometheus-style scraper", lambda: _scrape(url)) as served:
        served.wait_ops(5)
        before = Usage.of()
        report = play_inputs("metrics HTTP port", INPUTS, SEED,
                             lambda i, rng: _play_http(rng, metrics_server.port))
        assert_back_to(before)
    report.check()
    served.check()
    _scrape(url)
    logger.info("%s", report.summary(served))
