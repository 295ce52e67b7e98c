"""A small control message travels as one joined frame (`wire.CONTROL_JOINED_MAGIC`: header,
fingerprint and payload under one tag). Its receiver sizes the rest of the frame by a header it
has not checked yet, so it must bound those lengths first, and still obey nothing before the
tag checks out. Frames made up here go straight onto a real control connection.

(Every body size around the joined bound, tagged and sealed, is in
test_control_reading_receiver.)"""

from __future__ import annotations

import json
import time

import pytest

from shoal.collectives.backends.tcp import wire
from shoal.collectives.backends.tcp.control import JOIN_MAX_BYTES
from shoal.collectives.backends.tcp.framing import TAG
from shoal.collectives.constants import MAX_FINGERPRINT_BYTES
from tests.unit.collectives.test_control_reading_receiver import ARRIVAL_S, _close, _never, _open


def _joined(kind: int, fp: bytes, payload: bytes, claimed_payload: int | None = None) -> bytes:
    """A joined frame with a tag nobody made (zeros), its header claiming `claimed_payload`."""
    n = len(payload) if claimed_payload is None else claimed_payload
    head = wire.CONTROL_HEADER.pack(wire.CONTROL_JOINED_MAGIC, kind, 0, len(fp), n)
    return head + fp + payload + bytes(TAG)


@pytest.mark.parametrize("reader", ["service", "receiver"])
def test_a_forged_joined_abort_is_refused_not_obeyed(reader):
    sender, receiver, (failures, got_failure), spin = _open(0.0)
    try:
        cause = json.dumps({"kind": "error", "cause": "forged", "origin": 0, "culprits": [1]})
        sender.socks[1].sendall(_joined(wire.KIND_ABORT, b"", cause.encode()))
        if reader == "receiver":
            # Stopped by the failure, as a group's receive is (`links.failed`).
            assert receiver.take_p2p_reading(0, 1, got_failure.is_set,
                                             time.monotonic() + ARRIVAL_S, spin) is None
        assert got_failure.wait(ARRIVAL_S)
        assert "integrity" in failures[0].cause and failures[0].culprits == (0,)
    finally:
        _close(sender, receiver)


@pytest.mark.parametrize("fp_len, payload", [
    (0, JOIN_MAX_BYTES + 1),  # a payload that would go split
    (0, 1 << 40),  # a terabyte: nothing may be allocated or awaited for it
    (MAX_FINGERPRINT_BYTES + 1, 0),
])
def test_a_joined_header_out_of_bounds_drops_the_connection_at_once(fp_len, payload):
    sender, receiver, (failures, got_failure), _spin = _open(0.0)
    try:
        head = wire.CONTROL_HEADER.pack(wire.CONTROL_JOINED_MAGIC, wire.KIND_P2P, 0, fp_len,
                                        payload)
        # The header and a tag's worth of bytes: all the reader needs to see the lengths.
        sender.socks[1].sendall(head + bytes(TAG))
        assert got_failure.wait(ARRIVAL_S)
        assert "integrity" in failures[0].cause and failures[0].culprits == (0,)
    finally:
        _close(sender, receiver)


def test_a_joined_message_is_one_frame_with_one_tag():
    sender, receiver, (failures, _event), spin = _open(0.0)
    try:
        payload = bytes(range(256)) * 16  # 4 KiB
        frames = sender._message(1, wire.KIND_P2P, 5, b"p2p(uint8[4096])", payload)
        assert len(frames) == 2 and len(frames[1]) == TAG
        assert frames[0][:4] == wire.CONTROL_JOINED_MAGIC
        wire.send_all(sender.socks[1], frames)
        got = receiver.take_p2p_reading(0, 5, _never, time.monotonic() + ARRIVAL_S, spin)
        assert got is not None and (got[1], bytes(got[2])) == (b"p2p(uint8[4096])", payload)
        assert failures == []
    finally:
        _close(sender, receiver)
