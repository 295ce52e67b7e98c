"""The tcp backend's algorithms, written as plans for `pump` (and one tight direct path).

Choice by size, as measured in bench/allreduce.py: direct exchange (every rank sends its whole
array to every other, then reduces locally in rank order) while a message fits the socket
buffers; above that a ring reduce-scatter plus all-gather, chunked so that sending, receiving
and reducing overlap, pumped from one thread; and for the largest arrays the same ring with a
sender thread. Results are bitwise identical on every rank: direct exchange reduces in rank
order everywhere, and the ring computes each element once and then copies it around.
"""

from __future__ import annotations

import functools
import socket
import threading
from typing import Callable, Optional, Sequence

import numpy as np

from shoal.collectives.backends.tcp import wire
from shoal.collectives.backends.tcp.framing import TAG
from shoal.collectives.constants import SMALL_MAX_BYTES
from shoal.collectives.backends.tcp.pump import LinkDown, Plan
from shoal.collectives.backends.tcp.spin import SpinPolicy

HEADER_SIZE = wire.DATA_HEADER.size
_FP_LEN_AT = HEADER_SIZE - 2  # offset of the fingerprint length inside a header


class HeaderMismatch(Exception):
    """A peer's header disagrees with ours (internal; the group turns it into CollectiveMismatch)."""

    def __init__(self, peer: int, their_seq: Optional[int], their_fp: Optional[str], ours: bytes):
        super().__init__(peer, their_seq, their_fp)
        self.peer = peer
        self.their_seq = their_seq
        self.their_fp = their_fp
        self.ours = ours.decode(errors="replace")


class ProtocolError(Exception):
    """Bytes on a data connection that are not a header where one must be (internal)."""

    def __init__(self, peer: int, detail: str):
        super().__init__(peer, detail)
        self.peer = peer
        self.detail = detail


def _read_more(sock: socket.socket, n: int, timeout: float = 1.0) -> bytes:
    """Best-effort read of `n` more bytes for an error message (never blocks long)."""
    out = bytearray()
    old = sock.gettimeout()
    try:
        sock.settimeout(timeout)
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                break
            out += chunk
    except OSError:
        pass
    finally:
        try:
            sock.settimeout(old)
        except OSError:
            pass
    return bytes(out)


def verify_header(peer: int, inb, have: bytes) -> tuple[int, bytes]:
    """(sequence number, fingerprint) of the header frame `have` begins (read the rest of it,
    and its tag, from `inb` when `have` stops short), after checking its tag. A direct-path
    message (`wire.DIRECT_MAGIC`) is one frame with its payload, read and checked whole.

    Raises:
        ProtocolError: no header can begin with these bytes.
        framing.Tampered: the header failed its integrity check.
    """
    magic, their_seq, fp_len = wire.DATA_HEADER.unpack_from(have)
    if magic not in (wire.DATA_MAGIC, wire.DIRECT_MAGIC) or not wire.fingerprint_ok(fp_len):
        raise ProtocolError(peer, f"bytes {bytes(have[:HEADER_SIZE])!r} where a collective header belongs")
    end = HEADER_SIZE + fp_len
    body = 0
    if magic == wire.DIRECT_MAGIC:
        end += wire.DIRECT_LENGTH.size
        have = _have(peer, inb, have, end)
        body = wire.DIRECT_LENGTH.unpack_from(have, end - wire.DIRECT_LENGTH.size)[0]
        if body > SMALL_MAX_BYTES:
            raise ProtocolError(peer, f"a direct message of {body} bytes (at most {SMALL_MAX_BYTES})")
    have = _have(peer, inb, have, end + body + TAG)
    if magic == wire.DIRECT_MAGIC:
        inb.verify_joined(peer, have[:end + body], end, have[end + body:end + body + TAG])
    else:
        inb.verify(peer, have[:end], have[end:end + TAG], "a collective header")
    return their_seq, have[HEADER_SIZE:HEADER_SIZE + fp_len]


def _have(peer: int, inb, have: bytes, n: int) -> bytes:
    """`have`, the start of a frame, with bytes read from `inb` until it holds at least `n`."""
    have = bytes(have)
    if len(have) < n:
        have += _read_more(inb.sock, n - len(have))
    if len(have) < n:
        raise ProtocolError(peer, "a collective header cut short")
    return have


def check_header(peer: int, seq: int, fp: bytes, their_seq: int, their_fp: bytes) -> None:
    """Raise HeaderMismatch unless a peer's checked header is our own."""
    if their_seq != seq or their_fp != fp:
        raise HeaderMismatch(peer, their_seq, their_fp.decode(errors="replace"), fp)


