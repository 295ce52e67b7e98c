"""The TCPStore wire format: length-prefixed binary frames with bounded sizes, each one
integrity-checked under its connection's keys.

A frame is `u32 n` then n bytes: the body followed by its 16-byte tag, or, when the connection
encrypts (SHOAL_ENCRYPT), the body encrypted with the tag at its end (AES-GCM); n is the body's
length plus 16 either way. The keys are the connection's `core.channel.Link`, derived by the
handshake from the secret and both sides' nonces, one per direction; a frame's nonce is its
position in its direction's stream. So a frame injected, altered, replayed or moved, by a relay
that forwarded an honest handshake or by anyone else, fails its check, and the receiver checks
it before it parses the body (`open_payload`): the server drops that connection, the client
drops its connection to the server.

The body is `u8 code`, `u32 argument_count`, and each argument as `u32 length` + bytes.
Requests carry an `Op` as code, replies a `Status`. Numbers (amounts, timeouts, counts) travel
as ASCII decimals so that one parser covers every message. Lengths are checked against the frame
before anything is sliced, so a hostile length cannot make a reader allocate more than
`MAX_FRAME_BYTES` (and the server allocates a body only as its bytes arrive).
"""

from __future__ import annotations

import enum
import math
import struct
from typing import Union

from shoal.collectives.store.api import MAX_KEY_BYTES, MAX_VALUE_BYTES
from shoal.core.channel import TAG_BYTES, Opener, Sealer

LENGTH = struct.Struct("!I")
HEAD = struct.Struct("!BI")
# One key-value pair at its largest plus framing; multi_set batches beyond it are refused early.
MAX_FRAME_BYTES = MAX_VALUE_BYTES + MAX_KEY_BYTES + 4096
MAX_ARGS = 1 << 20
# The bytes a length prefix counts: a body and its tag.
MIN_PAYLOAD = HEAD.size + TAG_BYTES
MAX_PAYLOAD = MAX_FRAME_BYTES + TAG_BYTES

Bytes = Union[bytes, bytearray, memoryview]
_JOIN_BYTES = 64 * 1024


class Op(enum.IntEnum):
    """Request codes."""

    SET = 1
    GET = 2
    ADD = 3
    COMPARE_SET = 4
    WAIT = 5
    CHECK = 6
    DELETE = 7
    NUM_KEYS = 8
    MULTI_GET = 9
    MULTI_SET = 10
    JOIN = 11
    WAIT_WORKERS = 12
    PING = 13


class Status(enum.IntEnum):
    """Reply codes."""

    OK = 0
    TIMEOUT = 1  # args: the keys still missing (or, for WAIT_WORKERS, the joined count)
    BAD_INPUT = 2  # args: a message; the client raises ValueError
    ERROR = 3  # args: a message; the client raises StoreError
    DROPPED = 4  # args: a message; the server closes the connection after this reply


class FrameError(ValueError):
    """A frame that breaks the wire format; the server drops the connection that sent it."""


def encode(code: int, args: list[bytes]) -> bytes:
    """A frame's length prefix and body, ready for `seal` (the prefix counts the tag too).

    Raises:
        FrameError: the frame would exceed MAX_FRAME_BYTES.
    """
    parts = [b""]
    size = HEAD.size
    for arg in args:
        parts.append(LENGTH.pack(len(arg)))
        parts.append(arg)
        size += LENGTH.size + len(arg)
    if size > MAX_FRAME_BYTES:
        raise FrameError(
            f"A store message of {size} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit; "
            "split it into smaller calls."
        )
    parts[0] = LENGTH.pack(size + TAG_BYTES) + HEAD.pack(code, len(args))
    return b"".join(parts)


def seal(sealer: Sealer, frame: bytes) -> list[Bytes]:
    """What to send for `frame` (from `encode`), as buffers to send in order: the frame and its
    tag, or in encrypt mode the length prefix and the encrypted body (with its tag)."""
    body = memoryview(frame)[LENGTH.size:]
    if sealer.encrypt:
        return [frame[:LENGTH.size], sealer.seal(body)]
    tag = sealer.tag([body])
    # A small frame costs less as one buffer than as a vector; a large one is not copied.
    return [frame + tag] if len(frame) <= _JOIN_BYTES else [frame, tag]


def open_payload(opener: Opener, payload: Bytes) -> Bytes:
    """The body of a received frame (the `n` bytes after its length prefix), checked (or
    decrypted) before anything reads it.

    Raises:
        IntegrityError: the frame is not the next one the peer sent on this connection.
    """
    if opener.encrypt:
        return opener.open(payload)
    view = memoryview(payload)
    body = view[:-TAG_BYTES]
    opener.check([body], view[-TAG_BYTES:])
    return body


def check_length(length: int) -> None:
    """Validate a frame's length prefix before its payload is read or allocated."""
    if length < MIN_PAYLOAD:
        raise FrameError(f"frame length {length} is shorter than the {HEAD.size}-byte header "
                         f"and the {TAG_BYTES}-byte tag")
    if length > MAX_PAYLOAD:
        raise FrameError(f"frame length {length} exceeds the {MAX_PAYLOAD}-byte limit")


def decode(body: bytes | bytearray | memoryview) -> tuple[int, list[bytes]]:
    """Split a frame body into its code and arguments.

    Raises:
        FrameError: the arguments do not exactly fill the body.
    """
    view = memoryview(body)
    if len(view) < HEAD.size:
        raise FrameError(f"frame body of {len(view)} bytes is shorter than its header")
    code, count = HEAD.unpack_from(view, 0)
    if count > MAX_ARGS:
        raise FrameError(f"frame claims {count} arguments, more than the limit of {MAX_ARGS}")
    args = []
    pos = HEAD.size
    for i in range(count):
        if pos + LENGTH.size > len(view):
            raise FrameError(f"frame ends inside the length of argument {i} of {count}")
        (n,) = LENGTH.unpack_from(view, pos)
        pos += LENGTH.size
        if n > len(view) - pos:
            raise FrameError(
                f"argument {i} claims {n} bytes but only {len(view) - pos} remain in the frame"
            )
        args.append(bytes(view[pos:pos + n]))
        pos += n
    if pos != len(view):
        raise FrameError(f"frame has {len(view) - pos} trailing bytes after its arguments")
    return code, args


def encode_number(value: int | float) -> bytes:
    """ASCII decimal of an int or a float (timeouts)."""
    return repr(value).encode()


def decode_int(raw: bytes) -> int:
    """Parse an ASCII integer argument, raising FrameError on anything else."""
    try:
        return int(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise FrameError(f"expected an integer argument, got {raw[:32]!r}") from exc


def decode_timeout(raw: bytes) -> float:
    """Parse a timeout in seconds: a non-negative float (inf allowed)."""
    try:
        value = float(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise FrameError(f"expected a timeout in seconds, got {raw[:32]!r}") from exc
    if math.isnan(value) or value < 0:
        raise FrameError(f"timeout must be zero or more seconds, got {value!r}")
    return value
