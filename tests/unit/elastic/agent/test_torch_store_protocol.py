"""torch's TCPStore protocol as the agent's store door parses it (elastic/agent/torch_store.py):
commands split at every byte, parked waits, and the limits that end a connection.

The answers themselves are checked against torch's own client in
tests/integration/test_worker_store_door.py; these cases need no torch.
"""

from __future__ import annotations

import struct

import pytest

from shoal.elastic.agent.torch_store import (
    MAX_PAYLOAD_LEN,
    MAX_STRING_LEN,
    VALIDATION_MAGIC,
    ProtocolError,
    Query,
    TorchConnection,
    TorchStoreState,
)

VALIDATE = bytes([Query.VALIDATE]) + struct.pack("<I", VALIDATION_MAGIC)


def _s(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _conn(state=None):
    sent: list[bytes] = []
    conn = TorchConnection(state or TorchStoreState(), sent.append)
    conn.feed(VALIDATE)
    return conn, sent


def test_a_command_split_at_every_byte_runs_once_whole():
    conn, sent = _conn()
    command = bytes([Query.ADD]) + _s(b"/n") + struct.pack("<q", 7)
    for i in range(len(command)):
        conn.feed(command[i:i + 1])
    assert sent == [struct.pack("<q", 7)]


def test_two_commands_in_one_read_both_run():
    conn, sent = _conn()
    conn.feed(bytes([Query.SET]) + _s(b"k") + _s(b"v") + bytes([Query.GET]) + _s(b"k"))
    assert sent == [_s(b"v")]


def test_a_wait_is_answered_when_its_last_key_is_set_and_not_before():
    state = TorchStoreState()
    waiter, answers = _conn(state)
    setter, _ = _conn(state)
    waiter.feed(bytes([Query.WAIT]) + struct.pack("<Q", 2) + _s(b"a") + _s(b"b"))
    setter.feed(bytes([Query.SET]) + _s(b"a") + _s(b"1"))
    assert answers == []
    setter.feed(bytes([Query.SET]) + _s(b"b") + _s(b"2"))
    assert answers == [b"\x00"]  # STOP_WAITING


def test_a_cancelled_wait_is_never_answered_later():
    state = TorchStoreState()
    waiter, answers = _conn(state)
    setter, _ = _conn(state)
    waiter.feed(bytes([Query.WAIT]) + struct.pack("<Q", 1) + _s(b"x"))
    waiter.feed(bytes([Query.CANCEL_WAIT]))
    setter.feed(bytes([Query.SET]) + _s(b"x") + _s(b"1"))
    assert answers == [b"\x01"]  # WAIT_CANCELED only


def test_a_closed_connection_leaves_no_wait_behind():
    state = TorchStoreState()
    waiter, answers = _conn(state)
    waiter.feed(bytes([Query.WAIT]) + struct.pack("<Q", 1) + _s(b"x"))
    waiter.close()
    setter, _ = _conn(state)
    setter.feed(bytes([Query.SET]) + _s(b"x") + _s(b"1"))
    assert answers == []


@pytest.mark.parametrize("data, match", [
    (bytes([Query.SET]) + _s(b"k") + _s(b"v"), "SET before VALIDATE"),
    (bytes([Query.VALIDATE]) + struct.pack("<I", 1), "not torch's magic number"),
    (bytes([200]), "unknown command byte 200"),
], ids=["set-first", "bad-magic", "unknown"])
def test_what_torchs_client_never_sends_ends_the_connection(data, match):
    conn = TorchConnection(TorchStoreState(), lambda _: None)
    with pytest.raises(ProtocolError, match=match):
        conn.feed(data)


@pytest.mark.parametrize("field, limit", [("key", MAX_STRING_LEN), ("value", MAX_PAYLOAD_LEN)])
def test_a_length_over_torchs_limit_is_refused_before_its_bytes_arrive(field, limit):
    conn, _ = _conn()
    if field == "key":
        header = bytes([Query.SET]) + struct.pack("<Q", limit + 1)
    else:
        header = bytes([Query.SET]) + _s(b"k") + struct.pack("<Q", limit + 1)
    with pytest.raises(ProtocolError, match=f"a {field} of {limit + 1} bytes"):
        conn.feed(header)


def test_add_on_a_value_that_is_not_a_number_is_refused():
    conn, _ = _conn()
    conn.feed(bytes([Query.SET]) + _s(b"k") + _s(b"text"))
    with pytest.raises(ProtocolError, match="is not a number"):
        conn.feed(bytes([Query.ADD]) + _s(b"k") + struct.pack("<q", 1))
