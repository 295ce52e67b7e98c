"""Building blocks of the port fuzz tests: seeded hostile inputs for the ports that run
`core.auth`'s handshake, a driver that plays them over real sockets with bounded concurrency, a
loop that keeps a right-secret client busy meanwhile, and a process's descriptor and thread
counts.

Every input is drawn from its own `random.Random` seeded by (seed, port, index), so a failure
names an input that replays the same way whatever the scheduling (only the server's nonces and
the clock differ between runs): `SHOAL_FUZZ_SEED` picks the seed, `SHOAL_FUZZ_INPUTS` the number
of inputs per port.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import hmac
import os
import random
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from shoal.core import channel
from shoal.core.auth import DIGEST_BYTES, GREETING_BYTES, MAGIC, NONCE_BYTES, REFUSED, REPLY_BYTES


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    value = int(raw)
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}.")
    return value


# Inputs per port (CI runs the default; set SHOAL_FUZZ_INPUTS=20000 for a longer run).
INPUTS = _env_int("SHOAL_FUZZ_INPUTS", 2000)
SEED = _env_int("SHOAL_FUZZ_SEED", 20240917)
# Sockets open at once per port: enough to overlap the server's work, far below its bounds.
CONCURRENCY = 16
# Every socket operation of the fuzzer gives up after this long.
IO_TIMEOUT_S = 5.0
# Every operation of the right-secret client must finish within this, during the fuzzing too.
OP_BOUND_S = 2.0
# Descriptors and threads a server may hold above its count before the fuzzing (lazy pools).
TOLERANCE = 4
# Connections that send nothing and wait for the server to give up on them (a few per port:
# each holds a fuzzer thread for the server's whole proof deadline).
SILENT_HOLDERS = 4


# ----------------------------------------------------------------------------- the handshake


# The channel mode a server greets with when SHOAL_ENCRYPT is off: frames tagged, not encrypted.
MODE = b"t"


def client_reply(token: bytes, purpose: str, s_nonce: bytes,
                 c_nonce: Optional[bytes] = None, mode: bytes = MODE) -> bytes:
    """The 64-byte answer to a greeting (written from the protocol in core/auth.py, not by
    calling it, so that the test checks the protocol rather than the code against itself)."""
    c_nonce = secrets.token_bytes(NONCE_BYTES) if c_nonce is None else c_nonce
    mac = hmac.new(token, b"c" + purpose.encode() + mode + s_nonce + c_nonce,
                   hashlib.sha256).digest()
    return c_nonce + mac


def server_proof(token: bytes, purpose: str, s_nonce: bytes, c_nonce: bytes,
                 mode: bytes = MODE) -> bytes:
    """The verdict a server holding `token` sends a client that proved it."""
    return hmac.new(token, b"s" + purpose.encode() + mode + c_nonce + s_nonce,
                    hashlib.sha256).digest()


def flip_bits(data: bytes, rng: random.Random, count: int) -> bytes:
    """`data` with `count` distinct bits flipped."""
    out = bytearray(data)
    for bit in rng.sample(range(8 * len(out)), count):
        out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def fuzz_length(rng: random.Random, limit: int = 4096) -> int:
    """A length in 0..limit, often one at a boundary of the handshake's fixed sizes."""
    if rng.random() < 0.3:
        edges = (0, 1, 3, 4, 5, GREETING_BYTES - 1, GREETING_BYTES, NONCE_BYTES,
                 REPLY_BYTES - 1, REPLY_BYTES, REPLY_BYTES + 1, REPLY_BYTES + DIGEST_BYTES, limit)
        return min(limit, rng.choice(edges))
    return rng.randint(0, limit)


# ----------------------------------------------------------------------------- one connection


