"""The processes a measurement starts (`scale_model.py --peer ROLE ...`): raw socket
ping-pongs and exchanges, two processes' copies and adds, and shoal's own calls in a 2-rank
group. Each prints its timings as one JSON line."""

from __future__ import annotations

import ipaddress
import json
import mmap
import os
import socket
import statistics
import struct
import threading
import time

import numpy as np

from .constants import (
    CALIBRATION_BYTES,
    MEMORY_SIZES,
    MEMORY_WALK_BYTES,
    PEER_TIMEOUT_S,
    PINGPONG_SIZES,
    SHM_CALIBRATION_SIZES,
    SOCKET_BUFFER_BYTES,
    STREAM_SIZES,
)
from .units import KiB, MiB

_COMMAND = struct.Struct("!BQQ")  # mode, message bytes, message count
_PINGPONG, _PINGPONG_SPIN, _EXCHANGE, _QUIT = 0, 1, 2, 3


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n


def _recv_polling(sock: socket.socket, view: memoryview) -> None:
    """As `_recv_exact`, polling a non-blocking socket (shoal's spinning receive)."""
    got = 0
    sock.setblocking(False)
    try:
        while got < len(view):
            try:
                n = sock.recv_into(view[got:])
            except BlockingIOError:
                continue
            if n == 0:
                raise ConnectionError("the peer closed the connection")
            got += n
    finally:
        sock.settimeout(PEER_TIMEOUT_S)


def _send_stream(sock: socket.socket, payload: memoryview, count: int) -> None:
    for _ in range(count):
        sock.sendall(payload)


def _exchange(sock: socket.socket, out: memoryview, into: memoryview, count: int) -> None:
    """Send `count` messages while receiving as many (a sender thread; the socket buffers
    could not hold a whole message otherwise)."""
    sender = threading.Thread(target=_send_stream, args=(sock, out, count))
    sender.start()
    for _ in range(count):
        _recv_exact(sock, into)
    sender.join()


def _serve(sock: socket.socket) -> None:
    """The passive end: echo ping-pongs, mirror exchanges, until told to quit."""
    head = bytearray(_COMMAND.size)
    buf = bytearray(4 * MiB)
    out = bytearray(4 * MiB)
    while True:
        _recv_exact(sock, memoryview(head))
        mode, n, count = _COMMAND.unpack(head)
        view = memoryview(buf)[:n]
        if mode == _QUIT:
            return
        if mode in (_PINGPONG, _PINGPONG_SPIN):
            receive = _recv_polling if mode == _PINGPONG_SPIN else _recv_exact
            for _ in range(count):
                receive(sock, view)
                sock.sendall(view)
        else:
            _exchange(sock, memoryview(out)[:n], view, count)
            sock.sendall(b"k")


