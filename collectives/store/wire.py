"""The TCPStore wire format: length-prefixed binary frames with bounded sizes.

A frame is `u32 body_length` then the body: `u8 code`, `u32 argument_count`, and each argument
as `u32 length` + bytes. Requests carry an `Op` as code, replies a `Status`. Numbers (amounts,
timeouts, counts) travel as ASCII decimals so that one parser covers every message. Lengths are
checked against the frame before anything is sliced, so a hostile length cannot make a reader
allocate more than `MAX_FRAME_BYTES`.
"""

from __future__ import annotations

import enum
import math
import struct

from shoal.collectives.store.api import MAX_KEY_BYTES, MAX_VALUE_BYTES

LENGTH = struct.Struct("!I")
HEAD = struct.Struct("!BI")
# One key-value pair at its largest plus framing; multi_set batches beyond it are refused early.
MAX_FRAME_BYTES = MAX_VALUE_BYTES + MAX_KEY_BYTES + 4096
MAX_ARGS = 1 << 20


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


class FrameError(ValueError):
    """A frame that breaks the wire format; the server drops the connection that sent it."""


def encode(code: int, args: list[bytes]) -> bytes:
    """One whole frame (length prefix included).

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
    parts[0] = LENGTH.pack(size) + HEAD.pack(code, len(args))
    return b"".join(parts)


def check_length(length: int) -> None:
    """Validate a frame's length prefix before its body is read or allocated."""
    if length < HEAD.size:
        raise FrameError(f"frame length {length} is shorter than the {HEAD.size}-byte header")
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"frame length {length} exceeds the {MAX_FRAME_BYTES}-byte limit")


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
