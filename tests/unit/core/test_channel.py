"""Per-connection keys and frame tags (core.channel): what a relay or a capture can no longer do."""

import hashlib
import hmac
import os
import struct

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

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


# -- the two MACs: keyed BLAKE2b up to SMALL_FRAME_BYTES, AES-GMAC above

def _hkdf(secret, salt, info):  # RFC 5869, one block, written out here as the reference
    prk = hmac.new(salt, secret, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


@pytest.mark.parametrize("size", [0, 1, channel.SMALL_FRAME_BYTES, channel.SMALL_FRAME_BYTES + 1,
                                  1 << 20])
def test_frames_either_side_of_the_size_boundary_verify_and_an_altered_byte_fails(size):
    (s_seal, s_open), (c_seal, c_open) = _ends()
    frame = bytearray(os.urandom(size))
    s_open.check([frame], c_seal.tag([frame]))
    s_open.check([frame[:size // 2], frame[size // 2:]],
                 c_seal.tag([frame[:size // 2], frame[size // 2:]]))
    if size:
        tag = c_seal.tag([frame])
        frame[size // 3] ^= 0x40
        with pytest.raises(IntegrityError):
            s_open.check([frame], tag)


def test_a_small_frames_tag_is_blake2b_under_a_key_of_its_own_over_the_documented_layout():
    send, _ = channel.session_keys(SECRET, "store", S_NONCE, C_NONCE, server=False)
    (_, s_open), (c_seal, _) = _ends()
    one, head, body = b"an rpc message", b"head", b"payload"
    mac_key = _hkdf(send, b"", b"shoal channel 1\0small frames: BLAKE2b")
    expect_one = hashlib.blake2b(struct.pack("<QI", 0, 1) + one, key=mac_key,
                                 digest_size=16).digest()
    expect_two = hashlib.blake2b(
        struct.pack("<QIQ", 1, 2, len(head)) + head + struct.pack("<Q", len(body)) + body,
        key=mac_key, digest_size=16).digest()
    assert c_seal.tag([one]) == expect_one and c_seal.tag([head, body]) == expect_two
    # Neither the direction's AES key (GMAC) nor BLAKE2b under that same key makes a tag the
    # receiver takes for a small frame: the two algorithms never share a key.
    gmac = AESGCM(send).encrypt(struct.pack(">QI", 0, 0xFFFFFFFF), b"", one)
    same_key = hashlib.blake2b(struct.pack("<QI", 0, 1) + one, key=send, digest_size=16).digest()
    for forged in (gmac, same_key):
        with pytest.raises(IntegrityError):
            channel.pair(SECRET, "store", S_NONCE, C_NONCE, server=True)[1].check([one], forged)
    s_open.check([one], expect_one)


def test_a_frame_of_one_part_and_one_of_several_with_the_same_bytes_have_different_tags():
    (_, _), (c_seal, _) = _ends()
    (_, _), (c_seal2, _) = _ends()
    assert c_seal.tag([b"abcd"]) != c_seal2.tag([b"ab", b"cd"])


def test_moving_bytes_between_the_parts_of_a_large_frame_fails():
    (_, s_open), (c_seal, _) = _ends()
    big = os.urandom(channel.SMALL_FRAME_BYTES * 2)
    tag = c_seal.tag([big[:10], big[10:]])
    with pytest.raises(IntegrityError):
        s_open.check([big[:11], big[11:]], tag)