def expect_header(plan: Plan, peer: int, inb, seq: int, fp: bytes) -> None:
    """Queue the receive and check of a peer's header for this collective: its fixed part
    (which says how long the header is), then the rest and its tag, checked before the
    header is compared with ours."""
    buf = bytearray(HEADER_SIZE + len(fp))
    view = memoryview(buf)

    def check_fixed():
        _magic, _seq, fp_len = wire.DATA_HEADER.unpack_from(view)
        if fp_len != len(fp) or _magic != wire.DATA_MAGIC:
            check_header(peer, seq, fp, *verify_header(peer, inb, bytes(view[:HEADER_SIZE])))
            raise ProtocolError(peer, "a direct-path message where a ring's header belongs")

    def check_fp():
        their_seq = wire.DATA_HEADER.unpack_from(view)[1]
        check_header(peer, seq, fp, their_seq, bytes(view[HEADER_SIZE:]))

    plan.recv(peer, view[:HEADER_SIZE], check_fixed, cover=None)
    plan.recv(peer, view[HEADER_SIZE:], check_fp, cover=view)


def chunks(lo: int, hi: int, step: int):
    """[lo, hi) cut into pieces of at most `step` (none when empty)."""
    return [(o, min(o + step, hi)) for o in range(lo, hi, step)]


