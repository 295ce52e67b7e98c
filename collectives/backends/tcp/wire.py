"""Byte layouts of the tcp backend: data headers, connection hellos and control frames.

Every collective begins, on every link it uses, with a data header: a magic, the group's
sequence number and the sender's fingerprint of the call ("all_reduce(float32[1024], op=SUM)").
The receiver checks its tag and compares it with its own before a single payload byte lands in
a user buffer, so ranks that disagree get `CollectiveMismatch` instead of corrupt results.
Every byte after the handshake travels in frames that end in a tag (`framing`), the hello
included.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

from shoal.collectives.constants import MAX_FINGERPRINT_BYTES, SOCKET_BUFFER_BYTES

DATA_MAGIC = b"SHd1"
# magic, sequence number, fingerprint length; the fingerprint follows.
DATA_HEADER = struct.Struct("<4sQH")
# The direct path's small messages: a header of this magic, its fingerprint, the payload's
# length (`DIRECT_LENGTH`), then the payload, all one frame under one tag (`direct_header`).
DIRECT_MAGIC = b"SHd2"
DIRECT_LENGTH = struct.Struct("<I")

HELLO_MAGIC = b"SHh1"
# magic, group id (hash of name and generation), sender's rank, receiver's rank, channel.
HELLO = struct.Struct("<4s8siiB")
HELLO_ACK = b"\x06"
# Each pair has two one-way data connections: a TCP socket's send and receive paths share a
# lock in the kernel, so one socket carrying both directions halves a ring's throughput.
CHANNEL_UP = 0  # the dialing (higher) rank sends on it
CHANNEL_DOWN = 1  # the accepting (lower) rank sends on it
CHANNEL_CONTROL = 2
CHANNELS = (CHANNEL_UP, CHANNEL_DOWN, CHANNEL_CONTROL)

CONTROL_MAGIC = b"SHk2"
# magic, kind, aux (a tag for point-to-point), fingerprint length, payload length. A control
# message is this header as one frame, then the fingerprint (point-to-point) and the payload
# as a frame each (`framing`): each length is known, and checked, before its frame is read.
CONTROL_HEADER = struct.Struct("<4sBiHQ")
# A small message (its payload at most `control.JOIN_MAX_BYTES`, not sealed) goes as one frame
# instead: this magic's header, the fingerprint and the payload under one tag, so it costs one
# tag each way. Its receiver reads the rest of the frame by the header's lengths before the
# tag checks them, so it bounds them first (the joined sizes only): no unchecked length can
# make it allocate more than that.
CONTROL_JOINED_MAGIC = b"SHk3"
KIND_BYE = 1
KIND_ABORT = 2
KIND_P2P = 3
# A receiver's offer to have a large point-to-point message written straight into its array
# (`vm_p2p`): aux is the message's tag, the fingerprint the receive's, the payload `vm_p2p.READY`.
KIND_READY = 4
KINDS = {KIND_BYE: "bye", KIND_ABORT: "abort", KIND_P2P: "p2p", KIND_READY: "ready"}


def data_header(seq: int, fingerprint: bytes) -> bytes:
    """The header that opens a collective on one link."""
    return DATA_HEADER.pack(DATA_MAGIC, seq, len(fingerprint)) + fingerprint


def direct_header(seq: int, fingerprint: bytes, nbytes: int) -> bytes:
    """The header of a direct-path message whose `nbytes` of payload follow it in the same
    frame: one tag covers both, so a small message costs one tag call each way."""
    return (DATA_HEADER.pack(DIRECT_MAGIC, seq, len(fingerprint)) + fingerprint
            + DIRECT_LENGTH.pack(nbytes))


def fingerprint_ok(length: int) -> bool:
    """Whether a header's fingerprint length is sane."""
    return 0 < length <= MAX_FINGERPRINT_BYTES


def tune_socket(sock: socket.socket, same_host: bool) -> None:
    """Buffers for a link (set before connect, so the window is negotiated for them).

    The send buffer is always small and fixed: the bytes in flight stay in the CPU caches.
    The receive buffer is fixed too between ranks of one host, where the kernel's loopback
    path copies straight from sender to receiver and small buffers win; between hosts it is
    left to the kernel's autotuning, which grows the window to the path's bandwidth-delay
    product. A fixed 256 KiB window there caps a stream at 256 KiB per round trip (2 Gbit/s
    at 1 ms), and even between network namespaces here it cost a third of the throughput of
    a host-to-host stream (bench/allreduce.py --hosts).
    """
    if not SOCKET_BUFFER_BYTES:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    if same_host or sock.family == socket.AF_UNIX:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def is_loopback_address(address: str) -> bool:
    """Whether `address` is a loopback IP address (a host name is not)."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def is_same_host_address(address: str, own: str) -> bool:
    """Whether a TCP peer at `address` is this host as seen from a socket bound to `own`:
    loopback, or our own address (the kernel carries both over its loopback device)."""
    return is_loopback_address(address) or address == own


def set_nodelay(sock: socket.socket) -> None:
    """Disable Nagle: collectives are request/response and every microsecond shows at 4 KiB."""
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def host_identity() -> str:
    """Equal on two processes exactly when they share a kernel and a network namespace, which
    is when an abstract Unix socket of one is reachable from the other."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/net").st_ino))
    except OSError:
        return ""
    return "/".join(parts)


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from a blocking socket; False if the peer closed the connection first."""
    got = 0
    n = len(view)
    while got < n:
        # MSG_WAITALL: the kernel fills the whole view in one call on a blocking socket (a
        # 4 MiB chunk took ~16 calls of a socket buffer each); it returns early on a signal,
        # a closed peer or a socket with a timeout, so the loop stays.
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            return False
        got += k
    return True


def recv_parts(sock: socket.socket, parts: list) -> bool:
    """Fill every view of `parts` in order (a payload and its tag) from a blocking socket, in
    one system call when the kernel can; False if the peer closed the connection first."""
    views = [part for part in parts if len(part)]
    while views:
        k = sock.recvmsg_into(views, 0, socket.MSG_WAITALL)[0]
        if k == 0:
            return False
        while k:  # drop what this call filled
            n = len(views[0])
            if k < n:
                views[0] = views[0][k:]
                break
            k -= n
            views.pop(0)
    return True


def send_all(sock: socket.socket, parts: list) -> None:
    """sendmsg of several buffers, finishing any partial send with sendall."""
    total = sum(len(p) for p in parts)
    sent = sock.sendmsg(parts)
    if sent == total:
        return
    for p in parts:
        n = len(p)
        if sent >= n:
            sent -= n
            continue
        sock.sendall(memoryview(p)[sent:])
        sent = 0
