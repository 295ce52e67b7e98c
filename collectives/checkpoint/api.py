"""`save` and `load` of torch.distributed.checkpoint: every rank writes its own shards, rank 0
writes the metadata last, and a load reads whatever chunks overlap what this rank holds.

No tensor is gathered to rank 0: each rank's data travels from its memory to its file only. The
only collectives are small: the write plans' descriptions go to rank 0 (gather_object), and a
broadcast tells every rank that the metadata is in place (or why it is not), so `save` returns
on every rank only when the checkpoint is complete.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
from typing import Any, Optional

import numpy as np

from shoal.collectives.checkpoint import metadata as md
from shoal.collectives.checkpoint.metadata import CheckpointException
from shoal.collectives.checkpoint.planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    describe,
    optional_planner,
)
from shoal.collectives.world import is_initialized, member_group
from shoal.core import dtypes, serialization
from shoal.core.auth import load_token
from shoal.core.tensor import Tensor

__all__ = ["export_safetensors", "load", "save"]

logger = logging.getLogger(__name__)


def _group(process_group: Any, no_dist: bool) -> Any:
    if no_dist:
        return None
    if process_group is None and not is_initialized():
        return None  # no group at all: one process saves alone, as torch's no_dist
    return member_group(process_group)


def save(state_dict: dict, *, checkpoint_id: str | os.PathLike, storage_writer: Any = None,
         planner: Optional[DefaultSavePlanner] = None, process_group: Any = None,
         no_dist: bool = False, token: Optional[bytes | str] = None) -> dict:
    """Write `state_dict` (a collective: every rank calls it) into the directory checkpoint_id.

    Returns the checkpoint's metadata body. storage_writer is accepted for torch's scripts and
    must be None (the directory is the storage).
    """
    if storage_writer is not None:
        raise CheckpointException("save: shoal writes to the directory checkpoint_id; "
                                  "storage_writer must be None.")
    directory = os.fspath(checkpoint_id)
    pg = _group(process_group, no_dist)
    rank, world = (pg.rank(), pg.size()) if pg is not None else (0, 1)
    key = md.derive_key(token)
    planner = optional_planner(planner, DefaultSavePlanner)
    error: Optional[str] = None
    described: Any = None
    try:
        os.makedirs(directory, exist_ok=True)
        items, values = planner.create_local_plan(state_dict, rank)
        arrays = {item.fqn: item.data for item in items}
        name = md.write_data_file(directory, rank, arrays, key)
        described = (describe(items), name)
    except (OSError, CheckpointException, serialization.SerializationError) as exc:
        error = f"rank {rank}: {exc}"
        values = {}
    plans = _gather((described, error), pg, world)
    body, outcome = None, None
    if rank == 0:
        errors = [e for _, e in plans if e]
        if errors:
            outcome = "The checkpoint was not written: " + "; ".join(errors)
        else:
            try:
                body = planner.create_global_plan([p for p, _ in plans], values, world)
                md.write_metadata(directory, body, key)
            except (OSError, CheckpointException) as exc:
                outcome = f"rank 0 could not write the metadata: {exc}"
    outcome, body = _broadcast((outcome, body), pg)
    if outcome:
        raise CheckpointException(f"Saving the checkpoint {directory!r} failed. {outcome}")
    logger.info("Saved distributed checkpoint %s (rank %d of %d)", directory, rank, world)
    return body


def load(state_dict: dict, *, checkpoint_id: str | os.PathLike, storage_reader: Any = None,
         planner: Optional[DefaultLoadPlanner] = None, process_group: Any = None,
         no_dist: bool = False, token: Optional[bytes | str] = None) -> None:
    """Fill `state_dict` in place from the checkpoint: its tensors' (or shards') elements are
    copied into their arrays, its plain values replaced. Any world size may load any checkpoint.

    Raises:
        CheckpointException: missing, foreign (another job's secret), damaged, or not fitting
            the state dict (a missing key, another global shape).
    """
    if storage_reader is not None:
        raise CheckpointException("load: shoal reads the directory checkpoint_id; "
                                  "storage_reader must be None.")
    directory = os.fspath(checkpoint_id)
    key = md.derive_key(token)
    body = md.read_metadata(directory, key)
    planner = optional_planner(planner, DefaultLoadPlanner)
    reads, values = planner.create_local_plan(state_dict, body)
    by_file: dict[str, list] = collections.defaultdict(list)
    for item in reads:
        by_file[item.file].append(item)
    budgets = md.file_budgets(body)
    for file, items in sorted(by_file.items()):
        arrays = md.read_data_file(directory, file, key, budgets[file])  # verified before use
        for item in items:
            src = arrays.get(item.fqn)
            if src is None or src.size < item.src_offset + item.numel:
                raise CheckpointException(f"{file} lacks the elements of {item.fqn!r} its "
                                          "metadata promises.")
            src = src.reshape(-1)[item.src_offset:item.src_offset + item.numel]
            item.dest[item.dest_offset:item.dest_offset + item.numel] = src
    for fqn, (path, tree) in values.items():
        target = state_dict
        for k in path[:-1]:
            target = target[k]
        target[path[-1]] = md.decode_value(tree, fqn)


def _gather(obj: Any, pg: Any, world: int) -> list:
    if pg is None:
        return [obj]
    out = [None] * world if pg.rank() == 0 else None
    pg.gather_object(obj, out, 0)
    return out


def _broadcast(obj: Any, pg: Any) -> Any:
    if pg is None:
        return obj
    box = [obj]
    pg.broadcast_object_list(box, 0)
    return box[0]


def export_safetensors(checkpoint_id: str | os.PathLike, path: str | os.PathLike, *,
                       token: Optional[bytes | str] = None) -> str:
    """Consolidate a distributed checkpoint (any world size) into one safetensors file.

    Tensors appear whole under their dotted keys (`safetensors.torch.load_file` reads them);
    the plain values and nesting ride in the metadata for core.load, and the file is signed
    under the job's secret (elastic.checkpoint_safetensors.load_safetensors verifies it).
    Runs in one process; it holds the whole state in memory once.
    """
    directory = os.fspath(checkpoint_id)
    key = md.derive_key(token)
    body = md.read_metadata(directory, key)
    files: dict[str, dict] = {}
    budgets = md.file_budgets(body)
    state: dict = {}
    for fqn, entry in body["tensors"].items():
        numel = int(np.prod(entry["shape"], dtype=np.int64))
        whole = np.empty(numel, dtype=dtypes.get(entry["dtype"]).np)
        filled = 0
        for file, offset, count in entry["chunks"]:
            if file not in files:
                files[file] = md.read_data_file(directory, file, key, budgets[file])
            whole[offset:offset + count] = files[file][fqn].reshape(-1)[:count]
            filled += count
        if filled != numel:
            raise CheckpointException(f"The chunks of {fqn!r} hold {filled} of {numel} "
                                      "elements.")
        _place(state, entry["path"], Tensor(whole.reshape(entry["shape"])))
    for fqn, entry in body["values"].items():
        _place(state, entry["path"], md.decode_value(entry["tree"], fqn))
    blob = serialization.signed_safetensors(state, _elastic_key(token))
    md.write_atomically(os.fspath(path), blob)
    return os.fspath(path)


def _elastic_key(token: Optional[bytes | str]) -> bytes:
    # The same key elastic's checkpoint files use (elastic.checkpoint_format.derive_key), so
    # that elastic.checkpoint_safetensors.load_safetensors verifies the export; collectives
    # sits below elastic and cannot import it, so the derivation is repeated here.
    return hmac.new(load_token(token), b"shoal checkpoint key v1", hashlib.sha256).digest()


def _place(state: dict, path: list, value: Any) -> None:
    target = state
    for k in path[:-1]:
        target = target.setdefault(k, {})
    target[path[-1]] = value
