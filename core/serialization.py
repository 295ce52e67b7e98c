"""`core.save` / `core.load`: state_dicts and nested plain values in a file with no pickle in it.

torch.load(weights_only=True) exists because unpickling a file runs whatever it names. shoal's
format cannot name code at all, so loading is always safe, like weights_only=True:

    offset 0   b"SHOALPT1"                       magic
    8          H, the header's length (u64 little-endian)
    16         header: UTF-8 JSON {"format": 1, "tree": NODE, "arrays": [ARRAY, ...]}
    16 + H     zero padding to a 64-byte boundary, then each array's raw bytes, 64-byte aligned

    ARRAY = {"dtype": name, "shape": [...], "offset": bytes from the data start, "nbytes": n}
    NODE  = ["none"] | ["bool", b] | ["int", i] | ["float", float.hex()] | ["str", s]
          | ["bytes", base64] | ["list", [NODE...]] | ["tuple", [NODE...]]
          | ["dict", [[KEY_NODE, NODE]...]] | ["odict", ...] | ["dtype", name] | ["device", s]
          | ["ndarray", i] | ["scalar", i] | ["tensor", i, requires_grad, device]
          | ["parameter", i, requires_grad, device]

Every tag is checked on load and anything else is refused, so a file is data, never code. A
tensor saved twice in one object (the same Tensor) is written once and loads as one Tensor;
distinct tensors that shared memory (views) load as independent copies. The files are not
torch's zip files: torch cannot read them and shoal cannot read torch's.
"""

from __future__ import annotations

import base64
import collections
import json
import os
import struct
from typing import Any, BinaryIO

import numpy as np

from shoal.core import backend
from shoal.core import dtypes
from shoal.core.errors import ShoalError
from shoal.core.nn.parameter import Parameter
from shoal.core.tensor import Tensor

MAGIC = b"SHOALPT1"
_ALIGN = 64
_SAVABLE = (
    "None, bool, int, float, str, bytes, list, tuple, dict (OrderedDict too), numpy arrays and "
    "scalars, core dtypes and devices, Tensors and Parameters"
)


class SerializationError(ShoalError, RuntimeError):
    """A value core.save cannot write, or a file core.load refuses (not shoal's, or damaged)."""


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _dtype_name(dt: np.dtype, where: str) -> str:
    try:
        return dtypes.from_np(dt).name
    except dtypes.DTypeError as exc:
        raise SerializationError(
            f"core.save: cannot save an array of dtype {dt} at {where}; shoal saves "
            f"{[d.name for d in dtypes.ALL]}."
        ) from exc


