"""torch-named dtypes over numpy dtypes.

bfloat16: numpy has no bfloat16, so shoal uses `ml_dtypes.bfloat16` (the numpy extension type
JAX and TensorFlow use). Its arrays are ordinary numpy arrays whose elementwise math numpy runs
through ml_dtypes' ufunc loops (matmul included, slower than float32). cupy has no bfloat16
type, so asking for bfloat16 on a cuda device raises `DTypeError`; cast to float16 or float32
there.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from shoal.core.errors import ShoalError


class DTypeError(ShoalError, TypeError):
    """A dtype shoal does not know, or one the chosen device cannot hold."""


class DType:
    """A tensor element type, named as in torch (`core.float32`); wraps a numpy dtype."""

    __slots__ = ("name", "np", "is_floating_point", "is_complex", "itemsize")

    def __init__(self, name: str, np_dtype: Any, is_floating_point: bool) -> None:
        self.name = name
        self.np = np.dtype(np_dtype)
        self.is_floating_point = is_floating_point
        self.is_complex = self.np.kind == "c"
        self.itemsize = self.np.itemsize

    def to_real(self) -> "DType":
        """The real dtype of a complex one (complex64 -> float32); a real dtype itself."""
        return _BY_NP[self.np.type(0).real.dtype] if self.is_complex else self

    def to_complex(self) -> "DType":
        """The complex dtype of a floating one (float64 -> complex128), as torch's to_complex."""
        if self.is_complex:
            return self
        return complex128 if self.np == np.float64 else complex64

    def __repr__(self) -> str:
        return f"core.{self.name}"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DType):
            return self is other
        try:
            return get(other) is self  # type: ignore[arg-type]
        except DTypeError:
            return False

    def __hash__(self) -> int:
        return hash(self.name)

    def __reduce__(self) -> Any:
        return (get, (self.name,))


float16 = DType("float16", np.float16, True)
bfloat16 = DType("bfloat16", ml_dtypes.bfloat16, True)
float32 = DType("float32", np.float32, True)
float64 = DType("float64", np.float64, True)
int32 = DType("int32", np.int32, False)
int64 = DType("int64", np.int64, False)
bool_ = DType("bool", np.bool_, False)
# Types numpy produces that have no shoal name still get a DType so `.dtype` never fails.
uint8 = DType("uint8", np.uint8, False)
int8 = DType("int8", np.int8, False)
int16 = DType("int16", np.int16, False)
# Complex dtypes are not floating point in torch's sense (is_floating_point() is False).
complex64 = DType("complex64", np.complex64, False)
complex128 = DType("complex128", np.complex128, False)

ALL = (float16, bfloat16, float32, float64, int32, int64, bool_, uint8, int8, int16, complex64,
       complex128)
_BY_NP = {d.np: d for d in ALL}
_BY_NAME = {d.name: d for d in ALL}
_BY_NAME.update(half=float16, float=float32, double=float64, long=int64, int=int32,
                cfloat=complex64, cdouble=complex128)


def get(spec: Any) -> DType:
    """Resolve a DType, a name ('float32'), or a numpy dtype/type to a shoal DType."""
    if isinstance(spec, DType):
        return spec
    if isinstance(spec, str):
        found = _BY_NAME.get(spec.removeprefix("core.").removeprefix("torch."))
        if found is None:
            raise DTypeError(f"Unknown dtype {spec!r}; shoal knows {sorted(_BY_NAME)}.")
        return found
    try:
        return _BY_NP[np.dtype(spec)]
    except (TypeError, KeyError) as exc:
        raise DTypeError(f"Unsupported dtype {spec!r}; shoal knows {sorted(_BY_NAME)}.") from exc


def from_np(np_dtype: Any) -> DType:
    """The shoal DType of a numpy (or cupy) array's dtype."""
    found = _BY_NP.get(np_dtype)
    if found is None:
        return get(np_dtype)
    return found


def to_np(spec: Any, device_type: str = "cpu") -> np.dtype:
    """The numpy dtype to allocate `spec` with on a device type, refusing bfloat16 on cuda."""
    dt = get(spec)
    if device_type == "cuda" and dt is bfloat16:
        raise DTypeError(
            "cupy has no bfloat16 type, so shoal cannot hold bfloat16 on a cuda device; "
            "use float16 or float32 there."
        )
    return dt.np


# torch's default floating dtype: what Python floats, floating creators (rand, zeros, arange of
# floats, ...), integer division and new parameters get. One per process, as torch's.
_DEFAULT = [float32]
_DEFAULTABLE = (float32, float64, float16, bfloat16)


def get_default_dtype() -> DType:
    """The default floating dtype (float32 unless set_default_dtype changed it)."""
    return _DEFAULT[0]


def set_default_dtype(d: Any) -> None:
    """Make d (float32, float64, float16 or bfloat16) the default floating dtype, as torch's;
    Python complex numbers then become complex128 under float64, else complex64."""
    dt = get(d)
    if dt not in _DEFAULTABLE:
        raise TypeError("only floating-point types are supported as the default type")
    _DEFAULT[0] = dt


def default_complex() -> DType:
    """The complex dtype that goes with the default floating dtype (torch's rule)."""
    return complex128 if _DEFAULT[0] is float64 else complex64
