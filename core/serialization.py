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
torch's zip files: torch cannot read them and shoal cannot read torch's. For files other tools
read, core.save writes safetensors (a path ending in .safetensors, or format="safetensors"; see
the section at the end), and core.load reads any safetensors file, torch's included.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import hmac
import json
import os
import struct
from typing import Any, BinaryIO, Optional

import numpy as np

from shoal.core import backend
from shoal.core import dtypes
from shoal.core.errors import ShoalError
from shoal.core.nn.parameter import Parameter
from shoal.core.tensor import Tensor

MAGIC = b"SHOALPT1"
FORMATS = ("shoal", "safetensors")
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
        self.names: list[str] = []  # each array's dotted key path (safetensors' tensor names)
        self._path: list[str] = []
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
        self.names.append(".".join(self._path) or "tensor")
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
            return [tag, [self._child(str(i), v, f"{where}[{i}]") for i, v in enumerate(obj)]]
        if isinstance(obj, dict):
            tag = "odict" if isinstance(obj, collections.OrderedDict) else "dict"
            return [tag, [[self.node(k, f"{where} key"), self._child(str(k), v, f"{where}[{k!r}]")]
                          for k, v in obj.items()]]
        raise SerializationError(
            f"core.save: cannot save an object of type {type(obj).__module__}."
            f"{type(obj).__qualname__} at {where}; core.save writes {_SAVABLE} "
            "(save a model's state_dict(), not the model)."
        )


    def _child(self, key: str, value: Any, where: str) -> list:
        self._path.append(key)
        try:
            return self.node(value, where)
        finally:
            self._path.pop()


def _format_of(f: Any, format: Optional[str], blob: bytes = b"") -> str:  # noqa: A002
    if format is not None:
        if format not in FORMATS:
            raise ValueError(f"core.save/load: format must be one of {FORMATS}, got {format!r}.")
        return format
    if isinstance(f, (str, os.PathLike)) and os.fspath(f).endswith(".safetensors"):
        return "safetensors"
    # A safetensors file opens with its header's length and then the header's JSON object.
    if blob and blob[:8] != MAGIC and blob[8:9] == b"{":
        return "safetensors"
    return "shoal"


def save(obj: Any, f: str | os.PathLike | BinaryIO, format: Optional[str] = None) -> None:  # noqa: A002
    """Write obj (a state_dict or nested plain values and tensors) to a path or binary file.

    format: "shoal" (the default) or "safetensors" (the default for a path ending in
    .safetensors), which torch, JAX and numpy read through the safetensors package.
    """
    if _format_of(f, format) == "safetensors":
        arrays, metadata = to_safetensors(obj)
        blob = safetensors_bytes(arrays, metadata)
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as fh:
                fh.write(blob)
        else:
            f.write(blob)
        return
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
    format: Optional[str] = None, **kwargs: Any,  # noqa: A002
) -> Any:
    """Read what core.save wrote, or any safetensors file; tensors go to map_location (a
    device, name or {from: to} dict). A safetensors file that core.save did not write loads
    as a flat {name: Tensor} dict, as safetensors.torch.load_file returns it."""
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
    if _format_of(f, format, blob) == "safetensors":
        arrays, metadata = read_safetensors(blob, str(name))
        return from_safetensors(arrays, metadata, map_location, str(name))
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



# ----------------------------------------------------------------------------- safetensors
# A safetensors file is an 8-byte header length, a JSON header naming each tensor's dtype,
# shape and byte range, and the raw bytes: nothing in it can name code. core.save keeps what
# safetensors has no place for (nesting, plain values, Parameters, requires_grad) as JSON in the
# header's string metadata: "shoal_tree" is the NODE tree above and "shoal_arrays" the tensor
# name of each array index. Readers that do not know these keys (torch, JAX, numpy) see the
# tensors under their dotted key paths ("model.fc.weight").

