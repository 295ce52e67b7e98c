"""The workers' store door (MASTER_PORT of `shoal run`, elastic/agent/store_door.py) under a
seeded fuzz and a flood: it answers torch's protocol to anyone, so bad input must end only the
connection that sent it, and one address must not crowd out the others.

Throughout, a right-secret shoal client and a torch-protocol client (hand-made, the bytes torch's
C++ client sends) keep working, each operation within OP_BOUND_S, and the door's descriptors
return to their count before the run. `SHOAL_FUZZ_INPUTS` scales the run (default 200 here).
"""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time

import pytest

from shoal.collectives.store.tcp import TCPStore
from shoal.elastic.agent.store_door import MAX_UNPROVEN_PER_SOURCE, WorkerStoreDoor
from shoal.elastic.agent.torch_store import VALIDATION_MAGIC, Query

TOKEN = "door-fuzz-" + "f" * 32
SEED = int(os.environ.get("SHOAL_FUZZ_SEED", "3605"))
INPUTS = int(os.environ.get("SHOAL_FUZZ_INPUTS", "200"))
OP_BOUND_S = 5.0  # a served client's operation, on a loaded 2-core machine
VALIDATE = bytes([Query.VALIDATE]) + struct.pack("<I", VALIDATION_MAGIC)


def _s(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


class TorchWireClient:
    """The bytes torch's TCPStore client sends for set and get, over a plain socket."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=OP_BOUND_S)
        self.sock.sendall(VALIDATE)

    def set_get(self, key: bytes, value: bytes) -> bytes:
        self.sock.sendall(bytes([Query.SET]) + _s(key) + _s(value)
                          + bytes([Query.GET]) + _s(key))
        size = struct.unpack("<Q", self._exact(8))[0]
        return self._exact(size)

    def _exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("the door closed a good client's connection")
            out += chunk
        return out

    def close(self) -> None:
        self.sock.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _wait_fds(target: int, what: str) -> None:
    deadline = time.monotonic() + 10
    while _open_fds() > target:
        assert time.monotonic() < deadline, f"{what}: {_open_fds()} descriptors, not {target}"
        time.sleep(0.05)


class Served:
    """Right-secret shoal and torch clients working in a thread; records the slowest op."""

    def __init__(self, port: int):
        self.shoal = TCPStore("127.0.0.1", port, timeout=OP_BOUND_S, token=TOKEN)
        self.torch = TorchWireClient(port)
        self.errors: list[BaseException] = []
        self.slowest = 0.0
        self.ops = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            started = time.monotonic()
            try:
                self.shoal.set("served", str(n))
                assert self.shoal.get("served", OP_BOUND_S) == str(n).encode()
                assert self.torch.set_get(b"/served", b"%d" % n) == b"%d" % n
            except BaseException as exc:  # noqa: BLE001  (reported by check())
                self.errors.append(exc)
                return
            self.slowest = max(self.slowest, time.monotonic() - started)
            self.ops += 1

    def __enter__(self) -> "Served":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(OP_BOUND_S * 3)
        self.shoal.close()
        self.torch.close()

    def check(self) -> None:
        assert not self.errors, f"a right-secret client failed: {self.errors[0]!r}"
        assert self.ops > 0, "the right-secret clients never got an operation through"
        assert self.slowest < OP_BOUND_S, f"an operation took {self.slowest:.1f}s"


def _fuzz_input(rng: random.Random) -> bytes:
    """One hostile or broken input: random bytes, torch commands with random fields, lengths
    over torch's limits, commands cut short."""
    key = b"/fuzz/%d" % rng.randrange(100)
    command = rng.choice([
        lambda: rng.randbytes(rng.randint(1, 300)),
        lambda: bytes([rng.randrange(256)]) + rng.randbytes(rng.randint(0, 40)),
        lambda: bytes([Query.SET]) + _s(key) + struct.pack("<Q", rng.choice((1 << 24, 1 << 62))),
        lambda: bytes([Query.WAIT]) + struct.pack("<Q", rng.choice((1, 1 << 20))) + _s(key),
        lambda: bytes([Query.ADD]) + _s(key) + struct.pack("<q", rng.randrange(-9, 9)),
        lambda: bytes([Query.QUEUE_POP]) + _s(key),
        lambda: bytes([Query.MULTI_SET]) + struct.pack("<Q", 2) + _s(key) + _s(b"v"),  # short
        lambda: bytes([Query.BARRIER]) + _s(key) + struct.pack("<q", 1 << 40),
        lambda: bytes([rng.randrange(19, 256)]),
    ])()
    prefix = VALIDATE if rng.random() < 0.7 else b""
    return prefix + command


def _send(port: int, data: bytes, rng: random.Random) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        try:
            for i in range(0, len(data), rng.choice((1, 7, len(data) or 1))):
                sock.sendall(data[i:i + 7] if i + 7 < len(data) else data[i:])
            if rng.random() < 0.5:
                sock.shutdown(socket.SHUT_WR)
            sock.settimeout(0.1)
            sock.recv(1024)
        except OSError:
            pass  # the door dropped us, as it should for most inputs


@pytest.fixture
def door():
    d = WorkerStoreDoor("127.0.0.1", TOKEN)
    yield d
    d.close()


def test_fuzzed_inputs_end_only_their_own_connection(door):
    rng = random.Random(SEED)
    baseline = _open_fds()
    with Served(door.port) as served:
        for _ in range(INPUTS):
            _send(door.port, _fuzz_input(rng), rng)
    served.check()
    _wait_fds(baseline, "the door's descriptors after the fuzz")


def test_a_flood_from_one_address_leaves_room_for_the_others(door):
    baseline = _open_fds()
    flood = []
    try:
        with Served(door.port) as served:
            for _ in range(MAX_UNPROVEN_PER_SOURCE + 40):
                sock = socket.socket()
                sock.bind(("127.0.0.2", 0))  # another loopback address: another source
                sock.connect(("127.0.0.1", door.port))
                flood.append(sock)
            time.sleep(0.5)  # the flood sits silent past the sniff and is relayed
            # The right-secret clients still connect (from 127.0.0.1) and are served.
            late = TCPStore("127.0.0.1", door.port, timeout=OP_BOUND_S, token=TOKEN)
            late.set("late", "1")
            late.close()
            turned_away = 0
            for sock in flood:
                sock.settimeout(5)
                try:
                    if sock.recv(64) == b"":
                        turned_away += 1
                except OSError:
                    turned_away += 1
            # Over the cap, the door closed them at once; the others got shoal's greeting.
            assert turned_away >= 40, turned_away
        served.check()
    finally:
        for sock in flood:
            sock.close()
    _wait_fds(baseline, "the door's descriptors after the flood")
