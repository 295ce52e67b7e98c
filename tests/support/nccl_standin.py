"""A stand-in for the nccl backend's CUDA/NCCL runtime, on threads and numpy, for machines
without a GPU.

It keeps NCCL's shape: "device" arrays (a numpy subclass) are touched only by work queued on
streams, each stream is a worker thread that runs its queue in order, events fire when their
stream reaches them, and a collective blocks its stream until every rank of the communicator
posted a matching call. Matching follows what NCCL itself can see: the kind of collective, its
root and its byte count. A call that differs in those never completes (a rank that never calls
makes the others hang, as on a GPU); one that differs only in dtype or reduce op completes with
each rank reading its peers' bytes as its own dtype and reducing with its own op, as NCCL,
which exchanges no description of the call, would. An error inside stream work becomes the
communicator's asynchronous error, as ncclCommGetAsyncError reports one.

Usage:
    worlds = new_worlds()                      # what the ranks of one job share
    rt = FakeRuntime(worlds, device=rank)      # one per rank, shared by that rank's groups
    ProcessGroupNCCL(store, rank, size, device=rank, runtime=rt)
    rt.close()                                 # after the rank's groups shut down
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from typing import Any, Callable

import numpy as np

from shoal.collectives.backends.nccl import runtime as nrt

__all__ = ["Dev", "Dev1", "dev", "FakeRuntime", "FakeComm", "new_worlds"]

_IDLE_POLL_S = 0.5


class Dev(np.ndarray):
    """Memory on the stand-in's device (only stream work should touch it)."""


class Dev1(Dev):
    """Memory on a device no group uses (cuda:99)."""


def dev(a, cls=Dev):
    """`a` copied into stand-in device memory."""
    return np.array(a).view(cls)


class Aborted(Exception):
    """Raised inside stream work whose communicator was aborted (the kernel exits)."""


class FakeStream:
    """A CUDA stream: a thread that runs queued work in order until the runtime closes."""

    def __init__(self, on_error: Callable[[BaseException], None], closed: threading.Event):
        self._q: deque = deque()
        self._cv = threading.Condition()
        self._on_error = on_error
        self._closed = closed
        threading.Thread(target=self._run, name="fake-cuda-stream", daemon=True).start()

    def put(self, fn) -> None:
        with self._cv:
            self._q.append(fn)
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q:
                    if self._closed.is_set():
                        return
                    self._cv.wait(_IDLE_POLL_S)
                fn = self._q.popleft()
            try:
                fn()
            except Aborted:
                pass  # an aborted NCCL kernel exits; the stream goes on
            except Exception as exc:  # noqa: BLE001 - NCCL reports it asynchronously
                self._on_error(exc)


class Immediate:
    """The caller's stream: host code is synchronous here, so work runs inline."""

    def put(self, fn) -> None:
        fn()


class FakeEvent(threading.Event):
    """A CUDA event: set when its stream reaches it."""


class World:
    """What the ranks of one communicator share."""

    def __init__(self, size: int):
        self.size = size
        self.cv = threading.Condition()
        self.joined = 0
        self.slots: dict = {}
        self.mail: dict = {}
        self.comms: list = []


class FakeComm:
    """One rank's NCCL communicator."""

    def __init__(self, world: World, rank: int):
        self.w, self.rank, self.k = world, rank, 0
        self.aborted = self.destroyed = False
        self.async_err = None
        self.abort_hangs = False

    def _enqueue(self, stream, fn) -> None:
        """Queue `fn` on `stream`; an error inside it becomes this communicator's async error."""
        def run():
            try:
                fn()
            except Aborted:
                raise
            except Exception as exc:  # noqa: BLE001 - NCCL reports it asynchronously
                if self.async_err is None:
                    self.async_err = f"NCCL_ERROR_INVALID_USAGE: {type(exc).__name__}: {exc}"
        stream.put(run)

    def _slot(self, kind, payload: np.ndarray) -> dict:
        """Post this rank's part of its next collective; the parts of all ranks once they match."""
        w = self.w
        with w.cv:
            self.k += 1
            key = (self.k, kind, payload.nbytes)
            w.slots.setdefault(key, {})[self.rank] = payload
            w.cv.notify_all()
            while len(w.slots[key]) < w.size:
                if self.aborted:
                    raise Aborted()
                w.cv.wait(0.05)
            return w.slots[key]

    def _reduce(self, parts: dict, spec, like: np.ndarray) -> np.ndarray:
        f = {nrt.NCCL_SUM: np.add, nrt.NCCL_PROD: np.multiply, nrt.NCCL_MAX: np.maximum,
             nrt.NCCL_MIN: np.minimum, nrt.NCCL_AVG: np.add}[spec.op]
        mine = np.asarray(like)
        views = [np.asarray(parts[q]).reshape(-1).view(mine.dtype) for q in range(self.w.size)]
        acc = views[0].copy()
        for v in views[1:]:
            acc = f(acc, v)
        if spec.op == nrt.NCCL_AVG:
            acc = (acc / self.w.size).astype(mine.dtype)
        return acc.reshape(mine.shape)

    def all_reduce(self, send, recv, spec, stream):
        self._enqueue(stream, lambda: np.copyto(
            recv, self._reduce(self._slot("all_reduce", np.array(send)), spec, recv)))

    def reduce(self, send, recv, spec, root, stream):
        def run():
            parts = self._slot(("reduce", root), np.array(send))
            if self.rank == root:
                np.copyto(recv, self._reduce(parts, spec, recv))
        self._enqueue(stream, run)

    def broadcast(self, buf, root, stream):
        def run():
            part = self._slot(("broadcast", root), np.array(buf))[root]
            np.copyto(buf, np.asarray(part).reshape(-1).view(buf.dtype).reshape(buf.shape))
        self._enqueue(stream, run)

    def all_gather(self, send, recv_flat, stream):
        def run():
            parts = self._slot("all_gather", np.array(send).reshape(-1).view(np.uint8))
            raw = recv_flat.reshape(-1).view(np.uint8)
            n = send.nbytes
            for q in range(self.w.size):
                raw[q * n:(q + 1) * n] = parts[q]
        self._enqueue(stream, run)

    def reduce_scatter(self, send_flat, recv, spec, stream):
        def run():
            parts = self._slot("reduce_scatter", np.array(send_flat).reshape(-1))
            n = recv.size
            mine = {q: np.asarray(p).view(recv.dtype)[self.rank * n:(self.rank + 1) * n]
                    for q, p in parts.items()}
            np.copyto(recv, self._reduce(mine, spec, recv))
        self._enqueue(stream, run)

    def send(self, buf, peer, stream):
        def run():
            with self.w.cv:
                self.w.mail.setdefault((self.rank, peer), deque()).append(np.array(buf))
                self.w.cv.notify_all()
        self._enqueue(stream, run)

    def recv(self, buf, peer, stream):
        def run():
            w = self.w
            with w.cv:
                while not w.mail.get((peer, self.rank)):
                    if self.aborted:
                        raise Aborted()
                    w.cv.wait(0.05)
                got = w.mail[(peer, self.rank)].popleft()
            if got.nbytes != buf.nbytes:
                raise RuntimeError(f"NCCL_ERROR_INVALID_USAGE: recv of {buf.nbytes} bytes from "
                                   f"rank {peer}, which sent {got.nbytes}")
            np.copyto(buf, got.reshape(-1).view(buf.dtype).reshape(buf.shape))
        self._enqueue(stream, run)

    def async_error(self):
        return self.async_err

    def abort(self):
        if self.abort_hangs:
            threading.Event().wait(60)  # an ncclCommAbort that does not come back
        self.aborted = True

    def destroy(self):
        self.destroyed = True


