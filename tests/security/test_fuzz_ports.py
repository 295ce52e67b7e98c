"""Every listening port of shoal under a bounded, seeded fuzz: random bytes, corrupted,
truncated, replayed and wrong-secret handshakes followed by harmful payloads, slow writes,
half-closes, resets, and (where the protocol allows) a right-secret client sending garbage.

For each port: the server survives and keeps serving, nothing without the secret is admitted or
executed, descriptors and threads return to their counts before the run, and a right-secret
client doing real work meanwhile is served within OP_BOUND_S per operation. `SHOAL_FUZZ_INPUTS`
(default 2000 per port) and `SHOAL_FUZZ_SEED` tune the run (see fuzz_support.py).
"""

from __future__ import annotations

import queue
import random
import secrets
import socket
import threading

import numpy as np
import pytest

from collectives import _pg_wire as wire
from collectives._store_server import TCPStoreServer
from collectives._store_wire import HEAD, LENGTH, MAX_FRAME_BYTES, Op, encode
from collectives.pg_tcp import ProcessGroupTCP
from collectives.store_hash import HashStore
from collectives.store_tcp import TCPStore
from core.auth import GREETING_TIMEOUT_S
from fuzz_support import (
    IO_TIMEOUT_S,
    Probe,
    Served,
    Target,
    Usage,
    assert_back_to,
    fuzz_handshake_port,
    fuzz_length,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TOKEN = secrets.token_hex(32).encode()
SENTINEL = b"fuzz/sentinel"  # only unauthenticated inputs ever try to write it
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


def _malformed_store_traffic(rng: random.Random) -> bytes:
    """What a right-secret client with a broken encoder might send."""
    key = b"authed/%d" % rng.randrange(1000)
    kinds = [
        lambda: rng.randbytes(fuzz_length(rng)),
        lambda: LENGTH.pack(rng.randint(0, HEAD.size - 1)) + rng.randbytes(8),
        lambda: LENGTH.pack(MAX_FRAME_BYTES + rng.randint(1, 1 << 20)) + rng.randbytes(64),
        lambda: LENGTH.pack(0xFFFFFFFF),
        lambda: encode(rng.choice((0, 14, 99, 255)), [key]),  # unknown request codes
        lambda: encode(Op.SET, [key]),  # too few arguments
        lambda: encode(Op.GET, [rng.choice((b"nan", b"-1", b"soon", b"")), key]),
        lambda: encode(Op.ADD, [key, rng.choice((b"one", b"1e3", b"\xff"))]),
        lambda: encode(Op.SET, [b"", b"v"]),  # an empty key
        lambda: encode(Op.SET, [key, b"v"])[:-1] + b"",  # truncated, then EOF
        lambda: encode(Op.SET, [key, b"v"]) + b"\x00",  # trailing garbage
        lambda: (lambda f: f[:9] + (1 << 30).to_bytes(4, "big") + f[13:])(
            encode(Op.SET, [key, b"v"])),  # an argument overrunning the frame
        # a parked wait, then more requests than the server queues behind it
        lambda: encode(Op.WAIT, [b"30", b"authed/never"]) + encode(Op.PING, []) * 20,
        lambda: encode(Op.GET, [b"30", b"authed/never"]),  # parked, then the client goes
    ]
    return b"".join(rng.choice(kinds)() for _ in range(rng.randint(1, 3)))


def _store_authed(p: Probe, rng: random.Random) -> None:
    p.send(_malformed_store_traffic(rng), pieces=rng.choice((1, 1, 3)))
    p.half_close()
    p.drain()  # the server answers what it can and drops the connection at our EOF (or before)


@pytest.fixture
def store_server():
    server = TCPStoreServer("127.0.0.1", 0, token=TOKEN,
                            handshake_timeout=STORE_PROOF_DEADLINE_S).start()
    yield server
    server.stop()


def test_store_port(store_server):
    server = store_server
    gate = server._gate  # noqa: SLF001  (pending handshakes and rejection counts)
    target = Target("TCPStore", _tcp(server.port), TOKEN, "store", _store_payloads,
                    authed=_store_authed)
    with TCPStore("127.0.0.1", server.port, timeout=5, token=TOKEN) as client:
        counter = iter(range(1 << 30))

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
                       f"the store is back to {connections} connection(s) "
                       f"(has {server.num_connections})")
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
    print(f"{report.port}: {report.inputs} inputs in {report.seconds:.1f}s; "
          f"{dict(report.by_case)}; {len(served.latencies)} served operations, slowest "
          f"{max(served.latencies) * 1e3:.0f} ms")



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
    mesh = pg._mesh  # noqa: SLF001  (the group id and the Unix address)
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
        return wire.HELLO.pack(wire.HELLO_MAGIC, mesh._group_id, 1, 0,  # noqa: SLF001
                               rng.choice(wire.CHANNELS))

    def payloads(rng: random.Random) -> bytes:
        """A hello impersonating rank 1, then an abort that would fail the group."""
        abort = wire.control_frame(wire.KIND_ABORT, 0, b'{"kind": "error", "cause": "fuzz"}')
        return hello(rng) + rng.choice((abort, rng.randbytes(fuzz_length(rng, 512))))

    def authed(p: Probe, rng: random.Random) -> None:
        """A right-secret peer with a hello that is garbage, cut short, or for a full slot."""
        data = rng.choice((
            lambda: rng.randbytes(wire.HELLO.size),
            lambda: hello(rng)[:rng.randrange(wire.HELLO.size)],
            lambda: hello(rng),
            lambda: wire.HELLO.pack(wire.HELLO_MAGIC, rng.randbytes(8), 1, 0, 0),
            lambda: wire.HELLO.pack(wire.HELLO_MAGIC, mesh._group_id,  # noqa: SLF001
                                    rng.randint(-5, 5), rng.randint(-5, 5), rng.randrange(256)),
        ))()
        p.send(data)
        p.half_close()
        p.drain()

    return Target(f"collectives mesh ({listener})", connect, TOKEN, "collectives", payloads,
                  authed=authed, authed_share=0.05)


@pytest.mark.parametrize("listener", ["tcp", "unix"])
def test_collectives_mesh_port(pair, listener):
    pgs, reduces = pair
    target = _mesh_target(listener, pgs[0])
    gate = pgs[0]._mesh._gate  # noqa: SLF001
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
    print(f"{report.port}: {report.inputs} inputs in {report.seconds:.1f}s; "
          f"{len(served.latencies)} all_reduces, slowest {max(served.latencies) * 1e3:.0f} ms")
