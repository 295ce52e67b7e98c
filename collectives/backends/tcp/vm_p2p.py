"""Large point-to-point payloads written straight into the receiving array, between ranks of
one host: one copy instead of the shared-memory ring's two (`shm_p2p`).

A batch of point-to-point operations (`batch_isend_irecv`) starts by offering each of its
large receives to its source: a small control message (`wire.KIND_READY`) naming the message
it is for (the tag and the message's number under it: the k-th message one rank sends another
under a tag is the k-th the other takes), the receive's fingerprint and length, and where the
array lives (process, address). A sender that holds the offer for the message it is about to
send, with the same fingerprint and length, copies the payload into that array with
`process_vm_writev` and sends only a note (`MARK` + fingerprint, the message's number) over the
control channel, so tags, ordering, a mismatched receive and a lost peer behave as before.

Sends stay eager: a sender waits for an offer only briefly (less than the ring's extra copy
costs), and otherwise sends the message as before; the offer it did not use is then stale
(its number is behind) and dropped. The receiver keeps each offered array alive until the
message the offer names has been taken, however it came, so a sender never writes into
memory that was freed; after a failure that message may never come, and the array is kept
until the group goes.

Writing into another process's memory needs the right to trace it (same user, and the
kernel's ptrace policy), so a pair that is refused falls back to the ring for good. A process
id is only meaningful in its pid namespace, and could in principle be reused by another
process after the receiver died: the sender writes only when both share a pid namespace and
when the receiver's canary (16 random bytes at an address the offer names) reads back right
from that process just before the write.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import errno
import logging
import os
import struct
import time
from typing import Optional

import numpy as np

from shoal.collectives.backends.tcp import wire

__all__ = ["MARK", "MIN_BYTES", "READY", "NOTE", "Readies", "Writer", "Offers", "here"]

logger = logging.getLogger(__name__)

# A note's fingerprint starts with MARK (a byte no other fingerprint starts with; the ring's
# descriptors use 0x01).
MARK = b"\x02"
# Below this a message goes through the ring as before: its two copies of a few MiB stay in
# the caches, while the kernel's write pins every page of the receiving array first. Measured
# with bench/p2p.py (ring shifts, 2-core EPYC, the ring's tree and this one alternating): at
# 4 MiB the ring was faster at W=2 and at W=4 (1.45-1.90 against 1.77-2.12 ms); at 8 MiB the
# direct write was faster at both (W=4: 2.7-3.3 against 3.3-4.3 ms), and more so above.
MIN_BYTES = 8 << 20


# message number, array address, length, receiver's pid, its pid namespace, canary address,
# canary
READY = struct.Struct("<QQQIQQ16s")
NOTE = struct.Struct("<Q")  # the message's number
# How long a sender waits for an offer: about what the ring's two copies would cost it (8 GB/s
# of payload on the machines measured), and never more than this. A receiver that comes later
# than that finishes later than the sender anyway, so the wait rarely delays the exchange;
# shorter waits missed receivers that left the previous step a millisecond behind.
_WAIT_MAX_S = 10e-3
_COPY_BYTES_PER_S = 8e9
# Offers kept per peer: a receiver offers once per large receive, and a stale offer is
# dropped when its sender passes its number; this bounds what a peer's offers can hold.
_KEPT = 256


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _libc():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        for name in ("process_vm_writev", "process_vm_readv"):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_ssize_t
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                           ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
        return lib
    except (OSError, AttributeError):
        return None


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class _Here:
    """This process: its pid namespace and its canary (allocated once, never freed)."""

    def __init__(self):
        self.libc = _libc()
        self.pidns = _pid_namespace()
        self.canary = ctypes.create_string_buffer(os.urandom(16), 16)
        self.canary_at = ctypes.addressof(self.canary)

    @property
    def usable(self) -> bool:
        return self.libc is not None and self.pidns != 0


_here: Optional[_Here] = None


def here() -> _Here:
    """This process's identity for offers (made on first use)."""
    global _here
    if _here is None:
        _here = _Here()
    return _here


def offer(number: int, arr: np.ndarray) -> bytes:
    """The payload of an offer of `arr` (C-contiguous, writable) for message `number`."""
    me = here()
    return READY.pack(number, arr.ctypes.data, arr.nbytes, os.getpid(), me.pidns,
                      me.canary_at, me.canary.raw)


def wait_for(nbytes: int) -> float:
    """How long a sender of `nbytes` waits for its receiver's offer."""
    return min(_WAIT_MAX_S, nbytes / _COPY_BYTES_PER_S)