class Probe:
    """One fuzz connection: what the server greeted it with and sent after the greeting."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.greeting = b""
        self.greeted = False  # greet() ran; else the greeting sits at the start of `after`
        self.after = bytearray()
        self.broken: Optional[str] = None  # the first socket error seen (reset, broken pipe)
        self.link: Optional[channel.Link] = None  # the connection's keys, once authenticated
        self.sock.settimeout(IO_TIMEOUT_S)

    def greet(self) -> bytes:
        """Read the server's greeting (shorter if the server closed first)."""
        buf = bytearray()
        try:
            while len(buf) < GREETING_BYTES:
                chunk = self.sock.recv(GREETING_BYTES - len(buf))
                if not chunk:
                    break
                buf += chunk
        except OSError as exc:
            self.broken = self.broken or repr(exc)
        self.greeting = bytes(buf)
        self.greeted = True
        return self.greeting

    @property
    def s_nonce(self) -> bytes:
        """The server's nonce (zeros if the greeting never came)."""
        if len(self.greeting) == GREETING_BYTES:
            return self.greeting[len(MAGIC) + 1:]
        return bytes(NONCE_BYTES)

    def send(self, data: bytes, pieces: int = 1, pause: float = 0.0) -> None:
        """Send `data` in `pieces` writes with `pause` seconds between them; errors are noted."""
        if self.broken:
            return
        step = max(1, -(-len(data) // max(1, pieces)))
        try:
            for start in range(0, len(data), step):
                if start and pause:
                    time.sleep(pause)
                self.sock.sendall(data[start:start + step])
        except OSError as exc:  # the server closed on us mid-write: allowed, and noted
            self.broken = repr(exc)

    def recv_exact(self, n: int) -> bytes:
        """Up to `n` bytes (fewer if the server closed); they also count as `after`."""
        buf = bytearray()
        try:
            while len(buf) < n:
                chunk = self.sock.recv(n - len(buf))
                if not chunk:
                    break
                buf += chunk
        except OSError as exc:
            self.broken = self.broken or repr(exc)
        self.after += buf
        return bytes(buf)

    def half_close(self) -> None:
        """Shut our sending side (the server reads EOF) and keep reading."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError as exc:
            self.broken = self.broken or repr(exc)

    def drain(self, limit: int = 1 << 20) -> None:
        """Read until the server closes (or resets) the connection; a timeout is a failure."""
        try:
            while len(self.after) < limit:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return
                self.after += chunk
        except socket.timeout:
            raise AssertionError(
                f"the server kept the connection open for {IO_TIMEOUT_S:g}s after it should "
                f"have closed it (it sent {bytes(self.after[:64])!r})"
            ) from None
        except OSError as exc:  # a reset: the server closed with our bytes unread
            self.broken = self.broken or repr(exc)

    def reset(self) -> None:
        """Close with a TCP reset instead of a FIN."""
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        self.sock.close()

    def close(self) -> None:
        self.sock.close()


# ----------------------------------------------------------------------------- a port under test


@dataclass
class Target:
    """A port that runs `core.auth`'s handshake, and what a fuzzer may throw at it.

    connect(): a fresh blocking socket connected to the port.
    payloads(rng): bytes that would do harm if the port ever admitted the sender (a store SET
        of the sentinel key, a mesh hello, a data-channel header), sent after a failed proof.
    authed(probe, rng): optional; runs on a connection that proved the right secret and sends
        it malformed traffic; the server must answer or drop it and serve everyone else.
    """

    name: str
    connect: Callable[[], socket.socket]
    token: bytes
    purpose: str
    payloads: Callable[[random.Random], bytes]
    authed: Optional[Callable[[Probe, random.Random], None]] = None
    authed_share: float = 0.1


def _finish(p: Probe, rng: random.Random, sent: int) -> str:
    """End a connection one of the ways a client can; returns how."""
    ways = ["close", "reset", "half-close"] + (["wait"] if sent >= REPLY_BYTES else [])
    how = rng.choice(ways)
    if how == "close":
        p.close()
    elif how == "reset":
        p.reset()
    else:
        if how == "half-close":
            p.half_close()
        p.drain()  # the server closes: after judging the proof, or at our EOF
        p.close()
    return how


def _blind_bytes(p: Probe, t: Target, rng: random.Random) -> str:
    data = rng.randbytes(fuzz_length(rng))
    p.send(data, pieces=rng.choice((1, 1, 2, 7)))
    return _finish(p, rng, len(data))


def _bytes_after_greeting(p: Probe, t: Target, rng: random.Random) -> str:
    p.greet()
    data = rng.randbytes(fuzz_length(rng))
    p.send(data)
    return _finish(p, rng, len(data))


def _greeting_echoed(p: Probe, t: Target, rng: random.Random) -> str:
    """Reflect the server's own greeting (and its nonce) back at it."""
    greeting = p.greet()
    data = (greeting + p.s_nonce * 2)[:REPLY_BYTES] + t.payloads(rng)
    p.send(data)
    return _finish(p, rng, len(data))


def _proof_then_payloads(reply: Callable[[Probe, random.Random], bytes]):
    def case(p: Probe, t: Target, rng: random.Random) -> str:
        p.greet()
        data = reply(p, rng)
        if rng.random() < 0.7:
            data += t.payloads(rng)
        if rng.random() < 0.2:  # slow: the proof dribbles in
            p.send(data, pieces=rng.randint(2, 16), pause=rng.choice((0.0, 0.0005, 0.002)))
        else:
            p.send(data)
        return _finish(p, rng, len(data))
    return case


_WRONG_PURPOSES = ("store", "collectives", "rpc-data", "rpc-stream", "", "store\0", "STORE")


def _truncated_proof(p: Probe, t: Target, rng: random.Random) -> str:
    p.greet()
    reply = client_reply(t.token, t.purpose, p.s_nonce, rng.randbytes(NONCE_BYTES))
    data = reply[:rng.randint(0, REPLY_BYTES - 1)]
    p.send(data, pieces=rng.choice((1, 3)))
    return _finish(p, rng, len(data))


def _open_and_close(p: Probe, t: Target, rng: random.Random) -> str:
    if rng.random() < 0.5:
        p.reset()
        return "reset"
    p.close()
    return "close"


def _half_close_at_once(p: Probe, t: Target, rng: random.Random) -> str:
    p.half_close()
    p.drain()
    p.close()
    return "half-close"


def _unauthenticated_cases(t: Target) -> dict:
    """Every way a stranger may try `t`'s handshake, with the target's secret bound in."""

    def wrong_secret(p, rng):
        other = rng.randbytes(rng.choice((1, 16, 32, 64)))
        return client_reply(other if other != t.token else other + b"x", t.purpose, p.s_nonce,
                            rng.randbytes(NONCE_BYTES))

    def flipped(p, rng):
        reply = client_reply(t.token, t.purpose, p.s_nonce, rng.randbytes(NONCE_BYTES))
        return flip_bits(reply, rng, rng.randint(1, 4))

    def other_purpose(p, rng):
        purpose = rng.choice([x for x in _WRONG_PURPOSES if x != t.purpose])
        return client_reply(t.token, purpose, p.s_nonce, rng.randbytes(NONCE_BYTES))

    def replayed(p, rng):  # a right-secret proof, but for a nonce this server never sent
        return client_reply(t.token, t.purpose, rng.randbytes(NONCE_BYTES),
                            rng.randbytes(NONCE_BYTES))

    # name: (play, weight); every proof here must be refused, and what follows it ignored.
    return {
        "random bytes before the greeting": (_blind_bytes, 3),
        "random bytes after the greeting": (_bytes_after_greeting, 3),
        "the greeting echoed back": (_greeting_echoed, 1),
        "a proof with another secret": (_proof_then_payloads(wrong_secret), 3),
        "a proof with flipped bits": (_proof_then_payloads(flipped), 3),
        "a proof for another purpose": (_proof_then_payloads(other_purpose), 2),
        "a proof for another greeting": (_proof_then_payloads(replayed), 2),
        "a truncated proof": (_truncated_proof, 2),
        "open and close": (_open_and_close, 1),
        "half-close at once": (_half_close_at_once, 1),
    }


def authenticate(p: Probe, t: Target) -> None:
    """Run the handshake with the right secret; the server must admit and prove itself. The
    probe then holds the connection's keys (`p.link`), which every later frame must carry."""
    greeting = p.greet()
    assert greeting[:len(MAGIC)] == MAGIC, f"greeting {greeting!r}"
    reply = client_reply(t.token, t.purpose, p.s_nonce)
    p.send(reply)
    verdict = p.recv_exact(DIGEST_BYTES)
    expected = server_proof(t.token, t.purpose, p.s_nonce, reply[:NONCE_BYTES])
    assert verdict == expected, f"a right-secret client got the verdict {verdict!r}"
    del p.after[:]
    p.link = channel.pair(t.token, t.purpose, p.s_nonce, reply[:NONCE_BYTES], server=False,
                          peer=t.name)


# ----------------------------------------------------------------------------- the driver


@dataclass
class Report:
    """What a fuzz run did: inputs by case, how they ended, and every failed check."""

    port: str
    inputs: int = 0
    unauthenticated: int = 0
    by_case: collections.Counter = field(default_factory=collections.Counter)
    endings: collections.Counter = field(default_factory=collections.Counter)
    failures: list = field(default_factory=list)
    seconds: float = 0.0

    def fail(self, index: int, case: str, detail: str) -> None:
        self.failures.append(f"{self.port} input #{index} ({case}; SHOAL_FUZZ_SEED={SEED}): "
                             f"{detail}")

    def summary(self, served: "Served") -> str:
        """One line for the log: inputs by case, and how the right-secret client fared."""
        cases = ", ".join(f"{n} {case}" for case, n in self.by_case.most_common())
        return (f"{self.port}: {self.inputs} inputs in {self.seconds:.1f}s ({cases}); "
                f"{served.what}: {len(served.latencies)} operations meanwhile, the slowest "
                f"{max(served.latencies, default=0.0) * 1e3:.0f} ms")

    def check(self) -> None:
        """Fail the test with the first failures, if any."""
        assert not self.failures, (
            f"{len(self.failures)} of {self.inputs} fuzz inputs failed on {self.port}:\n"
            + "\n".join(self.failures[:10])
        )


def _check_refused(report: Report, index: int, case: str, p: Probe) -> None:
    """Nothing unauthenticated may get more than the greeting and a REFUSED verdict."""
    if not p.greeted:
        p.greeting, p.after = bytes(p.after[:GREETING_BYTES]), p.after[GREETING_BYTES:]
    if p.greeting and not (p.greeting[:len(MAGIC)] == MAGIC[:len(p.greeting)]):
        report.fail(index, case, f"the server greeted with {p.greeting!r}")
    after = bytes(p.after)
    if after and not (REFUSED.startswith(after) or after.startswith(REFUSED)):
        report.fail(index, case, f"the server answered a stranger with {after[:64]!r}")
    elif len(after) > len(REFUSED):
        report.fail(index, case, f"the server sent {len(after)} bytes after its verdict: "
                    f"{after[len(REFUSED):][:64]!r}")


def _play_one(t: Target, index: int, seed: int, cases: dict, report: Report,
              lock: threading.Lock) -> None:
    rng = random.Random(f"{seed}/{t.name}/{index}")
    if t.authed is not None and rng.random() < t.authed_share:
        case = "right secret, then malformed traffic"
    else:
        names = list(cases)
        case = rng.choices(names, weights=[cases[n][1] for n in names])[0]
    try:
        sock = t.connect()
    except OSError as exc:
        with lock:
            report.fail(index, case, f"connecting failed: {exc!r}")
        return
    p = Probe(sock)
    try:
        if case == "right secret, then malformed traffic":
            authenticate(p, t)
            t.authed(p, rng)
            how = "authenticated"
        else:
            how = cases[case][0](p, t, rng)
            with lock:
                _check_refused(report, index, case, p)
    except AssertionError as exc:
        how = "failed"
        with lock:
            report.fail(index, case, str(exc))
    except Exception as exc:  # noqa: BLE001  (a fuzzer bug is reported like a failed check)
        how = "failed"
        with lock:
            report.fail(index, case, f"the fuzzer itself raised {exc!r}")
    finally:
        p.close()
    with lock:
        report.inputs += 1
        report.unauthenticated += case != "right secret, then malformed traffic"
        report.by_case[case] += 1
        report.endings[how] += 1


def _hold_silently(t: Target, deadline_s: float, report: Report, lock: threading.Lock,
                   index: int) -> None:
    """Take the greeting, send nothing: the server must close within its proof deadline."""
    case = "silent until the server gives up"
    start = time.monotonic()
    try:
        p = Probe(t.connect())
    except OSError as exc:
        with lock:
            report.fail(index, case, f"connecting failed: {exc!r}")
        return
    try:
        p.greet()
        p.drain()
        took = time.monotonic() - start
        if took > deadline_s + 2.0:
            with lock:
                report.fail(index, case, f"the server held a silent stranger for {took:.1f}s")
        with lock:
            _check_refused(report, index, case, p)
    except AssertionError as exc:
        with lock:
            report.fail(index, case, str(exc))
    finally:
        p.close()
    with lock:
        report.inputs += 1
        report.unauthenticated += 1
        report.by_case[case] += 1


def fuzz_handshake_port(t: Target, *, inputs: int = INPUTS, seed: int = SEED,
                        proof_deadline_s: float, concurrency: int = CONCURRENCY) -> Report:
    """Play `inputs` seeded inputs against `t` over at most `concurrency` sockets at once.

    A few extra connections stay silent after the greeting to check that the server gives up
    on them within `proof_deadline_s` (they run beside the others, not after them).
    """
    report = Report(t.name)
    lock = threading.Lock()
    cases = _unauthenticated_cases(t)
    start = time.monotonic()
    holders = [threading.Thread(target=_hold_silently,
                                args=(t, proof_deadline_s, report, lock, inputs + i),
                                name=f"fuzz-hold-{t.name}-{i}", daemon=True)
               for i in range(SILENT_HOLDERS)]
    for h in holders:
        h.start()
    with concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="fuzz") as pool:
        for future in [pool.submit(_play_one, t, i, seed, cases, report, lock)
                       for i in range(inputs)]:
            future.result()
    for h in holders:
        h.join(proof_deadline_s + IO_TIMEOUT_S + 5)
        assert not h.is_alive(), f"a silent fuzz connection to {t.name} hung"
    report.seconds = time.monotonic() - start
    return report


def play_inputs(name: str, inputs: int, seed: int, play: Callable[[int, random.Random], str],
                concurrency: int = CONCURRENCY) -> Report:
    """Run `play(index, rng)` for every input on a bounded pool; it returns the case's name and
    raises AssertionError for a failed check (ports without core.auth's handshake)."""
    report = Report(name)
    lock = threading.Lock()
    start = time.monotonic()

    def one(index: int) -> None:
        rng = random.Random(f"{seed}/{name}/{index}")
        try:
            case = play(index, rng)
        except AssertionError as exc:
            with lock:
                report.fail(index, "see the message", str(exc))
            case = "failed"
        except Exception as exc:  # noqa: BLE001
            with lock:
                report.fail(index, "see the message", f"the fuzzer itself raised {exc!r}")
            case = "failed"
        with lock:
            report.inputs += 1
            report.by_case[case] += 1

    with concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="fuzz") as pool:
        for future in [pool.submit(one, i) for i in range(inputs)]:
            future.result()
    report.seconds = time.monotonic() - start
    return report


