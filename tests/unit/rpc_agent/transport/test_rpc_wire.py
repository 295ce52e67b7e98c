"""Wire pieces: batch encoding, buffer assembly in either arrival order, call deadlines."""

from __future__ import annotations

import threading
import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.rpc_agent._generated import rpc_pb2
from shoal.rpc_agent._threads import Deadlines
from shoal.rpc_agent.transport.assembly import Assembler
from shoal.rpc_agent.transport.stream import encode_batch

_frames = st.lists(
    st.builds(
        lambda kind, rid, fn, payload: rpc_pb2.Frame(
            kind=kind, request_id=rid, function=fn, payload=payload
        ),
        st.sampled_from([rpc_pb2.CALL, rpc_pb2.RESPONSE, rpc_pb2.ERROR]),
        st.integers(0, 2**64 - 1),
        st.text(max_size=30),
        st.binary(max_size=300),
    ),
    max_size=20,
)


@settings(max_examples=40, deadline=None)
@given(_frames)
def test_encode_batch_equals_protobufs_own_encoding(frames):
    encoded = encode_batch([f.SerializeToString() for f in frames])
    assert encoded == rpc_pb2.Batch(frames=frames).SerializeToString()
    assert list(rpc_pb2.Batch.FromString(encoded).frames) == frames


def _frame_with(transfers, inline=b"abc"):
    frame = rpc_pb2.Frame(kind=rpc_pb2.CALL, request_id=1, payload=b"pickle")
    d = frame.buffers.add()
    d.nbytes = len(inline)
    d.inline_data = inline
    for tid, n in transfers:
        d = frame.buffers.add()
        d.nbytes = n
        d.on_data_channel = True
        d.transfer_id = tid
    return frame


def test_assembly_completes_whichever_side_arrives_last():
    done = []
    asm = Assembler()
    on_done = lambda f, p, b, e: done.append((p, [bytes(x) for x in b], e))  # noqa: E731
    # The frame first, then its two transfers.
    asm.expect(3, _frame_with([(10, 4), (11, 2)]), "s", on_done)
    assert done == []
    asm.arrived(3, 11, np.frombuffer(b"yz", np.uint8).copy())
    assert done == []
    asm.arrived(3, 10, np.frombuffer(b"wxyz", np.uint8).copy())
    assert done == [(b"pickle", [b"abc", b"wxyz", b"yz"], None)]
    # A transfer first (same id from another peer must not match), then the frame.
    done.clear()
    asm.arrived(4, 12, np.zeros(2, np.uint8))
    asm.arrived(3, 12, np.ones(2, np.uint8))
    asm.expect(3, _frame_with([(12, 2)]), "s", on_done)
    assert done == [(b"pickle", [b"abc", b"\x01\x01"], None)]


def test_assembly_reports_a_size_mismatch_and_a_dead_channel():
    done = []
    asm = Assembler()
    on_done = lambda f, p, b, e: done.append(e)  # noqa: E731
    asm.expect(1, _frame_with([(5, 8)]), "s", on_done)
    asm.arrived(1, 5, np.zeros(3, np.uint8))
    assert done == ["a data-channel buffer for slot 1 does not have the 8 bytes its frame "
                    "announced"]
    asm.expect(2, _frame_with([(6, 8)]), "s", on_done)
    asm.drop_peer(2, "reset by peer")
    assert done[-1] == "the data channel died before its buffers arrived (reset by peer)"


def test_a_discarded_frame_keeps_none_of_its_transfers_whichever_comes_first():
    asm = Assembler()
    frame = _frame_with([(20, 4), (21, 4)])
    frame.payload_ref.on_data_channel = True
    frame.payload_ref.transfer_id = 22
    frame.payload_ref.nbytes = 6
    asm.arrived(5, 20, np.zeros(4, np.uint8))     # before the frame
    asm.arrived(5, 99, np.zeros(1, np.uint8))     # someone else's transfer
    asm.discard(5, frame)
    asm.arrived(5, 21, np.zeros(4, np.uint8))     # after it
    asm.arrived(5, 22, np.zeros(6, np.uint8))
    assert set(asm._arrived) == {(5, 99)}
    assert asm._unwanted == set()
    # A later frame that reuses nothing still assembles normally.
    done = []
    asm.expect(5, _frame_with([(99, 1)]), "s", lambda f, p, b, e: done.append(e))
    assert done == [None]


def test_inline_buffers_become_writable_bytearrays():
    got = []
    Assembler().expect(1, _frame_with([]), "s", lambda f, p, b, e: got.extend(b))
    assert isinstance(got[0], bytearray)


def test_deadlines_fire_late_keys_and_skip_removed_ones():
    fired = []
    event = threading.Event()

    def expired(key):
        fired.append((key, time.monotonic()))
        if key == 3:
            event.set()

    deadlines = Deadlines(expired, "test")
    try:
        start = time.monotonic()
        deadlines.add(1, 0.3)
        deadlines.add(2, 0.1)
        deadlines.add(3, 0.2)
        deadlines.remove(2, 0.1)
        assert event.wait(5)
        deadlines_seen = dict(fired)
        assert 2 not in deadlines_seen
        assert deadlines_seen[3] - start >= 0.19
        time.sleep(0.2)
        assert [k for k, _ in fired] == [3, 1]
    finally:
        deadlines.stop()
