"""The op table's vocabulary, in the spirit of torch's OpInfo: an `OpInfo` per op declares its
sample inputs, dtypes, gradient, in-place variant, view-ness and one bad input; `Lib` runs a
sample in core or in torch from the same numpy data, so the two results can be compared.

The entries live in entries_*.py beside this module; test_optable.py runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import ml_dtypes
import numpy as np
import torch

from shoal import core

FLOATS = ("float32", "float64")
HALVES = ("float16", "bfloat16")
INTS = ("int64", "int32", "uint8")
ALL = FLOATS + HALVES + INTS + ("bool",)
NUMERIC = FLOATS + HALVES + INTS

_NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
       "float64": np.float64, "int64": np.int64, "int32": np.int32, "int16": np.int16,
       "int8": np.int8, "uint8": np.uint8, "bool": np.bool_}

# Forward tolerances (rtol, atol) by the dtype the result is compared in. Why each holds on any
# x86-64 CPU:
TOLERANCES = {
    # Both libraries round each elementwise op once in double; their libm functions differ by
    # under 1 ulp (2e-16) and reductions here add at most 60 terms in another order.
    "float64": (1e-12, 1e-12),
    # float32: numpy's and torch's vectorised exp/log/tanh differ by up to ~4 ulp (5e-7 relative),
    # and a 60-term sum in another order adds ~sqrt(60) ulp; 1e-5 leaves margin for both.
    "float32": (1e-5, 1e-6),
    # Both compute in float32 and round once to 16 bits (core/ops/_opmath.py), so results agree
    # to one 16-bit step: float16's is 2**-10 (1e-3) relative, bfloat16's 2**-7 (7.8e-3).
    "float16": (2e-3, 1e-3),
    "bfloat16": (1.6e-2, 1e-2),
    # Complex results (core.fft, complex ops): pocketfft against torch's FFT (MKL or pocketfft)
    # on at most 60 points, an error of a few ulp times log2(n) of the largest magnitude (~10).
    "complex64": (1e-5, 1e-5),
    "complex128": (1e-12, 1e-12),
}
# Gradients are compared in float64: both run the same chain rule and differ by reassociation
# only, which in double costs a few ulp per term (< 1e-13 relative on these sizes).
GRAD_TOLERANCE = (1e-10, 1e-12)


# Why core's error type differs from torch's, shared by many entries.
NUMPY_ERROR = "core lets numpy's ValueError through where torch raises RuntimeError"


@dataclass(frozen=True)
class A:
    """A tensor argument: its shape, the range its values come from, and a dtype when it is
    fixed rather than the dtype under test ("real", "pos" > 0.5, "unit" in (-0.9, 0.9),
    "index" an int64 in [0, 3), "mask" a bool, "special" NaN, infinities and -0.0, "sign" +1 or -1)."""

    shape: tuple
    domain: str = "real"
    dtype: str | None = None


@dataclass(frozen=True)
class DT:
    """A dtype argument (core.float64 or torch.float64, by name; "*" is the dtype under test)."""

    name: str


@dataclass(frozen=True)
class Seq:
    """A list of tensor arguments (cat, stack)."""

    items: tuple


@dataclass(frozen=True)
class Sample:
    """One call: positional and keyword arguments, with A/DT/Seq placeholders."""

    args: tuple
    kwargs: Mapping[str, Any] = field(default_factory=dict)


def S(*args: Any, **kwargs: Any) -> Sample:  # noqa: N802 - short, as the entries use it a lot
    """A Sample from a call's arguments."""
    return Sample(args, kwargs)


def unary_samples(domain: str = "real") -> tuple:
    """A matrix, a broadcastable row, a 0-d tensor and an empty one."""
    return (S(A((3, 4), domain)), S(A((5,), domain)), S(A((), domain)), S(A((0, 3), domain)))


def binary_samples(domain: str = "real") -> tuple:
    """Same shapes, broadcasting both ways, a 0-d operand and a Python number."""
    return (S(A((3, 4)), A((3, 4), domain)), S(A((3, 1)), A((1, 4), domain)),
            S(A((2, 3, 4)), A((4,), domain)), S(A((3, 4)), A((), domain)),
            S(A((3, 4)), 1.5 if domain != "index" else 2))