# ----------------------------------------------------------------------------- served throughout


class Served:
    """Run `op()` over and over on a thread until the block ends; every run must succeed
    within OP_BOUND_S. Use as a context manager, then call `check()`."""

    def __init__(self, what: str, op: Callable[[], None]):
        self.what = what
        self._op = op
        self._stop = threading.Event()
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name=f"served-{what}", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                self._op()
            except Exception as exc:  # noqa: BLE001  (reported by check)
                self.errors.append(f"op #{len(self.latencies)}: {exc!r}")
                if len(self.errors) > 20:
                    return
            self.latencies.append(time.monotonic() - start)

    def __enter__(self) -> "Served":
        self._thread.start()
        return self

    def wait_ops(self, count: int, timeout: float = 30.0) -> None:
        """Block until `count` operations have run (warm-up)."""
        wait_until(lambda: len(self.latencies) >= count or self.errors,
                   f"{self.what} ran {count} operations", timeout)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(OP_BOUND_S + 30)
        assert not self._thread.is_alive(), f"{self.what}: an operation hung"

    def check(self, min_ops: int = 5) -> None:
        assert not self.errors, f"{self.what} failed during the fuzzing: {self.errors[:5]}"
        assert len(self.latencies) >= min_ops, (
            f"{self.what} ran only {len(self.latencies)} operations during the fuzzing")
        slowest = max(self.latencies)
        assert slowest < OP_BOUND_S, (
            f"{self.what}: an operation took {slowest:.2f}s during the fuzzing (bound "
            f"{OP_BOUND_S:g}s; {len(self.latencies)} operations)")


