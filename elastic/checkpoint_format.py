"""The bytes of one checkpoint file (format 2): layout, the job-keyed MAC, the array table and the
exact list of globals the metadata pickle may name.

    offset 0      b"SHOALCK2"                                   magic: format 2
    8             H, the header's length (u64 little-endian)
    16            header JSON, padded with spaces to end on a 64-byte boundary
    16 + H        payload: the skeleton pickle, then each array's raw bytes, 64-byte aligned
    size - 40     HMAC-SHA256(key, every byte before it)        32 bytes
    size - 8      b"SHOALEND"

    header = {"format": 2, "step": S, "payload_bytes": N, "skeleton": {"offset", "nbytes"},
              "arrays": [{"kind", "dtype", "shape", "offset", "nbytes"[, "requires_grad"]}]}

Why format 2. Format 1 (b"SHOALCK1") closed with a plain sha256 that anyone can recompute, and
its unpickler admitted any class found under a module named `core.*` or `ml_dtypes.*`. Pickle
protocol 4+ resolves dotted names, so ("shoal.core.tensor", "np._core._internal.ctypes.CDLL") reached
ctypes.CDLL and ("shoal.core.auth", "logging.FileHandler") opened any path: whoever could write to a
shared checkpoint directory could run code in every worker that resumed. Format 2 closes both:

- The MAC is keyed by the job's secret (`derive_key`) and checked, in constant time, over the
  whole file before anything but the framing is acted on. A file written under another secret,
  or changed by one byte, is refused without being read further. The framing includes the
  header's JSON, parsed once before the MAC only to check that its sizes account for exactly
  the file's size (at most MAX_HEADER_BYTES read): the whole file is read into memory for the
  MAC, so a sparse file of many gigabytes behind a valid magic must be refused before that, and
  a real one too big for this machine's memory (MemoryError) is refused as damaged.
- Arrays never pass through pickle: numpy arrays (ml_dtypes' bfloat16 and friends included),
  numpy scalars and core Tensors/Parameters (their data and requires_grad; not grad, hooks or
  the device: a cuda tensor loads on the host) become entries of the header's array table (a
  dtype string from a fixed grammar, a shape, an offset and a length) and raw bytes. The pickle
  that remains holds only the containers and plain values around them, and may name exactly
  the globals in `ALLOWED_GLOBALS` (never a dotted name) unless the reader was told to trust it.
  Arrays whose bytes cannot stand alone (object, string, structured, datetime dtypes) are left
  to that pickle, so only a `trusted` reader loads them.

A loaded state's arrays are writable views of one 64-byte-aligned buffer holding the file, so
the file is read once and never copied again; keeping one array keeps that buffer alive.

The skeleton stays a pickle, not JSON, so that tuples, int dict keys, OrderedDicts and big ints
(numpy's PCG64 state) come back as they went in without a second encoding, and so that a
`trusted` Checkpointer can still carry user objects. Files of format 1 are refused with a
message that says so; they cannot be authenticated, so no option loads them.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import io
import json
import math
import pickle
import re
import struct
from typing import Any, BinaryIO, Optional

import ml_dtypes
import numpy as np

from shoal.core import backend
from shoal.core.nn.parameter import Parameter
from shoal.core.tensor import Tensor
from shoal.elastic.api import CheckpointError

__all__ = [
    "CheckpointCorrupt", "CheckpointUnauthenticated", "CheckpointRefused", "ALLOWED_GLOBALS",
    "derive_key", "write_checkpoint", "read_checkpoint",
]

MAGIC = b"SHOALCK2"
LEGACY_MAGIC = b"SHOALCK1"
END = b"SHOALEND"
FORMAT = 2
KEY_CONTEXT = b"shoal checkpoint key v1"
MAC_BYTES = 32
_LENGTH = struct.Struct("<Q")
PREFIX_BYTES = len(MAGIC) + _LENGTH.size
TRAILER_BYTES = MAC_BYTES + len(END)
MIN_FILE_BYTES = PREFIX_BYTES + TRAILER_BYTES
ALIGN = 64
_MAX_NDIM = 32  # numpy's own limit is 64; no training state comes near either
# A header holds one short JSON entry per array: a million arrays stay far below this. Anything
# longer is refused before it is read, since the header is parsed before the MAC is checked.
MAX_HEADER_BYTES = 256 << 20

# Every global a real training state's skeleton needs: Module.state_dict() returns an
# OrderedDict. Everything else a state holds (dicts, lists, tuples, sets, str, bytes, ints,
# floats, bools, None) pickles to opcodes, not globals, and arrays go to the array table.
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
}


class CheckpointCorrupt(CheckpointError):
    """One checkpoint file is truncated, damaged, refused or not a shoal checkpoint."""


class CheckpointUnauthenticated(CheckpointCorrupt):
    """A checkpoint's MAC does not match this job's key: damaged, tampered with, or foreign."""


class CheckpointRefused(CheckpointCorrupt):
    """A checkpoint verifies but names a global outside the allow-list."""


def derive_key(token: bytes) -> bytes:
    """The checkpoint MAC key of a job secret (domain-separated from the socket handshakes)."""
    return hmac.new(token, KEY_CONTEXT, hashlib.sha256).digest()


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# ----------------------------------------------------------------------------- dtypes

_PLAIN_DTYPE = re.compile(r"[<>|][biufc][0-9]{1,2}")
_ML_DTYPES = {name: np.dtype(getattr(ml_dtypes, name)) for name in (
    "bfloat16", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn",
    "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn",
    "float6_e2m3fn", "float6_e3m2fn", "int2", "int4", "uint2", "uint4",
) if hasattr(ml_dtypes, name)}


def _dtype_code(dtype: np.dtype) -> Optional[str]:
    """The header's name for `dtype`, or None for dtypes raw bytes cannot carry (objects...)."""
    # (`None == dtype` would compare None as float64, hence the membership test first.)
    if dtype.name in _ML_DTYPES and _ML_DTYPES[dtype.name] == dtype:
        return dtype.name
    if _PLAIN_DTYPE.fullmatch(dtype.str) and np.dtype(dtype.str) == dtype:
        return dtype.str
    return None