def take_offer(control, dst: int, tag: int, number: int, until: float) -> Optional[tuple]:
    """`dst`'s offer for message `number` under `tag` to it, from `control`'s offers, waiting
    for it until the `time.monotonic()` deadline `until`: (fp, payload), or None."""
    return control.served_wait(lambda: control.readies.pop(dst, tag, number),
                               lambda: time.monotonic() >= until,
                               max(0.0, until - time.monotonic()))


class Readies:
    """The offers peers have sent this rank, by peer (the control channel files them, under its
    lock)."""

    def __init__(self, size: int):
        self._box: list[collections.OrderedDict] = [collections.OrderedDict()
                                                    for _ in range(size)]

    def file(self, peer: int, tag: int, fp: bytes, payload: bytes) -> None:
        """Keep `peer`'s offer (a malformed one is ignored: the message then goes by the ring)."""
        if len(payload) != READY.size:
            return
        box = self._box[peer]
        box[(tag, READY.unpack_from(payload)[0])] = (fp, payload)
        while len(box) > _KEPT:
            box.popitem(last=False)

    def pop(self, peer: int, tag: int, number: int) -> Optional[tuple]:
        """The offer for message `number` under `tag` to `peer`, if it came; drops that tag's
        stale offers (numbers behind it)."""
        box = self._box[peer]
        got = box.pop((tag, number), None)
        if box:
            for key in [k for k in box if k[0] == tag and k[1] < number]:
                del box[key]
        return got


class Offers:
    """A receiver's offers: it keeps each offered array alive until the message the offer names
    has been taken (a sender may write into it until it sends that message)."""

    def __init__(self):
        self._kept: dict[tuple[int, int, int], np.ndarray] = {}

    def make(self, control, src: int, tag: int, fp: bytes, arr: np.ndarray,
             ahead: int = 0) -> Optional[int]:
        """Offer `arr` to `src` for the message `ahead` places after the next one it has not
        taken under `tag`; the message's number, or None when it is here already or `arr` is
        too small or not one writable block."""
        if (arr.nbytes < MIN_BYTES or not arr.flags.c_contiguous or not arr.flags.writeable
                or control.waiting(src, tag) > ahead):
            return None
        number = control.taken[(src, tag)] + ahead
        self._kept[(src, tag, number)] = arr
        try:
            control.send_p2p(src, tag, fp, offer(number, arr), kind=wire.KIND_READY)
        except OSError:
            return None  # the link is down (the group fails); the array stays kept
        return number

    def release(self, src: int, tag: int, number: int) -> None:
        """Message `number` from `src` under `tag` was taken: its array is the owner's again."""
        self._kept.pop((src, tag, number), None)


class Writer:
    """Writes a sender's payloads into its peers' offered arrays; remembers peers that refuse."""

    def __init__(self):
        self._refused: set[int] = set()
        self.written = 0  # messages written straight into a peer's array

    def enabled(self, peer: int) -> bool:
        """Whether offers from `peer` are worth waiting for (a group makes a Writer only where
        `here().usable`)."""
        return peer not in self._refused

    def write(self, peer: int, expected_fp: bytes, raw, offer_fp: bytes, payload: bytes) -> bool:
        """Copy `raw` (bytes-like, contiguous) into the array `payload` offers when the offer
        fits (same fingerprint and length, this pid namespace, its canary right); False when
        nothing usable was written (send the message the usual way)."""
        number, address, length, pid, pidns, canary_at, canary = READY.unpack(payload)
        src = np.frombuffer(raw, np.uint8)
        me = here()
        if offer_fp != expected_fp or length != src.nbytes or pidns != me.pidns:
            return False
        check = ctypes.create_string_buffer(16)
        if (self._call(me.libc.process_vm_readv, peer, pid, ctypes.addressof(check), canary_at,
                       16) != 16 or check.raw != canary):
            return False
        if self._call(me.libc.process_vm_writev, peer, pid, src.ctypes.data, address,
                      length) != length:
            return False
        self.written += 1
        return True

    def _call(self, fn, peer: int, pid: int, local: int, remote: int, length: int) -> int:
        mine = _Iovec(local, length)
        theirs = _Iovec(remote, length)
        done = fn(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
        if done < 0:
            err = ctypes.get_errno()
            if err in (errno.EPERM, errno.EACCES, errno.ENOSYS):
                self._refused.add(peer)
                logger.info("this rank may not write into rank %d's process %d (%s): large "
                            "point-to-point messages to it go through shared memory", peer, pid,
                            os.strerror(err))
        return done
