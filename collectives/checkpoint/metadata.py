"""A distributed checkpoint's files: the job-keyed metadata and each rank's data file.

    <checkpoint_id>/
        .metadata          JSON {"body": BODY, "mac": hex}, written by rank 0 last
        __<rank>_0.distcp  safetensors: this rank's chunks, one tensor per entry, signed

    BODY = {"version": 1, "world_size": W,
            "tensors": {fqn: {"path": [key, ...], "dtype": name, "shape": [...],
                              "chunks": [[file, offset, numel], ...]}},
            "values": {fqn: {"path": [key, ...], "tree": NODE-JSON}}}

A chunk is a run of the tensor's flattened elements: rank r of a fully_shard job holds elements
[r*c, r*c + n) of each parameter, and a tensor every rank holds whole is written once, by rank 0,
as one chunk. Loading at another world size only intersects ranges. Both kinds of file carry an
HMAC-SHA256 under a key derived from the job's secret (SHOAL_AUTH_TOKEN), checked before
anything in them is used; values are core.serialization's JSON trees, never pickles, so a
checkpoint directory that others can write to can stop a job but never run code in it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from typing import Any, Optional

from shoal.core import dtypes, serialization
from shoal.core.auth import load_token
from shoal.core.errors import ShoalError

__all__ = ["CheckpointException", "METADATA_NAME", "data_file_name", "derive_key",
           "file_budgets", "read_data_file", "read_metadata", "write_atomically",
           "write_data_file", "write_metadata"]

METADATA_NAME = ".metadata"
VERSION = 1
_KEY_CONTEXT = b"shoal distributed checkpoint key v1"
MAX_METADATA_BYTES = 256 << 20


class CheckpointException(ShoalError, RuntimeError):
    """A distributed checkpoint cannot be written, read, trusted or fitted to the state dict."""


def derive_key(token: Optional[bytes | str] = None) -> bytes:
    """The MAC key of distributed checkpoints under the job's secret."""
    return hmac.new(load_token(token), _KEY_CONTEXT, hashlib.sha256).digest()


def data_file_name(rank: int) -> str:
    """Rank `rank`'s data file (torch's naming)."""
    return f"__{rank}_0.distcp"


def write_atomically(path: str, blob: bytes) -> None:
    """Write `blob` to `path` through a temporary file, fsynced and renamed."""
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _mac(key: bytes, body: dict) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def write_metadata(directory: str, body: dict, key: bytes) -> None:
    """The signed metadata file; written after every rank's data file is in place."""
    blob = json.dumps({"body": body, "mac": _mac(key, body)}, separators=(",", ":"))
    write_atomically(os.path.join(directory, METADATA_NAME), blob.encode("utf-8"))
    _fsync_dir(directory)


def read_metadata(directory: str, key: bytes) -> dict:
    """The verified metadata body of the checkpoint in `directory`."""
    path = os.path.join(directory, METADATA_NAME)
    try:
        if os.path.getsize(path) > MAX_METADATA_BYTES:
            raise CheckpointException(f"{path} is over {MAX_METADATA_BYTES} bytes; refused.")
        with open(path, "rb") as f:
            doc = json.loads(f.read().decode("utf-8"))
        body, mac = doc["body"], doc["mac"]
    except FileNotFoundError as exc:
        raise CheckpointException(
            f"There is no distributed checkpoint in {directory!r} (no {METADATA_NAME}: the save "
            "never finished, or this is not a checkpoint directory).") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointException(f"{path} is damaged ({type(exc).__name__}: {exc}).") from exc
    if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(key, body)):
        raise CheckpointException(
            f"{path} does not verify under this job's secret: it was written by another job "
            "(another SHOAL_AUTH_TOKEN) or changed since.")
    if body.get("version") != VERSION:
        raise CheckpointException(f"{path} has version {body.get('version')!r}, not {VERSION}.")
    return body


def write_data_file(directory: str, rank: int, arrays: dict, key: bytes) -> str:
    """This rank's chunks as one signed safetensors file; returns its name."""
    name = data_file_name(rank)
    metadata = {"format": "pt", "shoal_rank": str(rank)}
    metadata[serialization.MAC_KEY] = serialization.content_mac(arrays, metadata, key)
    write_atomically(os.path.join(directory, name),
                     serialization.safetensors_bytes(arrays, metadata))
    return name


def read_data_file(directory: str, name: str, key: bytes, max_bytes: int) -> dict:
    """A verified data file's arrays by entry name; a file over `max_bytes` (what the verified
    metadata says it holds, plus room for its header) is refused before it is read."""
    if os.path.basename(name) != name or not name.endswith(".distcp"):
        raise CheckpointException(f"The metadata names a data file {name!r} outside the "
                                  "checkpoint directory; refused.")
    path = os.path.join(directory, name)
    try:
        if os.path.getsize(path) > max_bytes:
            raise CheckpointException(
                f"{path} holds {os.path.getsize(path)} bytes, more than the {max_bytes} its "
                "metadata accounts for; refused.")
        with open(path, "rb") as f:
            blob = f.read()
        arrays, metadata = serialization.read_safetensors(blob, path)
    except OSError as exc:
        raise CheckpointException(f"Cannot read {path}: {exc}") from exc
    except serialization.SerializationError as exc:
        raise CheckpointException(str(exc)) from exc
    claimed = metadata.get(serialization.MAC_KEY, "")
    if not hmac.compare_digest(claimed, serialization.content_mac(arrays, metadata, key)):
        raise CheckpointException(
            f"{path} does not verify under this job's secret: written by another job or "
            "changed since.")
    return arrays


def file_budgets(body: dict) -> dict[str, int]:
    """The most bytes each data file may hold: its chunks' bytes plus its header (a JSON entry
    of well under 1 KiB per chunk, and the metadata strings)."""
    budgets: dict[str, int] = {}
    for fqn, entry in body["tensors"].items():
        itemsize = dtypes.get(entry["dtype"]).np.itemsize
        for file, _offset, numel in entry["chunks"]:
            budgets[file] = budgets.get(file, 4096) + int(numel) * itemsize + 1024 + len(fqn)
    return budgets


def encode_value(value: Any, fqn: str) -> str:
    """A plain value (numbers, strings, tuples, lists, dicts without arrays) as a JSON tree."""
    arrays, metadata = serialization.to_safetensors(value)
    if arrays:
        raise CheckpointException(
            f"State dict entry {fqn!r} holds tensors inside a {type(value).__name__}; put "
            "tensors in dicts (each one its own entry) so that they can be sharded.")
    return metadata[serialization.TREE_KEY]


def decode_value(tree: str, fqn: str) -> Any:
    """The value `encode_value` wrote."""
    try:
        return serialization.from_safetensors(
            {}, {serialization.TREE_KEY: tree, serialization.NAMES_KEY: "[]"}, name=fqn)
    except serialization.SerializationError as exc:
        raise CheckpointException(f"Entry {fqn!r} of the checkpoint is damaged: {exc}") from exc


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