def _dtype_of(code: Any, path: str) -> np.dtype:
    if isinstance(code, str) and code in _ML_DTYPES:
        return _ML_DTYPES[code]
    if isinstance(code, str) and _PLAIN_DTYPE.fullmatch(code):
        try:
            return np.dtype(code)
        except TypeError:
            pass
    raise CheckpointCorrupt(f"Checkpoint {path!r} names an unknown array dtype {code!r}.")


# ----------------------------------------------------------------------------- writing

class _SkeletonPickler(pickle.Pickler):
    """Pickles a state's containers; arrays, numpy scalars and core Tensors go to `arrays`."""

    def __init__(self, file: BinaryIO):
        super().__init__(file, protocol=5)
        self.entries: list[dict] = []
        self.arrays: list[np.ndarray] = []
        self._index: dict[int, int] = {}
        # Hold every object given an index: one made by a __reduce__ during the dump could
        # otherwise be freed and its id() reused by another, which would then alias it.
        self._held: list[Any] = []

    def persistent_id(self, obj: Any) -> Optional[int]:
        if id(obj) in self._index:
            return self._index[id(obj)]  # saved once, loaded as one object (as pickle's memo)
        entry, array = _table_entry(obj)
        if entry is None:
            return None
        self._index[id(obj)] = len(self.entries)
        self._held.append(obj)
        self.entries.append(entry)
        self.arrays.append(array)
        return self._index[id(obj)]


def _table_entry(obj: Any) -> tuple[Optional[dict], Optional[np.ndarray]]:
    """The header entry and the array of an object the table carries, else (None, None)."""
    kind = type(obj)
    if kind is Tensor or kind is Parameter:
        array = obj.numpy(force=True)  # a cuda tensor is saved from, and loaded to, the host
        extra = {"kind": "parameter" if kind is Parameter else "tensor",
                 "requires_grad": bool(obj.requires_grad)}
    elif kind is np.ndarray:
        array, extra = obj, {"kind": "array"}
    elif isinstance(obj, np.generic):
        array, extra = np.asarray(obj), {"kind": "scalar"}
    elif backend.is_array(obj):
        array, extra = obj.get(), {"kind": "array"}  # cupy: loaded back as numpy
    else:
        return None, None
    code = _dtype_code(array.dtype)
    if code is None:
        return None, None  # left to pickle, so only a trusted reader loads it
    return {**extra, "dtype": code, "shape": list(array.shape), "nbytes": array.nbytes}, array