def bounds(n: int, parts: int) -> list[int]:
    """Split points of n elements into `parts` nearly equal segments (some may be empty)."""
    return [(n * i) // parts for i in range(parts + 1)]


# ----------------------------------------------------------------------------- direct

class _PollGate(threading.local):
    """Per thread: whether its receives may poll now (None: always, as `spin` decides)."""

    allows: Optional[Callable[[], bool]] = None


_GATE = _PollGate()


def poll_only_while(allows: Optional[Callable[[], bool]]) -> None:
    """Let this thread's direct receives poll only while `allows()` is true (None: always).

    A group's worker thread runs operations issued asynchronously, often long before their
    caller waits for them: with every core busy with the ranks' own threads, a receive polling
    for a peer that is still computing takes the core that peer, or this rank's caller, needs
    (measured with fully_shard at W=2 on 2 cores: 1.5 ms of worker CPU in a 170 ms step). Such
    a receive sleeps in the kernel at once instead, and polls again as soon as a thread waits.
    """
    _GATE.allows = allows


class Direct:
    """Small-message exchange with every peer, without the pump (the 4 KiB latency path)."""

    def __init__(self, rank: int, size: int, tx: list, rx: list,
                 spin: Optional[SpinPolicy] = None):
        self.rank = rank
        self.size = size
        self.tx = tx
        self.rx = rx
        # How a receive waits: a bounded poll, then a blocking receive (see `spin`).
        self.spin = spin if spin is not None else SpinPolicy(0.0)
        self.peers = [q for q in range(size) if q != rank]
        self._bufs: dict[int, bytearray] = {}

    def buffer(self, peer: int, n: int) -> memoryview:
        """A reusable receive buffer of `n` bytes for `peer` (grown as needed)."""
        buf = self._bufs.get(peer)
        if buf is None or len(buf) < n:
            buf = bytearray(max(n, 4096))
            self._bufs[peer] = buf
        return memoryview(buf)[:n]

    def exchange(self, seq: int, fp: bytes, payload, sizes: Optional[dict] = None) -> dict:
        """Send header+payload to every peer, receive theirs; returns peer -> payload view.

        `payload` is one buffer for all peers or a dict peer -> buffer; `sizes` gives the
        expected payload size per peer (default: the same as ours).
        """
        for q in self.peers:
            self._send(q, seq, fp, payload[q] if isinstance(payload, dict) else payload)
        out = {}
        for q in self.peers:
            if sizes is not None:
                nb = sizes[q]
            else:
                nb = len(payload[q]) if isinstance(payload, dict) else len(payload)
            out[q] = self._receive(q, self.rx[q], seq, fp, nb)
        return out

    def _send(self, q: int, seq: int, fp: bytes, body) -> None:
        """Send rank `q` a header and `body`: one frame under one tag up to SMALL_MAX_BYTES
        (not encrypted), else a header frame and a payload frame."""
        out = self.tx[q]
        try:
            if out.encrypt or len(body) > SMALL_MAX_BYTES:
                out.send_header(wire.data_header(seq, fp), body)
            else:
                out.send_joined(wire.direct_header(seq, fp, len(body)), body)
        except OSError as exc:
            raise LinkDown(q, exc) from exc

    def _receive(self, q, inb, seq, fp, nb):
        """Rank `q`'s header (compared with ours, checked) and its payload of `nb` bytes
        (checked); one buffer receives both, as many at once as have arrived."""
        joined = not inb.encrypt and nb <= SMALL_MAX_BYTES
        hdr = wire.direct_header(seq, fp, nb) if joined else wire.data_header(seq, fp)
        hl = len(hdr)
        body_at = hl if joined else hl + TAG
        need = body_at + nb + TAG if (joined or nb) else body_at
        view = self.buffer(q, need)
        sock = inb.sock
        allows = _GATE.allows
        try:
            got = self.spin.poll(sock, view, need) if allows is None or allows() else 0
            if got < 0:
                raise LinkDown(q, None)
            # Fixed header first: with a shorter fingerprint and no payload, waiting for our
            # full header length would hang.
            got = _fill(q, sock, view, got, HEADER_SIZE, need)
            if view[:HEADER_SIZE] == hdr[:HEADER_SIZE]:
                got = _fill(q, sock, view, got, hl, need)
            if view[:hl] != hdr:
                check_header(q, seq, fp, *verify_header(q, inb, bytes(view[:got])))
                raise ProtocolError(q, f"a message framed otherwise than ours ({nb} bytes)")
            _fill(q, sock, view, got, need, need)
        except OSError as exc:
            raise LinkDown(q, exc) from exc
        if joined:
            inb.verify_joined(q, view[:hl + nb], hl, view[hl + nb:need])
            return view[hl:hl + nb]
        inb.verify(q, view[:hl], view[hl:body_at], "a collective header")
        return inb.accept(q, view[body_at:need]) if nb else view[hl:hl]

    def send_to(self, q: int, seq: int, fp: bytes, body=b"") -> None:
        """Send rank `q` this op's header, then `body`."""
        self._send(q, seq, fp, body)

    def recv_from(self, q: int, seq: int, fp: bytes, nbytes: int = 0) -> memoryview:
        """Receive rank `q`'s header (checked against ours) and its `nbytes` of payload."""
        return self._receive(q, self.rx[q], seq, fp, nbytes)


def _fill(q: int, sock, view, got: int, upto: int, need: int) -> int:
    """Receive into `view` until it holds `upto` bytes (taking up to `need` at once)."""
    while got < upto:
        k = sock.recv_into(view[got:], need - got)
        if k == 0:
            raise LinkDown(q, None)
        got += k
    return got


def combine_pair(mine: np.ndarray, theirs: np.ndarray, rank: int, uf) -> None:
    """mine := x_0 op x_1 for a group of two, with rank 0's operand first on both ranks.

    Operand order matters bitwise even for "commutative" ops: maximum/minimum return their
    first operand for +0.0 vs -0.0 and for two NaNs, and complex multiplication rounds
    differently with the operands swapped. One order on both ranks keeps them identical.
    """
    if rank == 0:
        uf(mine, theirs, out=mine)
    else:
        uf(theirs, mine, out=mine)


def reduce_in_rank_order(flat: np.ndarray, rank: int, peers_data: dict, uf) -> None:
    """flat := x_0 op x_1 op ... op x_{W-1}, every rank in the same order (bitwise agreement)."""
    size = len(peers_data) + 1
    if size == 2:
        (other,) = peers_data.values()
        combine_pair(flat, np.frombuffer(other, dtype=flat.dtype), rank, uf)
        return
    operands = [
        flat if q == rank else np.frombuffer(peers_data[q], dtype=flat.dtype) for q in range(size)
    ]
    acc = np.array(operands[0], copy=True)
    for x in operands[1:]:
        uf(acc, x, out=acc)
    np.copyto(flat, acc)


# ----------------------------------------------------------------------------- ring plans

def ring_allreduce_plan(
    rank: int, size: int, rx: list, seq: int, fp: bytes, flat: np.ndarray,
    scratch: memoryview, uf, chunk_elems: int, shift: int = 0, gather: bool = True,
) -> Plan:
    """Ring reduce-scatter (+ all-gather when `gather`) of `flat` in place.

    After the reduce-scatter, rank r holds the reduced segment (r + 1 + shift) mod W; with
    shift=-1 that is segment r (what reduce_scatter wants).
    """
    nxt = (rank + 1) % size
    prv = (rank - 1) % size
    plan = Plan()
    plan.send(nxt, wire.data_header(seq, fp), header=True)
    expect_header(plan, prv, rx[prv], seq, fp)
    b = bounds(flat.size, size)
    item = flat.itemsize
    raw = memoryview(flat.view(np.uint8))
    scratch_np = np.frombuffer(scratch, dtype=flat.dtype)

    def seg(i):
        i %= size
        return b[i], b[i + 1]

    # done_after[segment-step] = recv counts after each chunk, to gate the forwarding sends.
    prev_counts: Optional[list[int]] = None
    for s in range(size - 1):
        slo, shi = seg(rank - s + shift)
        for c, (lo, hi) in enumerate(chunks(slo, shi, chunk_elems)):
            gate = (prv, prev_counts[c]) if prev_counts is not None else None
            plan.send(nxt, raw[lo * item:hi * item], gate)
        rlo, rhi = seg(rank - s - 1 + shift)
        counts = []
        for lo, hi in chunks(rlo, rhi, chunk_elems):
            target = flat[lo:hi]
            cb = functools.partial(uf, target, scratch_np[:hi - lo], out=target)
            counts.append(plan.recv(prv, scratch[:(hi - lo) * item], cb))
        prev_counts = counts
    if not gather:
        return plan
    for s in range(size - 1):
        slo, shi = seg(rank + 1 + shift - s)
        for c, (lo, hi) in enumerate(chunks(slo, shi, chunk_elems)):
            plan.send(nxt, raw[lo * item:hi * item], (prv, prev_counts[c]))
        rlo, rhi = seg(rank + shift - s)
        counts = []
        for lo, hi in chunks(rlo, rhi, chunk_elems):
            counts.append(plan.recv(prv, raw[lo * item:hi * item]))
        prev_counts = counts
    return plan


def ring_allgather_plan(
    rank: int, size: int, rx: list, seq: int, fp: bytes, segments: Sequence[memoryview],
    chunk_bytes: int,
) -> Plan:
    """Ring all-gather: segment j (bytes) starts at rank j and ends on every rank."""
    nxt = (rank + 1) % size
    prv = (rank - 1) % size
    plan = Plan()
    plan.send(nxt, wire.data_header(seq, fp), header=True)
    expect_header(plan, prv, rx[prv], seq, fp)
    prev_counts: Optional[list[int]] = None
    for s in range(size - 1):
        out_seg = segments[(rank - s) % size]
        for c, (lo, hi) in enumerate(chunks(0, len(out_seg), chunk_bytes)):
            gate = (prv, prev_counts[c]) if prev_counts is not None else None
            plan.send(nxt, out_seg[lo:hi], gate)
        in_seg = segments[(rank - s - 1) % size]
        prev_counts = [plan.recv(prv, in_seg[lo:hi]) for lo, hi in chunks(0, len(in_seg), chunk_bytes)]
    return plan


def chain_broadcast_plan(
    rank: int, size: int, rx: list, seq: int, fp: bytes, root: int, raw: memoryview,
    chunk_bytes: int,
) -> Plan:
    """Pipelined chain root -> root+1 -> ... -> root-1, then an ack from the last to the root.

    The ack closes the loop of header checks, so the root learns of any rank that disagrees.
    """
    rel = (rank - root) % size
    nxt = (rank + 1) % size
    prv = (rank - 1) % size
    last = (root - 1) % size
    plan = Plan()
    pieces = chunks(0, len(raw), chunk_bytes)
    if rel == 0:
        plan.send(nxt, wire.data_header(seq, fp), header=True)
        for lo, hi in pieces:
            plan.send(nxt, raw[lo:hi])
        expect_header(plan, last, rx[last], seq, fp)
        return plan
    expect_header(plan, prv, rx[prv], seq, fp)
    counts = [plan.recv(prv, raw[lo:hi]) for lo, hi in pieces]
    done = plan.recv_count(prv)
    if rank != last:
        plan.send(nxt, wire.data_header(seq, fp), header=True)
        for (lo, hi), c in zip(pieces, counts):
            plan.send(nxt, raw[lo:hi], (prv, c))
    else:
        plan.send(root, wire.data_header(seq, fp), (prv, done), header=True)
    return plan


def star_plan(
    rank: int, size: int, rx: list, seq: int, fps_out: dict, fps_in: dict,
    sends: dict, recvs: dict, chunk_bytes: int, acks: Sequence[int] = (),
    ack_from: Sequence[int] = (), ack_fp: Optional[bytes] = None,
    callbacks: Optional[dict] = None,
) -> Plan:
    """Direct transfers: to each peer q send header(fps_out[q]) + sends[q]; receive
    header(fps_in[q]) + recvs[q]. Peers in `acks` get an ack header once everything from them
    arrived; `ack_from` peers are expected to ack us."""
    plan = Plan()
    for q, body in sends.items():
        plan.send(q, wire.data_header(seq, fps_out[q]), header=True)
        for lo, hi in chunks(0, len(body), chunk_bytes):
            plan.send(q, body[lo:hi])
    for q, body in recvs.items():
        expect_header(plan, q, rx[q], seq, fps_in[q])
        cb_last = (callbacks or {}).get(q)
        pieces = chunks(0, len(body), chunk_bytes)
        for i, (lo, hi) in enumerate(pieces):
            plan.recv(q, body[lo:hi], cb_last if i == len(pieces) - 1 else None)
        if not pieces and cb_last is not None:
            plan.recv(q, body[0:0], cb_last)
    for q in acks:
        plan.send(q, wire.data_header(seq, ack_fp), (q, plan.recv_count(q)), header=True)
    for q in ack_from:
        expect_header(plan, q, rx[q], seq, ack_fp)
    return plan
