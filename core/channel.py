"""Session keys and per-frame integrity for connections that passed the handshake.

The handshake (`core.auth`) proves that both ends hold the job's secret, but a proof alone does
not bind the bytes that follow it: a relay that forwards an honest handshake to the real server
could speak on the connection afterwards. So both ends derive a key per direction from the
secret and both fresh nonces of their handshake (HKDF-SHA256), and every later frame carries a
16-byte tag under that key. A frame's position in the stream enters its tag, so a frame
injected, dropped, replayed or moved fails the next check; a relay without the secret cannot
compute the keys, and a capture cannot be replayed into another connection, whose nonces differ.

Two MACs, chosen by the frame's size (both ends know it before the tag is checked):
- up to SMALL_FRAME_BYTES: keyed BLAKE2b (RFC 7693) under a key of its own derived from the
  direction's key. An RPC message or a control frame is a few hundred bytes, and there a MAC's
  fixed cost is what counts: in the RPC round trip (four tags, bench/rpc.py sync_64B, fresh
  worker pairs alternating with a tree whose tags were constants) AES-GMAC through
  `cryptography` cost 22-28 us, BLAKE2b from a pre-keyed state 6-8 us, though both take 1-1.5 us
  in a tight loop: each GMAC call sets up an OpenSSL cipher context, cold in a worker between
  two messages, where hashlib's BLAKE2 is a small self-contained routine;
- above it: AES-GMAC (AES-GCM with the frame as authenticated data and an empty plaintext),
  about 25 GB/s with AES-NI and carry-less multiply, where BLAKE2b runs at about 1 GB/s.

`encrypt=True` (the `SHOAL_ENCRYPT` setting) also hides payloads: AES-256-GCM over the frame
instead of a tag beside it. Integrity is always on; encryption costs a pass over the bytes each way
(`seal_into`/`open_into` write where the caller says, so no buffer is allocated per frame).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import NamedTuple, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from shoal.core.errors import AuthenticationError

TAG_BYTES = 16
KEY_BYTES = 32
# A GMAC frame's nonce: 8 bytes of its sequence number, 4 bytes of the part it covers. A frame
# of several parts (a header and a payload sent with one sendmsg) gets a tag per part and one
# over those tags, so no part is copied to be authenticated.
_NONCE = struct.Struct(">QI")
_WHOLE = 0xFFFFFFFF
_VERSION = b"shoal channel 1"
# Frames up to this size, all parts together, get a BLAKE2b tag (see above): well past an RPC
# message or a control frame, and below the ~5 KB where, at the costs measured in place (GMAC
# about 5 us more per call, BLAKE2b about 1 GB/s), GMAC would become the cheaper.
SMALL_FRAME_BYTES = 2048
# What a BLAKE2b tag covers first: the frame's position and its number of parts. A frame of
# several parts then gives each part's length before its bytes, so no bytes can move between
# parts, and a one-part frame (no lengths) never reads as a frame of several.
_SMALL_HEAD = struct.Struct("<QI")
_PART_LENGTH = struct.Struct("<Q")


class IntegrityError(AuthenticationError):
    """A frame whose tag does not verify: injected, altered, replayed or out of order.

    The connection cannot be trusted after one; the side that sees it drops the connection.
    """


def _hkdf(secret: bytes, salt: bytes, info: bytes) -> bytes:
    """HKDF-SHA256 (RFC 5869) with one output block: the extract, then one expand step."""
    prk = hmac.new(salt, secret, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


def session_keys(secret: bytes, purpose: str, server_nonce: bytes, client_nonce: bytes,
                 *, server: bool) -> tuple[bytes, bytes]:
    """(send key, receive key) of one end of a connection.

    Each direction has its own key, so a frame sent one way can never verify coming back, and
    the keys bind the connection's purpose and both handshake nonces.
    """
    salt = _VERSION + b"\0" + server_nonce + client_nonce
    base = _VERSION + b"\0" + purpose.encode() + b"\0"
    to_client = _hkdf(secret, salt, base + b"server->client")
    to_server = _hkdf(secret, salt, base + b"client->server")
    return (to_client, to_server) if server else (to_server, to_client)


def _small_frame_mac(key: bytes):
    """A keyed BLAKE2b state to copy per small frame, under a key of its own: the AES key and
    this one never meet in two algorithms."""
    mac_key = _hkdf(key, b"", _VERSION + b"\0small frames: BLAKE2b")
    return hashlib.blake2b(key=mac_key, digest_size=TAG_BYTES)


def _size(part) -> int:
    return len(part) if type(part) is bytes else memoryview(part).nbytes


class Sealer:
    """The sending half: tags (or encrypts) each frame in order."""

    __slots__ = ("_aead", "_small", "_seq", "encrypt")

    def __init__(self, key: bytes, encrypt: bool = False):
        if len(key) != KEY_BYTES:
            raise ValueError(f"a channel key is {KEY_BYTES} bytes, got {len(key)}")
        self._aead = AESGCM(key)
        self._small = _small_frame_mac(key)
        self._seq = 0
        self.encrypt = encrypt

    def tag(self, parts: Sequence) -> bytes:
        """The tag of the next frame, made of `parts` (bytes-like, sent in this order)."""
        seq = self._seq
        self._seq = seq + 1
        return _tag(self._aead, self._small, seq, parts)

    def seal(self, data) -> bytes:
        """The next frame encrypted, with its tag at the end (`encrypt` mode)."""
        seq = self._seq
        self._seq = seq + 1
        return self._aead.encrypt(_NONCE.pack(seq, _WHOLE), data, None)

    def seal_into(self, data, out) -> None:
        """Encrypt the next frame into `out` (len(data) + TAG_BYTES writable bytes): ciphertext,
        then tag, with no buffer allocated (`encrypt` mode)."""
        seq = self._seq
        self._seq = seq + 1
        self._aead.encrypt_into(_NONCE.pack(seq, _WHOLE), data, None, out)


class Opener:
    """The receiving half: checks each frame's tag (or decrypts it) in order."""

    __slots__ = ("_aead", "_small", "_seq", "encrypt", "peer")

    def __init__(self, key: bytes, encrypt: bool = False, peer: str = "the peer"):
        if len(key) != KEY_BYTES:
            raise ValueError(f"a channel key is {KEY_BYTES} bytes, got {len(key)}")
        self._aead = AESGCM(key)
        self._small = _small_frame_mac(key)
        self._seq = 0
        self.encrypt = encrypt
        self.peer = peer

    def check(self, parts: Sequence, tag) -> None:
        """Verify the next frame's `tag` over `parts`.

        Raises:
            IntegrityError: the frame is not the next one `peer` sent with this connection's key.
        """
        seq = self._seq
        self._seq = seq + 1
        expected = _tag(self._aead, self._small, seq, parts)
        # compare_digest takes any bytes-like `tag` (a view of the received message) as is.
        if not hmac.compare_digest(expected, tag):
            raise IntegrityError(self._refusal(seq))

    def open(self, sealed) -> bytes:
        """The next frame decrypted (`encrypt` mode).

        Raises:
            IntegrityError: as `check`.
        """
        seq = self._seq
        self._seq = seq + 1
        try:
            return self._aead.decrypt(_NONCE.pack(seq, _WHOLE), sealed, None)
        except InvalidTag:
            raise IntegrityError(self._refusal(seq)) from None

    def open_into(self, sealed, out) -> None:
        """Decrypt the next frame into `out` (len(sealed) - TAG_BYTES writable bytes), with no
        buffer allocated (`encrypt` mode); `out` holds garbage if it fails.

        Raises:
            IntegrityError: as `check`.
        """
        seq = self._seq
        self._seq = seq + 1
        try:
            self._aead.decrypt_into(_NONCE.pack(seq, _WHOLE), sealed, None, out)
        except InvalidTag:
            raise IntegrityError(self._refusal(seq)) from None

    def _refusal(self, seq: int) -> str:
        return (f"Frame {seq} from {self.peer} failed its integrity check: it was altered, "
                f"injected or replayed, or the sender does not hold this connection's keys. "
                f"The connection is dropped.")