def _raw(array: np.ndarray) -> memoryview:
    # A uint8 view: memoryview cannot describe ml_dtypes' element types itself.
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


class _MacWriter:
    """Writes through to `f`, feeding the MAC and counting bytes."""

    def __init__(self, f: BinaryIO, mac: "hmac.HMAC"):
        self.f, self.mac, self.count = f, mac, 0

    def write(self, data) -> None:
        view = memoryview(data)
        self.mac.update(view)
        self.f.write(view)
        self.count += view.nbytes

    def pad_to(self, offset: int) -> None:
        self.write(bytes(offset - self.count))


def write_checkpoint(f: BinaryIO, step: int, state: dict, key: bytes) -> None:
    """Write `state` as the checkpoint of `step` into the open binary file `f`.

    Raises:
        pickle.PicklingError, TypeError, AttributeError: the state cannot be pickled.
    """
    skeleton = io.BytesIO()
    pickler = _SkeletonPickler(skeleton)
    pickler.dump(state)
    skeleton_bytes = skeleton.getbuffer()
    cursor = len(skeleton_bytes)
    for entry in pickler.entries:
        entry["offset"] = cursor = _align(cursor)
        cursor += entry["nbytes"]
    header = json.dumps({
        "format": FORMAT, "step": step, "payload_bytes": cursor,
        "skeleton": {"offset": 0, "nbytes": len(skeleton_bytes)}, "arrays": pickler.entries,
    }).encode()
    payload_start = _align(PREFIX_BYTES + len(header))
    writer = _MacWriter(f, hmac.new(key, digestmod=hashlib.sha256))
    writer.write(MAGIC)
    writer.write(_LENGTH.pack(payload_start - PREFIX_BYTES))
    writer.write(header + b" " * (payload_start - PREFIX_BYTES - len(header)))
    writer.write(skeleton_bytes)
    for entry, array in zip(pickler.entries, pickler.arrays):
        writer.pad_to(payload_start + entry["offset"])
        writer.write(_raw(array))
    f.write(writer.mac.digest())
    f.write(END)


# ----------------------------------------------------------------------------- reading

def _read_framing(f: BinaryIO, path: str, size: int) -> None:
    """Check what has a fixed size and place: the length, the magic, the end marker."""
    magic = f.read(len(MAGIC))
    if magic == LEGACY_MAGIC:
        raise CheckpointCorrupt(
            f"Checkpoint {path!r} is in shoal's old format 1 (SHOALCK1), which this version "
            "refuses: format 1 was not authenticated and its unpickler let a crafted file run "
            "code. Delete it, or resume it with the shoal that wrote it and save again there.")
    if size < MIN_FILE_BYTES:
        raise CheckpointCorrupt(f"Checkpoint {path!r} is truncated ({size} bytes).")
    if magic != MAGIC:
        raise CheckpointCorrupt(f"Checkpoint {path!r} does not start with shoal's magic.")
    f.seek(size - len(END))
    if f.read(len(END)) != END:
        raise CheckpointCorrupt(
            f"Checkpoint {path!r} has no end marker: it is truncated or was cut off mid-save.")


def _header_json(raw: bytes, path: str) -> dict:
    """The header's JSON object, of format 2."""
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise CheckpointCorrupt(f"Checkpoint {path!r} has an unreadable header: {exc}") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CheckpointCorrupt(f"Checkpoint {path!r} has a header of an unknown format.")
    return header


