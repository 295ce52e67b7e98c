"""A byte pump for tests that put a relay between a client and a server."""

from __future__ import annotations

import socket
from typing import Optional


def pump(src: socket.socket, dst: socket.socket, flip_at: Optional[int] = None) -> None:
    """Copy `src` to `dst` until either closes, flipping the low bit of byte `flip_at` of the
    stream on the way (None: copy unchanged); then shut both down so the other direction's pump
    ends too."""
    seen = 0
    try:
        while True:
            data = bytearray(src.recv(65536))
            if not data:
                break
            if flip_at is not None and seen <= flip_at < seen + len(data):
                data[flip_at - seen] ^= 0x01
            seen += len(data)
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
