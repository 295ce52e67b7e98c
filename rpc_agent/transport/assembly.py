"""Matching data-channel buffers to the control frames that refer to them.

A frame's large buffers arrive on the data channel, possibly before the frame itself arrives
on the gRPC stream. Whichever side comes second completes the set and hands the frame on, so
neither the stream's thread nor a data reader ever waits for the other.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

import numpy as np

logger = logging.getLogger(__name__)

Key = tuple  # (peer id, transfer id)


class _Pending:
    __slots__ = ("frame", "stream", "payload", "buffers", "missing", "done", "expected")

    def __init__(self, frame, stream, done):
        self.frame = frame
        self.stream = stream
        self.done = done
        self.payload = None
        self.buffers: list = []
        self.missing = 0
        self.expected: dict[Key, tuple[int, int]] = {}  # key -> (slot, nbytes); slot -1 payload


class Assembler:
    """Holds arrived transfers and frames waiting for transfers."""

    def __init__(self):
        self._lock = threading.Lock()
        self._arrived: dict[Key, np.ndarray] = {}
        self._waiting: dict[Key, _Pending] = {}
        # Transfers of frames nobody wants (late replies): dropped on arrival.
        self._unwanted: set[Key] = set()

    def expect(self, peer_id: int, frame, stream,
               done: Callable[[object, object, list, Optional[str]], None]) -> None:
        """Collect `frame`'s payload and buffers; then call `done(frame, payload, buffers, error)`.

        Inline buffers are copied into bytearrays so that arrays rebuilt on them are writable,
        as those received over the data channel are.
        """
        pending = _Pending(frame, stream, done)
        with self._lock:
            ref = frame.payload_ref if frame.HasField("payload_ref") else None
            if ref is not None and ref.on_data_channel:
                self._take(pending, (peer_id, ref.transfer_id), -1, ref.nbytes)
            else:
                pending.payload = frame.payload
            for slot, desc in enumerate(frame.buffers):
                if desc.on_data_channel:
                    pending.buffers.append(None)
                    self._take(pending, (peer_id, desc.transfer_id), slot, desc.nbytes)
                else:
                    pending.buffers.append(bytearray(desc.inline_data))
            complete = pending.missing == 0
        if complete:
            self._finish(pending, None)

    def _take(self, pending: _Pending, key: Key, slot: int, nbytes: int) -> None:
        array = self._arrived.pop(key, None)
        if array is None:
            pending.missing += 1
            pending.expected[key] = (slot, nbytes)
            self._waiting[key] = pending
        else:
            self._place(pending, slot, array, nbytes)

    @staticmethod
    def _place(pending: _Pending, slot: int, array: np.ndarray, nbytes: int) -> None:
        if array.nbytes != nbytes:
            # Leave the slot empty; _finish reports the mismatch.
            pending.expected[("size", slot)] = (slot, nbytes)
            return
        if slot == -1:
            pending.payload = array
        else:
            pending.buffers[slot] = array

    def discard(self, peer_id: int, frame) -> None:
        """Nobody will use `frame` (a reply to a call that timed out): forget its transfers,
        now or when they arrive, so their memory is not held for good."""
        keys = [(peer_id, ref.transfer_id) for ref in _data_refs(frame)]
        with self._lock:
            for key in keys:
                if self._arrived.pop(key, None) is None:
                    self._unwanted.add(key)

    def arrived(self, peer_id: int, transfer_id: int, array: np.ndarray) -> None:
        """A transfer finished on the data channel (called on its reader thread)."""
        key = (peer_id, transfer_id)
        with self._lock:
            pending = self._waiting.pop(key, None)
            if pending is None:
                if key in self._unwanted:
                    self._unwanted.discard(key)
                else:
                    self._arrived[key] = array
                return
            slot, nbytes = pending.expected.pop(key)
            self._place(pending, slot, array, nbytes)
            pending.missing -= 1
            complete = pending.missing == 0
        if complete:
            self._finish(pending, None)

    def _finish(self, pending: _Pending, error: Optional[str]) -> None:
        if error is None:
            bad = [k for k in pending.expected if k[0] == "size"]
            if bad:
                error = (
                    f"a data-channel buffer for slot {bad[0][1]} does not have the "
                    f"{pending.expected[bad[0]][1]} bytes its frame announced"
                )
        pending.done(pending.frame, pending.payload, pending.buffers, error)

    def drop_peer(self, peer_id: int, reason: str) -> None:
        """The data channel to `peer_id` died: fail its waiting frames, forget its transfers."""
        failed = []
        with self._lock:
            for key in [k for k in self._arrived if k[0] == peer_id]:
                del self._arrived[key]
            self._unwanted = {k for k in self._unwanted if k[0] != peer_id}
            for key in [k for k in self._waiting if k[0] == peer_id]:
                pending = self._waiting.pop(key)
                if pending not in failed:
                    failed.append(pending)
        for pending in failed:
            self._finish(pending, f"the data channel died before its buffers arrived ({reason})")

    def drop_stream(self, stream) -> None:
        """Forget frames that came on a stream that died (their caller has failed them)."""
        with self._lock:
            for key in [k for k, p in self._waiting.items() if p.stream is stream]:
                del self._waiting[key]


def _data_refs(frame) -> list:
    """The frame's payload and buffer descriptors that travel on the data channel."""
    refs = [d for d in frame.buffers if d.on_data_channel]
    if frame.HasField("payload_ref") and frame.payload_ref.on_data_channel:
        refs.append(frame.payload_ref)
    return refs