class _Writer:
    """Turns an object into the NODE tree and an ordered list of host arrays."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.meta: list[dict] = []
        self._seen: dict[int, int] = {}  # id(Tensor) -> array index
        self._keep: list[Any] = []  # keeps ids in _seen from being reused while we write

    def _add(self, data: Any, where: str, key: Any = None) -> int:
        if key is not None and id(key) in self._seen:
            return self._seen[id(key)]
        host = data if isinstance(data, np.ndarray) else data.get()
        if not host.flags.c_contiguous:
            host = np.ascontiguousarray(host)  # (never on 0-d arrays: it would make them 1-d)
        self.meta.append({"dtype": _dtype_name(host.dtype, where), "shape": list(host.shape)})
        self.arrays.append(host)
        index = len(self.arrays) - 1
        if key is not None:
            self._seen[id(key)] = index
            self._keep.append(key)
        return index

    def node(self, obj: Any, where: str) -> list:
        # bool before int (bool subclasses int); Parameter before Tensor.
        if obj is None:
            return ["none"]
        if isinstance(obj, bool):
            return ["bool", obj]
        if isinstance(obj, int) and not isinstance(obj, np.generic):
            return ["int", int(obj)]
        if isinstance(obj, float) and not isinstance(obj, np.generic):
            return ["float", float(obj).hex()]
        if isinstance(obj, str):
            return ["str", obj]
        if isinstance(obj, (bytes, bytearray)):
            return ["bytes", base64.b64encode(bytes(obj)).decode("ascii")]
        if isinstance(obj, Tensor):
            tag = "parameter" if isinstance(obj, Parameter) else "tensor"
            index = self._add(obj.array, where, key=obj)
            return [tag, index, bool(obj.requires_grad), str(obj.device)]
        if isinstance(obj, np.ndarray):
            return ["ndarray", self._add(obj, where)]
        if isinstance(obj, np.generic):
            return ["scalar", self._add(np.asarray(obj), where)]
        if isinstance(obj, dtypes.DType):
            return ["dtype", obj.name]
        if isinstance(obj, backend.Device):
            return ["device", str(obj)]
        if isinstance(obj, (list, tuple)):
            tag = "list" if isinstance(obj, list) else "tuple"
            return [tag, [self.node(v, f"{where}[{i}]") for i, v in enumerate(obj)]]
        if isinstance(obj, dict):
            tag = "odict" if isinstance(obj, collections.OrderedDict) else "dict"
            return [tag, [[self.node(k, f"{where} key"), self.node(v, f"{where}[{k!r}]")]
                          for k, v in obj.items()]]
        raise SerializationError(
            f"core.save: cannot save an object of type {type(obj).__module__}."
            f"{type(obj).__qualname__} at {where}; core.save writes {_SAVABLE} "
            "(save a model's state_dict(), not the model)."
        )


def save(obj: Any, f: str | os.PathLike | BinaryIO) -> None:
    """Write obj (a state_dict or nested plain values and tensors) to a path or binary file."""
    writer = _Writer()
    tree = writer.node(obj, "the saved object")
    offset = 0
    for meta, arr in zip(writer.meta, writer.arrays, strict=True):
        meta["offset"], meta["nbytes"] = offset, int(arr.nbytes)
        offset = _align(offset + arr.nbytes)
    header = json.dumps({"format": 1, "tree": tree, "arrays": writer.meta},
                        separators=(",", ":")).encode("utf-8")
    if isinstance(f, (str, os.PathLike)):
        with open(f, "wb") as fh:
            _write(fh, header, writer)
    else:
        _write(f, header, writer)


def _write(fh: BinaryIO, header: bytes, writer: _Writer) -> None:
    head = MAGIC + struct.pack("<Q", len(header)) + header
    fh.write(head + b"\0" * (_align(len(head)) - len(head)))
    written = 0
    for meta, arr in zip(writer.meta, writer.arrays, strict=True):
        fh.write(b"\0" * (meta["offset"] - written))
        fh.write(memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else b"")
        written = meta["offset"] + meta["nbytes"]


def load(
    f: str | os.PathLike | BinaryIO, map_location: Any = None, weights_only: bool = True,
    **kwargs: Any,
) -> Any:
    """Read what core.save wrote; tensors go to map_location (a device, name or {from: to} dict)."""
    if not weights_only:
        raise ValueError(
            "core.load(weights_only=False): shoal's format holds no pickled objects, so there is "
            "nothing unsafe to allow; load it with weights_only=True (the default)."
        )
    if kwargs:
        raise TypeError(f"core.load: unexpected keyword arguments {sorted(kwargs)}.")
    if isinstance(f, (str, os.PathLike)):
        with open(f, "rb") as fh:
            blob = fh.read()
        name = os.fspath(f)
    else:
        blob = f.read()
        name = getattr(f, "name", "the file object")
    return _Reader(blob, str(name), map_location).load()


class _Reader:
    """Checks a file's framing and rebuilds the tree, refusing any tag it does not know."""

    def __init__(self, blob: bytes, name: str, map_location: Any) -> None:
        self.blob, self.name, self.map_location = blob, name, map_location
        self.objects: dict[int, Any] = {}

    def _bad(self, why: str) -> SerializationError:
        return SerializationError(f"core.load: {self.name} is not a readable shoal file: {why}.")

    def load(self) -> Any:
        blob = self.blob
        if blob[:8] != MAGIC:
            hint = " (it looks like a torch.save zip file)" if blob[:2] == b"PK" else ""
            raise self._bad(f"it does not start with {MAGIC!r}{hint}")
        if len(blob) < 16:
            raise self._bad("it ends inside the header length")
        (hlen,) = struct.unpack("<Q", blob[8:16])
        if 16 + hlen > len(blob):
            raise self._bad(f"its header claims {hlen} bytes but the file has {len(blob)}")
        try:
            header = json.loads(blob[16:16 + hlen].decode("utf-8"))
            self.base = _align(16 + hlen)
            self.arrays = header["arrays"]
            if header.get("format") != 1:
                raise self._bad(f"format {header.get('format')!r} is not 1")
            return self._node(header["tree"])
        except SerializationError:
            raise
        except RecursionError as exc:
            raise self._bad("its objects nest too deeply") from exc
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise self._bad(f"its header is damaged ({type(exc).__name__}: {exc})") from exc

    def _array(self, index: Any) -> np.ndarray:
        if type(index) is not int or not 0 <= index < len(self.arrays):
            raise self._bad(f"array index {index!r} is not in its table")
        meta = self.arrays[index]
        dt = dtypes.get(meta["dtype"]).np
        shape = tuple(int(n) for n in meta["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        start, nbytes = self.base + int(meta["offset"]), int(meta["nbytes"])
        if nbytes != count * dt.itemsize or start < self.base or start + nbytes > len(self.blob):
            raise self._bad(f"array {index} ({meta['dtype']} {list(shape)}) lies outside the file")
        # A copy, so every loaded array owns writable memory (frombuffer over bytes is read-only).
        return np.frombuffer(self.blob, dtype=dt, count=count, offset=start).reshape(shape).copy()

    def _device(self, saved: str) -> backend.Device:
        loc = self.map_location
        if isinstance(loc, dict):
            loc = loc.get(saved, saved)
        if callable(loc):
            raise TypeError("core.load: map_location as a function is not supported; pass a "
                            "device, a device name or a {saved: target} dict.")
        return backend.device(loc if loc is not None else saved)

    def _tensor(self, node: list) -> Tensor:
        tag, index, requires_grad, saved_device = node
        if index in self.objects:
            return self.objects[index]
        data = self._array(index)
        dev = self._device(str(saved_device))
        if dev.type != "cpu":
            data = backend.to_device(data, dev)
        cls = Parameter if tag == "parameter" else Tensor
        out = cls(data, requires_grad=bool(requires_grad))
        self.objects[index] = out
        return out

    def _node(self, node: Any) -> Any:
        if not isinstance(node, list) or not node or not isinstance(node[0], str):
            raise self._bad(f"a node is {type(node).__name__}, not a tagged list")
        tag = node[0]
        if tag == "none":
            return None
        if tag in ("bool", "int", "str"):
            value = node[1]
            want = {"bool": bool, "int": int, "str": str}[tag]
            if type(value) is not want:
                article = "an" if tag == "int" else "a"
                raise self._bad(f"{article} {tag} node holds {type(value).__name__}")
            return value
        if tag == "float":
            return float.fromhex(node[1])
        if tag == "bytes":
            return base64.b64decode(node[1], validate=True)
        if tag in ("tensor", "parameter"):
            return self._tensor(node)
        if tag == "ndarray":
            return self._array(node[1])
        if tag == "scalar":
            return self._array(node[1])[()]
        if tag == "dtype":
            return dtypes.get(node[1])
        if tag == "device":
            return backend.Device(node[1])  # a value, not a placement: no check it exists here
        if tag in ("list", "tuple"):
            items = [self._node(v) for v in node[1]]
            return items if tag == "list" else tuple(items)
        if tag in ("dict", "odict"):
            out = collections.OrderedDict() if tag == "odict" else {}
            for key, value in node[1]:
                out[self._node(key)] = self._node(value)
            return out
        raise self._bad(f"it holds an unknown node tag {tag!r}")

