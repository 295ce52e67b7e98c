"""Reports from spawned test processes to the test, over one pipe per process that only the
child can write to, read without ever blocking.

Why not a multiprocessing.Queue: its pipe's writing end stays open in the parent, so a child
that dies halfway through a message (a library aborting at exit while the queue's feeder thread
is still writing) leaves the parent's read blocked forever. Here the parent closes its copy of
the writing end once the child has started, so a dead child reads as end-of-file, and bytes
gather in a buffer as they come, so half a message is visible as such instead of a read that
waits for the rest.

Each message is an 8-byte little-endian length and a pickle.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
from typing import Any, Iterable, Optional

LENGTH = struct.Struct("<Q")


def frame(message: Any) -> bytes:
    """`message` pickled and framed; an unpicklable one becomes an error report saying so."""
    try:
        payload = pickle.dumps(message)
    except Exception as exc:  # noqa: BLE001  (the test's bug: report it, do not lose the rank)
        payload = pickle.dumps(("error", (type(exc).__name__, f"did not pickle: {exc}", "")))
    return LENGTH.pack(len(payload)) + payload


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data` to `fd` from this thread (a blocking pipe: waits for the reader)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class Reader:
    """The parent's end of one child's pipe."""

    def __init__(self, conn):
        self.conn = conn
        self.buffer = bytearray()
        self.eof = False
        os.set_blocking(conn.fileno(), False)

    def fileno(self) -> int:
        return self.conn.fileno()

    def pump(self) -> None:
        """Take whatever has arrived, without waiting."""
        while not self.eof:
            try:
                chunk = os.read(self.conn.fileno(), 1 << 20)
            except BlockingIOError:
                return
            if not chunk:
                self.eof = True
            self.buffer += chunk

    def take(self) -> Optional[Any]:
        """The next whole message (removed from the buffer), or None until all of it came."""
        if len(self.buffer) < LENGTH.size:
            return None
        (size,) = LENGTH.unpack_from(self.buffer)
        end = LENGTH.size + size
        if len(self.buffer) < end:
            return None
        message = pickle.loads(bytes(self.buffer[LENGTH.size:end]))
        del self.buffer[:end]
        return message

    def close(self) -> None:
        self.conn.close()


def ready(readers: Iterable[Reader], timeout: float) -> list[Reader]:
    """Those of `readers` with bytes or an end-of-file to read, waiting up to `timeout`
    seconds; poll(), not select(), since a long pytest run's descriptors may pass 1024."""
    by_fd = {r.fileno(): r for r in readers}
    if not by_fd:
        return []
    poller = select.poll()
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    return [by_fd[fd] for fd, _ in poller.poll(timeout * 1000)]
