"""`default_collate` and `default_convert`: samples to batched Tensors, as torch's do.

Arrays and Tensors are stacked on a new first axis, Python numbers become int64/float64/bool
Tensors, strings and bytes stay lists, and mappings, named tuples and sequences are collated
field by field (a tuple becomes a list, as in torch). A mismatch names the sample index, the
shapes and where in the sample it sits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shoal.core.data.errors import CollateError
from shoal.core.tensor import Tensor

_BAD_TYPE = ("default_collate: batch must contain tensors, numpy arrays, numbers, dicts or "
             "lists; found {}")


def _where(path: str) -> str:
    return f" at batch{path}" if path else ""


def _stack(arrays: list, path: str) -> np.ndarray:
    first = arrays[0]
    for i, a in enumerate(arrays):
        if a.shape != first.shape:
            raise CollateError(
                f"default_collate: sample {i} has shape {tuple(a.shape)} where sample 0 has "
                f"{tuple(first.shape)}{_where(path)}; samples of one batch must have equal "
                "shapes (pad them or pass a collate_fn)"
            )
    if any(a.dtype != first.dtype for a in arrays):
        return np.stack(arrays)  # numpy promotes, as torch.stack does
    out = np.empty((len(arrays),) + first.shape, dtype=first.dtype)
    for i, a in enumerate(arrays):
        out[i] = a
    return out


def _is_string_array(a: np.ndarray) -> bool:
    return a.dtype.kind in "SUaOV"


def _collate(batch: list, path: str) -> Any:
    elem = batch[0]
    if isinstance(elem, Tensor):
        return Tensor(_stack([_host(t.array) for t in batch], path))
    if isinstance(elem, (np.ndarray, np.generic)) and not isinstance(elem, (np.str_, np.bytes_)):
        if _is_string_array(np.asarray(elem)):
            raise CollateError(_BAD_TYPE.format(np.asarray(elem).dtype) + _where(path))
        return Tensor(_stack([np.asarray(a) for a in batch], path))
    if isinstance(elem, bool):
        return Tensor(np.asarray(batch, dtype=np.bool_))
    if isinstance(elem, int):
        return Tensor(np.asarray(batch, dtype=np.int64))
    if isinstance(elem, float):
        return Tensor(np.asarray(batch, dtype=np.float64))
    if isinstance(elem, (str, bytes)):
        return batch
    if isinstance(elem, Mapping):
        for i, d in enumerate(batch):
            if not isinstance(d, Mapping) or d.keys() != elem.keys():
                got = sorted(map(str, d.keys())) if isinstance(d, Mapping) else type(d).__name__
                raise CollateError(
                    f"default_collate: sample {i} has keys {got} where sample 0 has "
                    f"{sorted(map(str, elem.keys()))}{_where(path)}"
                )
        out = {key: _collate([d[key] for d in batch], f"{path}[{key!r}]") for key in elem}
        try:
            return type(elem)(out)
        except TypeError:
            return out
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):  # a named tuple
        fields = zip(*batch)
        return type(elem)(*(_collate(list(s), f"{path}.{name}")
                            for name, s in zip(elem._fields, fields)))
    if isinstance(elem, Sequence):
        for i, s in enumerate(batch):
            if len(s) != len(elem):
                raise CollateError(
                    f"default_collate: sample {i} has {len(s)} elements where sample 0 has "
                    f"{len(elem)}{_where(path)}; each element in list of batch should be of "
                    "equal size"
                )
        columns = [_collate(list(s), f"{path}[{k}]") for k, s in enumerate(zip(*batch))]
        if isinstance(elem, tuple):
            return columns  # torch returns a list for tuples (backwards compatibility)
        try:
            return type(elem)(columns)
        except TypeError:
            return columns
    raise CollateError(_BAD_TYPE.format(type(elem)) + _where(path))


def _host(array: Any) -> np.ndarray:
    return array if isinstance(array, np.ndarray) else np.asarray(array.get())  # cupy -> host


def default_collate(batch: list) -> Any:
    """Stack a list of samples into a batch (torch.utils.data.default_collate's rules)."""
    if not isinstance(batch, Sequence) or len(batch) == 0:
        raise CollateError(f"default_collate needs a non-empty list of samples, got {batch!r}")
    return _collate(list(batch), "")


def default_convert(data: Any) -> Any:
    """Arrays to Tensors, recursively, without batching (the batch_size=None path)."""
    if isinstance(data, Tensor):
        return data
    if isinstance(data, np.ndarray) and not _is_string_array(data):
        return Tensor(data)
    if isinstance(data, np.generic) and not isinstance(data, (np.str_, np.bytes_)):
        return Tensor(np.asarray(data))
    if isinstance(data, Mapping):
        out = {k: default_convert(v) for k, v in data.items()}
        try:
            return type(data)(out)
        except TypeError:
            return out
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(default_convert(d) for d in data))
    if isinstance(data, tuple):
        return [default_convert(d) for d in data]
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        try:
            return type(data)([default_convert(d) for d in data])
        except TypeError:
            return [default_convert(d) for d in data]
    return data