class FakeRuntime:
    """The runtime interface of `collectives.backends.nccl.runtime.CupyRuntime`, on threads."""

    def __init__(self, worlds: dict, version: int = 22000, devices: int = 4, device: int = 0):
        self.worlds = worlds
        self.nccl_version = version
        self._devices = devices
        self._device = device  # where this rank's Dev arrays live
        self._local = threading.local()
        self._closed = threading.Event()
        self.stream_errors: list = []  # errors of stream work outside any communicator
        self.comm = None

    def close(self) -> None:
        """End the stream threads once their queues are empty."""
        self._closed.set()

    def _cur(self):
        return getattr(self._local, "stream", None) or Immediate()

    def device_count(self):
        return self._devices

    def current_device(self):
        return 0

    def use_device(self, index):
        pass

    def device_context(self, index):
        return contextlib.nullcontext()

    def is_device_array(self, a):
        return isinstance(a, Dev)

    def array_device(self, a):
        return 99 if isinstance(a, Dev1) else self._device

    def address(self, a):
        return a.__array_interface__["data"][0]

    def flat_view(self, first, count):
        flat = first.reshape(-1)
        return np.lib.stride_tricks.as_strided(flat, (count,), (flat.itemsize,)).view(Dev)

    def new_stream(self):
        return FakeStream(self.stream_errors.append, self._closed)

    def current_stream(self):
        return self._cur()

    @contextlib.contextmanager
    def stream_context(self, stream):
        prev = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = prev

    def record(self, stream):
        ev = FakeEvent()
        stream.put(ev.set)
        return ev

    def wait_event(self, stream, ev):
        stream.put(lambda: ev.wait(30))

    def query(self, ev):
        return ev.is_set()

    def empty(self, shape, dtype):
        return np.zeros(shape, dtype).view(Dev)

    def upload(self, host, stream):
        d = np.empty(host.shape, host.dtype).view(Dev)
        pinned = np.array(host)
        stream.put(lambda: np.copyto(d, pinned))
        return d, pinned

    def download(self, d, stream):
        pinned = np.empty(d.shape, d.dtype)
        stream.put(lambda: np.copyto(pinned, d))
        return pinned

    def copy(self, dst, src):
        self._cur().put(lambda: np.copyto(dst, src.reshape(dst.shape)))

    def divide(self, arr, n):
        self._cur().put(lambda: np.divide(arr, n, out=arr, casting="unsafe"))

    def flatten(self, arrays, out):
        def run():
            off = 0
            for a in arrays:
                out[off:off + a.size] = a.reshape(-1)
                off += a.size
        self._cur().put(run)

    def unique_id(self):
        return os.urandom(nrt.UNIQUE_ID_BYTES)

    def communicator(self, size, uid, rank):
        with self.worlds["lock"]:
            w = self.worlds.setdefault(uid, World(size))
        comm = FakeComm(w, rank)
        with w.cv:
            w.joined += 1
            w.comms.append(comm)
            w.cv.notify_all()
            end = time.monotonic() + 60
            while w.joined < size and time.monotonic() < end:
                w.cv.wait(0.05)  # ncclCommInitRank blocks until every rank joined
        self.comm = comm
        return comm

    def group(self):
        return contextlib.nullcontext()


def new_worlds() -> dict[str, Any]:
    """What the ranks of one job share: their communicators, by unique id."""
    return {"lock": threading.Lock()}