@dataclass(frozen=True)
class OpInfo:
    """One op and what it promises: see the module docstring.

    `forms` names where it lives, first the one the checks run: "function" (core.name and
    torch.name), "method" (Tensor.name) or "call" (`call(lib, *args)`, for operators and
    properties). `xfail` maps an aspect ("forward", "forward-int64", "backward", "inplace",
    "alias", "error", "forms") to the reason core differs today; `missing` xfails every
    aspect of an op core lacks.
    """

    name: str
    samples: tuple
    dtypes: tuple = FLOATS
    forms: tuple = ("function", "method")
    grad: bool = True
    inplace: str | None = None
    view: bool = False
    error: tuple | None = None  # (Sample, exception type torch raises)
    call: Callable | None = None
    xfail: Mapping[str, str] = field(default_factory=dict)
    missing: str | None = None
    random: bool = False  # compare shape and dtype only
    covers: tuple = ()  # extra core names this entry stands for (aliases, operators)

    def run(self, lib: Any, args: tuple, kwargs: Mapping[str, Any], form: str | None = None) -> Any:
        """Call the op in `lib` (core or torch) on materialised arguments."""
        form = form or self.forms[0]
        if form == "call":
            return self.call(lib, *args, **kwargs)
        if form == "method":
            return getattr(args[0], self.name)(*args[1:], **kwargs)
        return getattr(lib, self.name)(*args, **kwargs)


def op(name: str, samples: tuple, **kw: Any) -> OpInfo:
    """An OpInfo; keyword arguments as OpInfo's fields."""
    return OpInfo(name, tuple(samples), **kw)


def operator_call(fn: Callable, reflected: bool = False) -> Callable:
    """`call` for a Python operator, optionally with its operands swapped (`2.0 + t`)."""
    if reflected:
        return lambda lib, x, y: fn(y, x)
    return lambda lib, *args: fn(*args)



class Lib:
    """Makes one sample's arguments for core and for torch from the same numpy data."""

    def __init__(self, dtype: str, seed: int = 0) -> None:
        self.dtype = dtype
        self.rng = np.random.default_rng(seed)

    def arrays(self, sample: Sample) -> tuple[tuple, dict]:
        """The sample with each placeholder replaced by its numpy data (or dtype name)."""
        return (tuple(self._data(a) for a in sample.args),
                {k: self._data(v) for k, v in sample.kwargs.items()})

    def _data(self, value: Any) -> Any:
        if isinstance(value, A):
            return self._array(value)
        if isinstance(value, Seq):
            return [self._array(a) for a in value.items]
        if isinstance(value, DT) and value.name == "*":
            return DT(self.dtype)
        return value

    def _array(self, a: A) -> np.ndarray:
        dt = a.dtype or ("int64" if a.domain == "index" else "bool" if a.domain == "mask"
                         else self.dtype)
        size = int(np.prod(a.shape))
        if a.domain == "index":
            raw = self.rng.integers(0, 3, size)
        elif a.domain == "mask" or dt == "bool":
            raw = self.rng.random(size) > 0.5
        elif dt in INTS or dt in ("int16", "int8"):
            low = 1 if a.domain == "pos" else 0 if dt == "uint8" else -5
            raw = self.rng.integers(low, 6, size)
        elif a.domain == "special":  # the values predicates and nan_to_num exist for
            raw = np.resize(np.array([np.nan, np.inf, -np.inf, -0.0, 1.5]), size)
        elif a.domain == "pos":
            raw = self.rng.random(size) * 2 + 0.5
        elif a.domain == "unit":
            raw = self.rng.random(size) * 1.8 - 0.9
        elif a.domain == "sign":  # the +1/-1 targets of the embedding and ranking losses
            raw = np.where(self.rng.random(size) > 0.5, 1.0, -1.0)
        else:
            raw = self.rng.standard_normal(size) * 2
        return np.asarray(raw).astype(_NP[dt]).reshape(a.shape)


