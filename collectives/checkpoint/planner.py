"""What each rank writes and reads: torch.distributed.checkpoint's planners, for flat shards.

A state dict is flattened to dotted keys (nested dicts only). A `ShardedParameter` (fully_shard's
shard, or an optimizer state array `state_dict.get_state_dict` wrapped as one) is a run of its
global tensor's flattened elements; any other Tensor or array is held whole by every rank and is
written once, by rank 0 (torch's dedup of replicated tensors); anything else is a plain value.
Loading intersects the runs the checkpoint holds with the runs this rank's state dict wants, so
a checkpoint written at one world size loads at any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from shoal.collectives.checkpoint.metadata import CheckpointException, encode_value
from shoal.collectives.fsdp.api import ShardedParameter
from shoal.core import backend, dtypes
from shoal.core.tensor import Tensor

__all__ = ["DefaultLoadPlanner", "DefaultSavePlanner", "ReadItem", "WriteItem",
           "flatten_state_dict"]


def flatten_state_dict(state_dict: dict, prefix: tuple = ()) -> dict[str, tuple[tuple, Any]]:
    """{dotted key: (path of the keys as they are, leaf)} of nested dicts."""
    flat: dict[str, tuple[tuple, Any]] = {}
    for key, value in state_dict.items():
        path = prefix + (key,)
        if isinstance(value, dict) and value and all(isinstance(k, (str, int)) for k in value):
            flat.update(flatten_state_dict(value, path))
        else:
            flat[".".join(map(str, path))] = (path, value)
    return flat


def _is_array(value: Any) -> bool:
    return isinstance(value, Tensor) or backend.is_array(value)


def _host_flat(value: Any) -> np.ndarray:
    arr = value.array if isinstance(value, Tensor) else value
    if type(arr) is not np.ndarray:
        arr = backend.to_device(arr, backend.device("cpu"))
    return arr.reshape(-1)


@dataclass
class WriteItem:
    """One run of one tensor's flattened elements that this rank writes."""

    fqn: str
    path: list
    dtype: str
    shape: list
    offset: int
    data: np.ndarray


@dataclass
class ReadItem:
    """Copy `numel` elements from a chunk of `file` into `dest` (a flat view)."""

    fqn: str
    file: str
    src_offset: int
    dest: np.ndarray
    dest_offset: int
    numel: int


class DefaultSavePlanner:
    """Plans a save: shards as runs, replicated tensors by rank 0, values in the metadata."""

    def __init__(self, dedup_replicated_tensors: bool = True) -> None:
        self.dedup_replicated_tensors = dedup_replicated_tensors

    def create_local_plan(self, state_dict: dict, rank: int) -> tuple[list, dict]:
        """(this rank's WriteItems, the values it records: rank 0's only)."""
        items, values = [], {}
        for fqn, (keys, value) in flatten_state_dict(state_dict).items():
            path = [str(k) for k in keys]
            if isinstance(value, ShardedParameter):
                data = _host_flat(value)[:value.shard_numel]
                items.append(WriteItem(fqn, list(path), dtypes.from_np(data.dtype).name,
                                       list(value.global_shape), int(value.shard_offset),
                                       np.ascontiguousarray(data)))
            elif _is_array(value):
                if rank == 0 or not self.dedup_replicated_tensors:
                    data = np.ascontiguousarray(_host_flat(value))
                    shape = list(value.shape)
                    items.append(WriteItem(fqn, list(path), dtypes.from_np(data.dtype).name,
                                           shape, 0, data))
            elif rank == 0:
                values[fqn] = {"path": list(path), "tree": encode_value(value, fqn)}
        return items, values

    def create_global_plan(self, plans: list[tuple[list, str]], values: dict,
                           world_size: int) -> dict:
        """The metadata body from every rank's (items' descriptions, file name)."""
        tensors: dict[str, dict] = {}
        for described, file in plans:
            for fqn, path, dtype, shape, offset, numel in described:
                entry = tensors.setdefault(fqn, {"path": path, "dtype": dtype, "shape": shape,
                                                 "chunks": []})
                if entry["dtype"] != dtype or entry["shape"] != shape:
                    raise CheckpointException(
                        f"Ranks disagree on {fqn!r}: {entry['dtype']} {entry['shape']} against "
                        f"{dtype} {shape}.")
                entry["chunks"].append([file, offset, numel])
        for entry in tensors.values():
            entry["chunks"].sort(key=lambda c: c[1])
        return {"version": 1, "world_size": world_size, "tensors": tensors, "values": values}


class DefaultLoadPlanner:
    """Plans a load: for each tensor of the state dict, the chunks that overlap what it holds."""

    def __init__(self, allow_partial_load: bool = False) -> None:
        self.allow_partial_load = allow_partial_load

    def create_local_plan(self, state_dict: dict, metadata: dict) -> tuple[list, dict]:
        """(ReadItems, {fqn: (path, tree)} of the values to set)."""
        reads, values = [], {}
        for fqn, (path, value) in flatten_state_dict(state_dict).items():
            if _is_array(value):
                reads.extend(self._reads(fqn, value, metadata))
            elif fqn in metadata["values"]:
                values[fqn] = (path, metadata["values"][fqn]["tree"])
            elif not self.allow_partial_load:
                raise CheckpointException(f"The checkpoint has no entry {fqn!r}.")
        return reads, values

    def _reads(self, fqn: str, value: Any, metadata: dict) -> list[ReadItem]:
        entry = metadata["tensors"].get(fqn)
        if entry is None:
            if self.allow_partial_load:
                return []
            raise CheckpointException(f"The checkpoint has no tensor {fqn!r}.")
        dest_arr = value.array if isinstance(value, Tensor) else value
        if type(dest_arr) is not np.ndarray or not dest_arr.flags.c_contiguous:
            raise CheckpointException(f"{fqn!r}: load fills host, contiguous arrays in place.")
        if isinstance(value, ShardedParameter):
            shape, start, numel = list(value.global_shape), value.shard_offset, value.shard_numel
        else:
            shape, start, numel = list(dest_arr.shape), 0, dest_arr.size
        if shape != entry["shape"]:
            raise CheckpointException(f"{fqn!r} is {entry['shape']} in the checkpoint but "
                                      f"{shape} in the state dict.")
        dest = dest_arr.reshape(-1)
        reads, stop, covered = [], start + numel, 0
        for file, offset, count in entry["chunks"]:
            lo, hi = max(start, offset), min(stop, offset + count)
            if lo < hi:
                reads.append(ReadItem(fqn, file, lo - offset, dest, lo - start, hi - lo))
                covered += hi - lo
        if covered != numel:
            raise CheckpointException(f"The checkpoint's chunks of {fqn!r} cover {covered} of "
                                      f"the {numel} elements this rank needs.")
        return reads


def describe(items: list[WriteItem]) -> list:
    """WriteItems as the plain lists rank 0 gathers."""
    return [(i.fqn, i.path, i.dtype, i.shape, i.offset, int(i.data.size)) for i in items]


def optional_planner(planner: Optional[Any], cls: type) -> Any:
    """`planner`, or the default one."""
    return planner if planner is not None else cls()
