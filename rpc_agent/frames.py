"""How a call, reply or remote() becomes one wire frame, and which of its buffers leave on the
data channel instead of inline (see the transport seam in docs/design.md)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from shoal.rpc_agent._generated import rpc_pb2
from shoal.rpc_agent.serialization import serialize

CALL, REMOTE_CALL = rpc_pb2.CALL, rpc_pb2.REMOTE_CALL
RESPONSE, ERROR, HELLO = rpc_pb2.RESPONSE, rpc_pb2.ERROR, rpc_pb2.HELLO
# Inline buffers of one frame stop here; the rest take the data channel whatever their size.
INLINE_BUDGET_BYTES = 4 * 1024 * 1024


class FrameEncoder:
    """Serializes frames for one worker: buffers (and pickles) of at least `threshold` bytes,
    and those past the inline budget, get a transfer id from `new_transfer_id` and travel on the
    data channel; frames to the worker itself keep everything inline."""

    def __init__(self, worker_id: int, threshold: int, new_transfer_id: Callable[[], int]):
        self._worker_id = worker_id
        self._threshold = threshold
        self._new_transfer_id = new_transfer_id

    def encode(self, kind: int, rid: int, fname: str, obj: Any, dst_id: int,
               rref_id=None, cid: Optional[int] = None,
               accepts: Optional[list] = None) -> tuple[bytes, list]:
        """One frame and its data-channel part, [(transfer id, buffer)]; `cid`, the call's
        distributed autograd context, rides on calls and records the Tensors that require grad
        (on replies too); `accepts` collects the RRef forks the call's reply accepts."""
        payload, buffers = serialize(obj, dst_id, cid, accepts)
        frame = rpc_pb2.Frame(kind=kind, request_id=rid, function=fname)
        if kind != RESPONSE and cid is not None:
            frame.context_id = cid
        if rref_id is not None:
            frame.rref_id.created_on, frame.rref_id.local_id = rref_id
            frame.fork_id.created_on, frame.fork_id.local_id = rref_id
        local = dst_id == self._worker_id
        threshold = self._threshold if not local else float("inf")
        # Many small buffers must not add up to a gRPC message above its bound either.
        inline_left = INLINE_BUDGET_BYTES if not local else float("inf")
        big = []
        for buf in buffers:
            desc = frame.buffers.add()
            desc.nbytes = buf.nbytes
            if buf.nbytes >= threshold or buf.nbytes > inline_left:
                desc.on_data_channel = True
                desc.transfer_id = self._new_transfer_id()
                big.append((desc.transfer_id, buf))
            else:
                desc.inline_data = buf.tobytes()
                inline_left -= buf.nbytes
        if len(payload) >= threshold:
            ref = frame.payload_ref
            ref.nbytes = len(payload)
            ref.on_data_channel = True
            ref.transfer_id = self._new_transfer_id()
            big.append((ref.transfer_id, memoryview(payload)))
        else:
            frame.payload = payload
        return frame.SerializeToString(), big


def needs_assembly(frame) -> bool:
    """True when part of `frame` (its pickle or a buffer) comes on the data channel."""
    if frame.HasField("payload_ref"):
        return True
    for desc in frame.buffers:
        if desc.on_data_channel:
            return True
    return False