def _drive(sock: socket.socket, reps: int) -> dict:
    """The active end: ping-pongs (sleeping, polling) and exchanges at every size."""
    buf = bytearray(4 * MiB)
    out = bytearray(4 * MiB)
    result = {"pingpong": {}, "pingpong_spin": {}, "pingpong_cpu": {}, "stream": {},
              "stream_cpu": {}}
    for mode, key, receive in ((_PINGPONG, "pingpong", _recv_exact),
                               (_PINGPONG_SPIN, "pingpong_spin", _recv_polling)):
        for n in PINGPONG_SIZES:
            count = 200 if n <= 4 * KiB else 60
            view = memoryview(buf)[:n]
            times, cpu = [], []
            for _ in range(reps):
                sock.sendall(_COMMAND.pack(mode, n, count))
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(count):
                    sock.sendall(view)
                    receive(sock, view)
                times.append((time.perf_counter() - t0) / count / 2)  # one way
                cpu.append((time.process_time() - c0) / count)
            result[key][n] = statistics.median(times)
            if mode == _PINGPONG:
                # This end's CPU per round trip: a send, a receive and a wake-up from sleep.
                result["pingpong_cpu"][n] = statistics.median(cpu)
    for n in STREAM_SIZES:
        count = max(4, (16 * MiB) // n)
        times, cpu = [], []
        for _ in range(reps):
            sock.sendall(_COMMAND.pack(_EXCHANGE, n, count))
            t0, c0 = time.perf_counter(), time.process_time()
            _exchange(sock, memoryview(out)[:n], memoryview(buf)[:n], count)
            _recv_exact(sock, memoryview(bytearray(1)))
            times.append((time.perf_counter() - t0) / count)
            cpu.append((time.process_time() - c0) / count)
        result["stream"][n] = statistics.median(times)
        # CPU time of this end (both its threads): how busy a rank of a ring step keeps its
        # core, which decides how ranks that share cores slow each other.
        result["stream_cpu"][n] = statistics.median(cpu)
    sock.sendall(_COMMAND.pack(_QUIT, 0, 0))
    return result


def _tune(sock: socket.socket) -> None:
    """shoal's link settings (shoal.collectives.backends.tcp.wire.tune_socket): a fixed send
    buffer; a fixed receive buffer within a host (Unix sockets, loopback), the kernel's
    autotuned one on a link to another host (here: another network namespace)."""
    sock.settimeout(PEER_TIMEOUT_S)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    inet = sock.family in (socket.AF_INET, socket.AF_INET6)
    if not inet or ipaddress.ip_address(sock.getpeername()[0]).is_loopback:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    if inet:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _memory_pair(reps: int) -> dict:
    """Copy and add rates with two processes at once (this one and a fork), each copying into
    its own memfd mapping and adding float32 arrays: in cache (arrays reused) and beyond it
    (a MEMORY_WALK_BYTES array walked through n bytes at a time)."""
    walk = MEMORY_WALK_BYTES
    a, b = socket.socketpair()
    child = os.fork()
    sock = b if child == 0 else a
    sock.settimeout(PEER_TIMEOUT_S)
    fd = os.memfd_create("shoal-scale-model", os.MFD_CLOEXEC)
    os.ftruncate(fd, walk)
    region = np.frombuffer(mmap.mmap(fd, walk, flags=mmap.MAP_SHARED), dtype=np.uint8)
    src = np.ones(walk, dtype=np.uint8)
    acc = np.ones(walk // 4, dtype=np.float32)
    other = np.ones(walk // 4, dtype=np.float32)
    region[:] = 1  # fault every page in before timing
    one = bytearray(1)
    result = {}
    for kind in ("copy", "add"):
        for where in ("cache", "mem"):
            for n in MEMORY_SIZES:
                count = max(8, (64 * MiB) // n)
                offsets = [0] * count if where == "cache" else [
                    (i * n) % walk for i in range(count)]
                times = []
                for _ in range(reps):
                    sock.sendall(b"s")  # start together
                    sock.recv_into(one)
                    t0 = time.perf_counter()
                    if kind == "copy":
                        for off in offsets:
                            np.copyto(region[off:off + n], src[off:off + n])
                    else:
                        for off in offsets:
                            lo, hi = off // 4, (off + n) // 4
                            np.add(acc[lo:hi], other[lo:hi], out=acc[lo:hi])
                    times.append((time.perf_counter() - t0) / count)
                result[f"{kind}_{where}_{n}"] = statistics.median(times)
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    return result


def _shoal_calls(rank: int, port: int, reps: int, transport: str) -> dict:
    """Median seconds of shoal's own calls in a 2-rank tcp group, receivers sleeping
    (SHOAL_SPIN_US=0), each call right after the last: on unix links a barrier (an exchange of
    headers) and a 4 KiB all_reduce (headers and data); on shared memory all_reduces of
    SHM_CALIBRATION_SIZES."""
    # Late: only this peer process forms a group; the fitting and the check never need shoal.
    import shoal.collectives as dist

    group = dist.init_process_group("tcp", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=2, timeout=PEER_TIMEOUT_S)
    if transport == "unix":
        data = np.zeros(CALIBRATION_BYTES // 4, np.float32)
        calls = [("barrier", group.barrier, 100), ("all_reduce", lambda: group.all_reduce(data),
                                                   100)]
    else:
        calls = []
        for n in SHM_CALIBRATION_SIZES:
            arr = np.zeros(n // 4, np.float32)
            calls.append((f"shm_{n}", (lambda a: lambda: group.all_reduce(a))(arr),
                          max(2, (8 * MiB) // n)))
    result = {}
    for key, call, per_rep in calls:
        for _ in range(3):
            call()
        times = []
        for _ in range(reps * per_rep):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        result[key] = statistics.median(times)
    group.barrier()
    dist.destroy_process_group()
    return result


def peer_main(argv: list[str]) -> int:
    """The hidden entry point of a measurement's processes (`scale_model.py --peer ROLE ...`)."""
    role = argv[0]
    if role == "serve":  # serve FAMILY ADDRESS: print where it listens, serve one client
        family, address = argv[1], argv[2]
        if family == "unix":
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind("\0" + address)
        else:
            listener = socket.create_server((address, 0))
        listener.settimeout(PEER_TIMEOUT_S)
        listener.listen(1)
        print(address if family == "unix" else listener.getsockname()[1], flush=True)
        conn, _ = listener.accept()
        _tune(conn)
        _serve(conn)
        return 0
    if role == "drive":  # drive FAMILY ADDRESS PORT REPS: print the timings as JSON
        family, address, port, reps = argv[1], argv[2], argv[3], int(argv[4])
        if family == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(PEER_TIMEOUT_S)
            sock.connect("\0" + address)
        else:
            sock = socket.create_connection((address, int(port)), timeout=PEER_TIMEOUT_S)
        _tune(sock)
        print(json.dumps(_drive(sock, reps)), flush=True)
        return 0
    if role == "shoal-calls":  # shoal-calls RANK PORT REPS TRANSPORT: rank 0 prints JSON
        rank, port, reps = int(argv[1]), int(argv[2]), int(argv[3])
        print(json.dumps(_shoal_calls(rank, port, reps, argv[4])), flush=True)
        return 0
    if role == "memory":  # memory REPS
        print(json.dumps(_memory_pair(int(argv[1]))), flush=True)
        return 0
    raise SystemExit(f"unknown peer role {role!r}")