def to_lib(lib: Any, value: Any, requires_grad: bool = False) -> Any:
    """numpy data (from Lib.arrays) as lib's tensors; dtype names as lib's dtypes."""
    if isinstance(value, DT):
        return getattr(lib, value.name)
    if isinstance(value, list):
        return [to_lib(lib, v, requires_grad) for v in value]
    if not isinstance(value, np.ndarray):
        return value
    if lib is core:
        t = core.from_numpy(value.copy())
    elif value.dtype == ml_dtypes.bfloat16:
        t = torch.from_numpy(value.astype(np.float32)).to(torch.bfloat16)
    else:
        t = torch.from_numpy(value.copy())
    if requires_grad and value.dtype.kind in "fV":
        t.requires_grad_(True)
    return t


def materialise(lib: Any, data: tuple[tuple, dict], requires_grad: bool = False) -> tuple:
    """(args, kwargs) of lib's values from Lib.arrays' numpy data."""
    args, kwargs = data
    return (tuple(to_lib(lib, a, requires_grad) for a in args),
            {k: to_lib(lib, v, requires_grad) for k, v in kwargs.items()})


def tensors_of(value: Any) -> list:
    """The tensors in a result or an argument list, flattened in order."""
    if isinstance(value, (core.Tensor, torch.Tensor)):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


def dtype_name(t: Any) -> str:
    """A tensor's dtype as a bare name ("float32"), for core and torch alike."""
    if isinstance(t, core.Tensor):
        return t.dtype.name
    return str(t.dtype).removeprefix("torch.")


def as_numpy(t: Any) -> np.ndarray:
    """A tensor's values as numpy (16-bit floats widened exactly to float64)."""
    if isinstance(t, core.Tensor):
        arr = t.numpy(force=True)
        return arr.astype(np.float64) if arr.dtype.kind in "fV" and arr.itemsize == 2 else arr
    t = t.detach().resolve_conj().resolve_neg()  # torch.fft's inverses return lazy conjugates
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.to(torch.float64)
    return t.numpy()


def assert_same(mine: Any, theirs: Any, what: str) -> None:
    """core's result equals torch's: the same structure, dtypes, shapes and values (within the
    tolerance of the result's dtype)."""
    if isinstance(theirs, (torch.Tensor, core.Tensor)):
        assert isinstance(mine, core.Tensor), f"{what}: core gave {type(mine).__name__}, torch a tensor"
        assert dtype_name(mine) == dtype_name(theirs), (
            f"{what}: dtype {dtype_name(mine)}, torch's {dtype_name(theirs)}")
        assert tuple(mine.shape) == tuple(theirs.shape), (
            f"{what}: shape {tuple(mine.shape)}, torch's {tuple(theirs.shape)}")
        a, b = as_numpy(mine), as_numpy(theirs)
        rtol, atol = TOLERANCES.get(dtype_name(theirs), (0, 0))
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, equal_nan=True, err_msg=what)
    elif isinstance(theirs, (tuple, list)):
        assert isinstance(mine, (tuple, list)), f"{what}: core gave {type(mine).__name__}"
        assert len(mine) == len(theirs), f"{what}: {len(mine)} results, torch's {len(theirs)}"
        for i, (m, t) in enumerate(zip(mine, theirs)):
            assert_same(m, t, f"{what}[{i}]")
    else:
        assert mine == theirs, f"{what}: {mine!r}, torch's {theirs!r}"


def assert_like(mine: Any, theirs: Any, what: str) -> None:
    """For random ops: the same structure, dtypes and shapes (values differ by design)."""
    for m, t in zip(tensors_of(mine), tensors_of(theirs), strict=True):
        assert dtype_name(m) == dtype_name(t), f"{what}: dtype {dtype_name(m)}, torch's {dtype_name(t)}"
        assert tuple(m.shape) == tuple(t.shape), f"{what}: shape {tuple(m.shape)}, torch's {tuple(t.shape)}"