# ----------------------------------------------------------------------------- resources


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout` seconds."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g}s waiting until {what}")
        time.sleep(0.02)


@dataclass(frozen=True)
class Usage:
    """Open descriptors and threads of one process."""

    fds: int
    threads: int

    @classmethod
    def of(cls, pid: Optional[int] = None) -> "Usage":
        base = f"/proc/{pid or 'self'}"
        return cls(len(os.listdir(f"{base}/fd")), len(os.listdir(f"{base}/task")))


def _describe_fds(pid: Optional[int]) -> str:
    base = f"/proc/{pid or 'self'}/fd"
    kinds: collections.Counter = collections.Counter()
    for fd in os.listdir(base):
        try:
            target = os.readlink(f"{base}/{fd}")
        except OSError:
            continue
        kinds[target.split(":")[0] if ":" in target else "file"] += 1
    return ", ".join(f"{n} {kind}" for kind, n in kinds.most_common())


def assert_back_to(before: Usage, pid: Optional[int] = None, timeout: float = 10.0,
                   tolerance: int = TOLERANCE) -> Usage:
    """Wait (bounded) until the process holds no more descriptors and threads than `before`
    plus `tolerance`; fail with both counts otherwise."""
    now = Usage.of(pid)
    end = time.monotonic() + timeout
    while now.fds > before.fds + tolerance or now.threads > before.threads + tolerance:
        if time.monotonic() > end:
            raise AssertionError(
                f"the server process leaked: {now.fds} descriptors ({_describe_fds(pid)}) and "
                f"{now.threads} threads {timeout:g}s after the fuzzing, against {before.fds} "
                f"and {before.threads} before it (tolerance {tolerance})"
            )
        time.sleep(0.05)
        now = Usage.of(pid)
    return now