def _check_claimed_size(f: BinaryIO, path: str, size: int) -> None:
    """Refuse a file whose header does not account for exactly its size, before anything the
    size of the file is allocated: a sparse file of many gigabytes with a valid magic costs a
    small read, not an allocation. Only JSON is parsed from these unverified bytes; nothing in
    them is acted on until the MAC matches (`_parse_header` parses the verified copy)."""
    f.seek(len(MAGIC))
    (length,) = _LENGTH.unpack(f.read(_LENGTH.size))
    _int(length, "header length", path, high=min(MAX_HEADER_BYTES, size - MIN_FILE_BYTES))
    raw = f.read(length)
    header = _header_json(raw, path)
    payload = size - PREFIX_BYTES - length - TRAILER_BYTES
    _int(header.get("payload_bytes"), "payload length", path, low=payload, high=payload)


def _aligned_empty(nbytes: int) -> np.ndarray:
    """A uint8 buffer starting on an ALIGN boundary, so the file's aligned arrays stay aligned."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes]


def _read_verified(f: BinaryIO, path: str, size: int, key: bytes) -> np.ndarray:
    """Every byte before the MAC, read once into memory and only returned if the MAC matches.

    One read into memory, not a verifying pass and a parsing pass: the file could change
    between two reads.
    """
    body = _aligned_empty(size - TRAILER_BYTES)  # writable: the loaded arrays are views of it
    f.seek(0)
    view, done = memoryview(body), 0
    while done < body.nbytes:
        n = f.readinto(view[done:])
        if not n:
            raise CheckpointCorrupt(f"Checkpoint {path!r} shrank while it was being read.")
        done += n
    mac = f.read(MAC_BYTES)
    expected = hmac.new(key, view, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, expected):
        raise CheckpointUnauthenticated(
            f"Checkpoint {path!r} fails its sha256 check (an HMAC keyed by this job's secret): "
            "it was damaged or tampered with, or it was not written by this job (its MAC does "
            "not match this job's secret). Resuming across separate launches needs the same "
            "SHOAL_AUTH_TOKEN or --auth-token-file as the run that wrote it.")
    return body


def _int(value: Any, what: str, path: str, low: int = 0, high: Optional[int] = None) -> int:
    if type(value) is not int or value < low or (high is not None and value > high):
        raise CheckpointCorrupt(f"Checkpoint {path!r} has a bad {what}: {value!r}.")
    return value


def _parse_header(body: np.ndarray, path: str, step: int) -> tuple[dict, int]:
    """The header and the payload's offset in `body`, every field checked."""
    (length,) = _LENGTH.unpack(body[len(MAGIC):PREFIX_BYTES].tobytes())
    _int(length, "header length", path, high=body.nbytes - PREFIX_BYTES)
    header = _header_json(body[PREFIX_BYTES:PREFIX_BYTES + length].tobytes(), path)
    payload_start = PREFIX_BYTES + length
    payload = body.nbytes - payload_start
    _int(header.get("payload_bytes"), "payload length", path, low=payload, high=payload)
    saved_step = _int(header.get("step"), "step", path)
    if saved_step != step:
        raise CheckpointCorrupt(f"Checkpoint {path!r} says it is step {saved_step}, not {step}.")
    if not isinstance(header.get("skeleton"), dict) or not isinstance(header.get("arrays"), list):
        raise CheckpointCorrupt(f"Checkpoint {path!r} has no skeleton or array table.")
    return header, payload_start


def _region(entry: dict, body: np.ndarray, payload_start: int, path: str) -> np.ndarray:
    """The bytes `entry` describes, checked to lie inside the payload."""
    payload = body.nbytes - payload_start
    offset = _int(entry.get("offset"), "region offset", path, high=payload)
    nbytes = _int(entry.get("nbytes"), "region length", path, high=payload - offset)
    return body[payload_start + offset:payload_start + offset + nbytes]


