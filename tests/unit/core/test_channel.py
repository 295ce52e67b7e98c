"""Per-connection keys and frame tags (core.channel): what a relay or a capture can no longer do."""

import os

import pytest

from shoal.core import channel
from shoal.core.channel import IntegrityError

SECRET = b"job-secret"
S_NONCE, C_NONCE = os.urandom(32), os.urandom(32)


def _ends(encrypt=False, purpose="store", s_nonce=S_NONCE, c_nonce=C_NONCE):
    server = channel.pair(SECRET, purpose, s_nonce, c_nonce, server=True, encrypt=encrypt)
    client = channel.pair(SECRET, purpose, s_nonce, c_nonce, server=False, encrypt=encrypt)
    return server, client


def test_frames_verify_in_order_both_ways_single_and_multi_part():
    (s_seal, s_open), (c_seal, c_open) = _ends()
    header, payload = b"head", memoryview(bytearray(os.urandom(100_000)))
    for _ in range(3):
        s_open.check([header, payload], c_seal.tag([header, payload]))
        c_open.check([b"reply"], s_seal.tag([b"reply"]))


@pytest.mark.parametrize("attack", ["altered", "replayed", "reordered", "reflected",
                                    "other connection", "other purpose", "other secret"])
def test_a_frame_that_is_not_the_next_one_sent_fails(attack):
    (s_seal, s_open), (c_seal, c_open) = _ends()
    first, second = c_seal.tag([b"one"]), c_seal.tag([b"two"])
    if attack == "altered":
        with pytest.raises(IntegrityError, match="Frame 0 from the peer failed"):
            s_open.check([b"onE"], first)
    elif attack == "replayed":
        s_open.check([b"one"], first)
        with pytest.raises(IntegrityError):
            s_open.check([b"one"], first)
    elif attack == "reordered":
        with pytest.raises(IntegrityError):
            s_open.check([b"two"], second)
    elif attack == "reflected":  # the client's own frame sent back to it
        with pytest.raises(IntegrityError):
            c_open.check([b"one"], first)
    else:
        other = {"other connection": dict(c_nonce=os.urandom(32)),
                 "other purpose": dict(purpose="collectives")}.get(attack)
        if other is None:
            opener = channel.pair(b"another", "store", S_NONCE, C_NONCE, server=True)[1]
        else:
            opener = _ends(**other)[0][1]
        with pytest.raises(IntegrityError):
            opener.check([b"one"], first)


def test_moving_bytes_between_the_parts_of_a_frame_fails():
    (_, s_open), (c_seal, _) = _ends()
    tag = c_seal.tag([b"ab", b"cd"])
    with pytest.raises(IntegrityError):
        s_open.check([b"a", b"bcd"], tag)


def test_encrypted_frames_hide_the_payload_and_verify():
    (s_seal, s_open), (c_seal, c_open) = _ends(encrypt=True)
    secret_payload = b"pickle bytes " * 100
    sealed = c_seal.seal(secret_payload)
    assert secret_payload[:20] not in sealed and len(sealed) == len(secret_payload) + 16
    assert s_open.open(sealed) == secret_payload
    tampered = bytearray(c_seal.seal(b"x" * 64))
    tampered[3] ^= 1
    with pytest.raises(IntegrityError):
        s_open.open(bytes(tampered))


def test_the_two_directions_have_different_keys():
    send, recv = channel.session_keys(SECRET, "store", S_NONCE, C_NONCE, server=True)
    c_send, c_recv = channel.session_keys(SECRET, "store", S_NONCE, C_NONCE, server=False)
    assert send == c_recv and recv == c_send and send != recv


def test_seal_into_and_open_into_round_trip_without_allocating_and_refuse_a_change():
    (_, s_open), (c_seal, _) = _ends(encrypt=True)
    payload = bytes(range(256)) * 16
    sealed = bytearray(len(payload) + channel.TAG_BYTES)
    c_seal.seal_into(payload, sealed)
    assert payload[:32] not in sealed
    out = bytearray(len(payload))
    s_open.open_into(sealed, memoryview(out))
    assert out == payload
    c_seal.seal_into(payload, sealed)
    sealed[7] ^= 1
    with pytest.raises(IntegrityError):
        s_open.open_into(sealed, out)