def _tag(aead: AESGCM, small, seq: int, parts: Sequence) -> bytes:
    """Frame `seq`'s tag: BLAKE2b (copied from the keyed state `small`) up to
    SMALL_FRAME_BYTES, else AES-GMAC under `aead`."""
    if len(parts) == 1:  # every RPC message: the fewest calls
        part = parts[0]
        if _size(part) <= SMALL_FRAME_BYTES:
            mac = small.copy()
            mac.update(_SMALL_HEAD.pack(seq, 1))
            mac.update(part)
            return mac.digest()
        return aead.encrypt(_NONCE.pack(seq, _WHOLE), b"", part)
    sizes = [_size(part) for part in parts]
    if sum(sizes) <= SMALL_FRAME_BYTES:
        mac = small.copy()
        mac.update(_SMALL_HEAD.pack(seq, len(parts)))
        for part, size in zip(parts, sizes):
            mac.update(_PART_LENGTH.pack(size))
            mac.update(part)
        return mac.digest()
    # A tag per part and one over those tags, so no part is copied to be authenticated.
    tags = b"".join(aead.encrypt(_NONCE.pack(seq, i), b"", part) for i, part in enumerate(parts))
    return aead.encrypt(_NONCE.pack(seq, _WHOLE), b"", tags)


class Link(NamedTuple):
    """One end of an authenticated connection: how it seals what it sends and opens what it
    receives."""

    sealer: Sealer
    opener: Opener

    @property
    def encrypt(self) -> bool:
        """Whether frames are encrypted (else tagged)."""
        return self.sealer.encrypt


def pair(secret: bytes, purpose: str, server_nonce: bytes, client_nonce: bytes, *, server: bool,
         encrypt: bool = False, peer: str = "the peer") -> Link:
    """The `Link` of one end of a connection whose handshake used these nonces."""
    send, recv = session_keys(secret, purpose, server_nonce, client_nonce, server=server)
    return Link(Sealer(send, encrypt), Opener(recv, encrypt, peer))