def _rebuild(entry: Any, body: np.ndarray, payload_start: int, path: str) -> Any:
    """The array, scalar, Tensor or Parameter an array-table entry describes."""
    if not isinstance(entry, dict):
        raise CheckpointCorrupt(f"Checkpoint {path!r} has a bad array-table entry {entry!r}.")
    dtype = _dtype_of(entry.get("dtype"), path)
    shape = entry.get("shape")
    if not isinstance(shape, list) or len(shape) > _MAX_NDIM:
        raise CheckpointCorrupt(f"Checkpoint {path!r} has a bad array shape {shape!r}.")
    shape = [_int(n, "array dimension", path) for n in shape]
    raw = _region(entry, body, payload_start, path)
    if math.prod(shape) * dtype.itemsize != raw.nbytes:
        raise CheckpointCorrupt(
            f"Checkpoint {path!r} has an array of shape {shape} and dtype {dtype} in "
            f"{raw.nbytes} bytes.")
    array = raw.view(dtype).reshape(shape)
    kind = entry.get("kind")
    if kind == "array":
        return array
    if kind == "scalar" and not shape:
        return array[()]
    requires_grad = entry.get("requires_grad")
    if kind in ("tensor", "parameter") and isinstance(requires_grad, bool):
        return (Tensor if kind == "tensor" else Parameter)(array, requires_grad=requires_grad)
    raise CheckpointCorrupt(f"Checkpoint {path!r} has a bad array-table entry {entry!r}.")


class _SkeletonUnpickler(pickle.Unpickler):
    """Unpickles the skeleton: table objects by index, and only the globals allowed."""

    def __init__(self, data: np.ndarray, path: str, objects: list, trusted: bool,
                 extra: frozenset):
        super().__init__(io.BytesIO(data.tobytes()))
        self._path, self._objects, self._trusted, self._extra = path, objects, trusted, extra

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is not int or not 0 <= pid < len(self._objects):
            raise CheckpointCorrupt(f"Checkpoint {self._path!r} refers to array {pid!r}, "
                                    f"but its table holds {len(self._objects)}.")
        return self._objects[pid]

    def find_class(self, module: str, name: str) -> Any:
        if self._trusted:
            return super().find_class(module, name)
        if "." in name:
            # Protocol 4+ would walk the dots from an allowed module to anything it imported.
            raise CheckpointRefused(
                f"Checkpoint {self._path!r} holds the dotted global {module}.{name}, which is "
                "refused: a checkpoint may name only the exact globals on its allow-list.")
        if (module, name) in ALLOWED_GLOBALS:
            return ALLOWED_GLOBALS[module, name]
        if f"{module}.{name}" in self._extra:
            return super().find_class(module, name)
        raise CheckpointRefused(
            f"Checkpoint {self._path!r} holds {module}.{name}, which is not on the list of "
            "globals a checkpoint may contain (containers, OrderedDict; arrays, numpy scalars "
            "and core Tensors are stored as raw data). Save state dicts of arrays, or pass "
            "Checkpointer(..., allow=[...]) or trusted=True for files you trust.")


def read_checkpoint(f: BinaryIO, path: str, step: int, key: bytes, *, trusted: bool = False,
                    allow: frozenset = frozenset()) -> dict:
    """Verify and decode the checkpoint of `step` in the open binary file `f`.

    Raises:
        CheckpointUnauthenticated: the MAC does not match `key`.
        CheckpointRefused: the skeleton names a global outside the allow-list (and `allow`).
        CheckpointCorrupt: anything else about the file is wrong.
    """
    size = f.seek(0, io.SEEK_END)
    f.seek(0)
    _read_framing(f, path, size)
    _check_claimed_size(f, path, size)
    try:
        body = _read_verified(f, path, size, key)
    except MemoryError as exc:
        raise CheckpointCorrupt(
            f"Checkpoint {path!r} needs {size - TRAILER_BYTES} bytes of memory to be verified, "
            "which cannot be allocated here: treated as damaged and skipped (if it is real, it "
            "was written on a machine with more memory; load it there).") from exc
    # Everything below reads bytes this job's key vouched for; it is still checked field by
    # field, so that a bug or a leaked key yields an error, never code execution.
    header, payload_start = _parse_header(body, path, step)
    skeleton = _region(header["skeleton"], body, payload_start, path)
    try:
        objects = [_rebuild(e, body, payload_start, path) for e in header["arrays"]]
        state = _SkeletonUnpickler(skeleton, path, objects, trusted, allow).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointCorrupt(f"Checkpoint {path!r} does not unpickle: {exc!r}") from exc
    if not isinstance(state, dict):
        raise CheckpointCorrupt(f"Checkpoint {path!r} holds a {type(state).__name__}, not a dict.")
    return state