ST_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "complex64": "C64",
}
_FROM_ST = {code: name for name, code in ST_DTYPES.items()}
TREE_KEY, NAMES_KEY = "shoal_tree", "shoal_arrays"


def to_safetensors(obj: Any) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """obj's arrays by tensor name and the string metadata that rebuilds obj around them."""
    writer = _Writer()
    tree = writer.node(obj, "the saved object")
    arrays: dict[str, np.ndarray] = {}
    names = []
    for index, (name, arr) in enumerate(zip(writer.names, writer.arrays, strict=True)):
        if writer.meta[index]["dtype"] not in ST_DTYPES:
            raise SerializationError(
                f"core.save: safetensors has no dtype for {writer.meta[index]['dtype']} (array "
                f"{name!r}); it holds {sorted(ST_DTYPES)}. Save it in shoal's format instead.")
        unique, n = name, 1
        while unique in arrays:  # "a.b" as one key and as a nested path
            n += 1
            unique = f"{name}#{n}"
        arrays[unique] = arr
        names.append(unique)
    metadata = {"format": "pt", TREE_KEY: json.dumps(tree, separators=(",", ":")),
                NAMES_KEY: json.dumps(names, separators=(",", ":"))}
    return arrays, metadata


def safetensors_bytes(arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    """The bytes of a safetensors file holding `arrays` (contiguous, little-endian)."""
    import safetensors.numpy  # noqa: PLC0415  (its Rust extension loads only when used)

    try:
        return safetensors.numpy.save(arrays, metadata=metadata)
    except (ValueError, TypeError, safetensors.SafetensorError) as exc:
        raise SerializationError(f"core.save: safetensors refused the arrays: {exc}") from exc


def read_safetensors(blob: bytes, name: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A safetensors file's arrays (writable, owning their memory) and its string metadata."""
    import safetensors  # noqa: PLC0415  (its Rust extension loads only when used)

    def bad(why: str) -> SerializationError:
        return SerializationError(f"core.load: {name} is not a readable safetensors file: {why}.")

    if len(blob) < 8:
        raise bad("it ends inside the header length")
    (hlen,) = struct.unpack("<Q", blob[:8])
    if 8 + hlen > len(blob):
        raise bad(f"its header claims {hlen} bytes but the file has {len(blob)}")
    try:
        header = json.loads(blob[8:8 + hlen].decode("utf-8"))
        entries = safetensors.deserialize(blob)
    except (ValueError, safetensors.SafetensorError) as exc:
        raise bad(f"{type(exc).__name__}: {exc}") from exc
    metadata = header.get("__metadata__") or {} if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise bad("its __metadata__ is not a map of strings to strings")
    arrays = {}
    for key, entry in entries:
        code = entry["dtype"]
        if code not in _FROM_ST:
            raise bad(f"tensor {key!r} has dtype {code}, which core has no Tensor for "
                      f"(it reads {sorted(_FROM_ST)})")
        dt = dtypes.get(_FROM_ST[code]).np
        data = np.frombuffer(entry["data"], dtype=dt)  # a bytearray: writable, owned
        arrays[key] = data.reshape(tuple(int(n) for n in entry["shape"]))
    return arrays, metadata


class _NamedReader(_Reader):
    """Rebuilds core.save's tree from a safetensors file's arrays (looked up by name)."""

    def __init__(self, arrays: dict[str, np.ndarray], names: list, name: str,
                 map_location: Any) -> None:
        super().__init__(b"", name, map_location)
        self.by_name, self.names = arrays, names

    def _bad(self, why: str) -> SerializationError:
        return SerializationError(f"core.load: {self.name} is not a readable shoal "
                                  f"safetensors file: {why}.")

    def _array(self, index: Any) -> np.ndarray:
        if type(index) is not int or not 0 <= index < len(self.names):
            raise self._bad(f"array index {index!r} is not in its table")
        key = self.names[index]
        if not isinstance(key, str) or key not in self.by_name:
            raise self._bad(f"its tree names tensor {key!r}, which the file does not hold")
        return self.by_name[key]


    def rebuild(self, metadata: dict[str, str]) -> Any:
        """The saved object: core.save's tree, or a flat {name: Tensor} dict without one."""
        if TREE_KEY not in metadata:
            self.names = list(self.by_name)
            return {key: self._node(["tensor", i, False, "cpu"])
                    for i, key in enumerate(self.names)}
        try:
            self.names = json.loads(metadata[NAMES_KEY])
            if not isinstance(self.names, list):
                raise self._bad(f"{NAMES_KEY} is not a list")
            return self._node(json.loads(metadata[TREE_KEY]))
        except SerializationError:
            raise
        except RecursionError as exc:
            raise self._bad("its objects nest too deeply") from exc
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise self._bad(f"its metadata is damaged ({type(exc).__name__}: {exc})") from exc


def from_safetensors(arrays: dict[str, np.ndarray], metadata: dict[str, str],
                     map_location: Any = None, name: str = "the file") -> Any:
    """What `to_safetensors` took apart; without shoal's metadata a flat {name: Tensor} dict."""
    return _NamedReader(arrays, [], name, map_location).rebuild(metadata)


# The job secret's MAC over a safetensors file's content, kept in its metadata under MAC_KEY:
# HMAC-SHA256 over the other metadata (sorted JSON) and each tensor's name, dtype, shape and
# bytes in name order. It is computed from the parsed content, so it does not depend on how a
# writer lays out the header, and a file changed in any tensor or metadata entry is refused.
MAC_KEY = "shoal_mac"


class UnauthenticatedFile(SerializationError):
    """A safetensors file whose MAC is missing or does not match the key it is read with."""


def content_mac(arrays: dict[str, np.ndarray], metadata: dict[str, str], key: bytes) -> str:
    """The hex HMAC-SHA256 under `key` of a safetensors file's tensors and metadata."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    rest = {k: v for k, v in metadata.items() if k != MAC_KEY}
    mac.update(json.dumps(rest, sort_keys=True).encode("utf-8"))
    for name in sorted(arrays):
        arr = np.ascontiguousarray(arrays[name])
        head = json.dumps([name, dtypes.from_np(arr.dtype).name, list(arr.shape), arr.nbytes])
        mac.update(struct.pack("<Q", len(head)) + head.encode("utf-8"))
        mac.update(memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else b"")
    return mac.hexdigest()


def signed_safetensors(obj: Any, key: bytes, extra: Optional[dict[str, str]] = None) -> bytes:
    """core.save's safetensors bytes of obj with `extra` metadata, authenticated under `key`."""
    arrays, metadata = to_safetensors(obj)
    metadata.update(extra or {})
    metadata[MAC_KEY] = content_mac(arrays, metadata, key)
    return safetensors_bytes(arrays, metadata)


def verified_safetensors(blob: bytes, name: str, key: bytes,
                         map_location: Any = None) -> tuple[Any, dict[str, str]]:
    """The object in an authenticated safetensors file and its metadata, checked under `key`.

    Raises:
        UnauthenticatedFile: the MAC is missing or wrong (another job's, or the file changed).
        SerializationError: the file is not a readable safetensors file.
    """
    arrays, metadata = read_safetensors(blob, name)
    claimed = metadata.get(MAC_KEY)
    if claimed is None:
        raise UnauthenticatedFile(
            f"{name} carries no {MAC_KEY!r}: it was not written by shoal under a job secret, so "
            "it cannot be authenticated (load it with core.load to take it as plain weights).")
    if not hmac.compare_digest(claimed.encode("utf-8"),
                               content_mac(arrays, metadata, key).encode("utf-8")):
        raise UnauthenticatedFile(
            f"{name}'s MAC does not match this job's secret: it was written by another job "
            "(another SHOAL_AUTH_TOKEN) or changed since it was written.")
    return from_safetensors(arrays, metadata, map_location, name), metadata
