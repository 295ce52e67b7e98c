"""Tensor constructors as torch names them: tensor, zeros, ones, full, randn, rand, arange, ..."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from shoal.core import backend
from shoal.core import dtypes
from shoal.core.ops import random as _random
from shoal.core.tensor import Tensor


def _dims(size: Sequence) -> tuple:
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        return tuple(int(n) for n in size[0])
    return tuple(int(n) for n in size)


def _finish(data: Any, requires_grad: bool) -> Tensor:
    return Tensor(data, requires_grad=requires_grad)


def _target(dtype: Any, device: Any, default: Any = None) -> tuple:
    dev = backend.device(device)
    if dtype is None:
        dtype = dtypes.get_default_dtype() if default is None else default
    np_dtype = dtypes.to_np(dtype, dev.type)
    return dev, np_dtype, backend.xp_for(dev)


def tensor(data: Any, dtype: Any = None, device: Any = None, requires_grad: bool = False) -> Tensor:
    """A new tensor holding a copy of data (lists, numbers, numpy/cupy arrays, tensors).

    Python floats become the default dtype (float32 unless core.set_default_dtype changed it)
    and ints int64, as in torch; arrays and numpy scalars keep
    their dtype (np.float64 is a Python float, yet torch keeps it float64).
    """
    if isinstance(data, Tensor):
        data = data.array
    elif isinstance(data, np.generic):
        data = np.asarray(data)
    if backend.is_array(data):
        src = data
        dev = backend.device(device) if device is not None else backend.device_of(data)
        np_dtype = dtypes.to_np(dtype if dtype is not None else data.dtype, dev.type)
        arr = backend.to_device(src, dev)
        arr = arr.astype(np_dtype, copy=arr is src)
        return _finish(arr, requires_grad)
    arr = np.asarray(data)
    if dtype is None:
        if arr.dtype == np.float64:
            arr = arr.astype(dtypes.get_default_dtype().np, copy=False)
        elif arr.dtype.kind == "i":
            arr = arr.astype(np.int64, copy=False)
        elif arr.dtype == np.complex128:  # Python complex numbers: complex64 (float64: 128)
            arr = arr.astype(dtypes.default_complex().np, copy=False)
        elif arr.dtype.kind not in "fbc":
            raise dtypes.DTypeError(
                f"tensor(): cannot make a tensor from data of numpy dtype {arr.dtype}."
            )
    else:
        arr = arr.astype(dtypes.to_np(dtype), copy=False)
    if device is not None:
        dev = backend.device(device)
        dtypes.to_np(dtypes.from_np(arr.dtype), dev.type)
        arr = backend.to_device(arr, dev)
    elif not arr.flags.owndata or arr is data:
        arr = arr.copy()
    return _finish(arr, requires_grad)


def as_tensor(data: Any, dtype: Any = None, device: Any = None) -> Tensor:
    """Like tensor(), but shares an array's memory when dtype and device already match."""
    if isinstance(data, Tensor) and dtype is None and device is None:
        return data
    if backend.is_array(data) and (dtype is None or dtypes.get(dtype).np == data.dtype) and (
        device is None or backend.device(device) == backend.device_of(data)
    ):
        return Tensor(data)
    return tensor(data, dtype=dtype, device=device)


def from_numpy(arr: np.ndarray) -> Tensor:
    """A tensor sharing a numpy array's memory."""
    return Tensor(arr)


def zeros(*size: Any, dtype: Any = None, device: Any = None, requires_grad: bool = False) -> Tensor:
    """A tensor of zeros."""
    dev, dt, xp = _target(dtype, device)
    with backend.device_context(dev):
        return _finish(xp.zeros(_dims(size), dtype=dt), requires_grad)


def ones(*size: Any, dtype: Any = None, device: Any = None, requires_grad: bool = False) -> Tensor:
    """A tensor of ones."""
    dev, dt, xp = _target(dtype, device)
    with backend.device_context(dev):
        return _finish(xp.ones(_dims(size), dtype=dt), requires_grad)


def empty(*size: Any, dtype: Any = None, device: Any = None, requires_grad: bool = False) -> Tensor:
    """An uninitialised tensor."""
    dev, dt, xp = _target(dtype, device)
    with backend.device_context(dev):
        return _finish(xp.empty(_dims(size), dtype=dt), requires_grad)


def full(
    size: Sequence[int], fill_value: Any, dtype: Any = None, device: Any = None,
    requires_grad: bool = False,
) -> Tensor:
    """A tensor filled with fill_value (dtype inferred from it as torch does)."""
    if dtype is None:
        dtype = (
            dtypes.bool_ if isinstance(fill_value, bool)
            else dtypes.int64 if isinstance(fill_value, int)
            else dtypes.default_complex() if isinstance(fill_value, complex)
            else dtypes.get_default_dtype()
        )
    dev, dt, xp = _target(dtype, device)
    with backend.device_context(dev):
        return _finish(xp.full(tuple(size), fill_value, dtype=dt), requires_grad)


def _like(x: Tensor, dtype: Any, device: Any) -> tuple:
    dev = backend.device(device) if device is not None else backend.device_of(x.array)
    dt = dtypes.to_np(dtype, dev.type) if dtype is not None else x.array.dtype
    return dev, dt, backend.xp_for(dev)


def zeros_like(x: Tensor, dtype: Any = None, device: Any = None, requires_grad: bool = False) -> Tensor:
    """Zeros with x's shape (and dtype/device unless given)."""
    dev, dt, xp = _like(x, dtype, device)
    with backend.device_context(dev):
        return _finish(xp.zeros(x.array.shape, dtype=dt), requires_grad)


def ones_like(x: Tensor, dtype: Any = None, device: Any = None, requires_grad: bool = False) -> Tensor:
    """Ones with x's shape (and dtype/device unless given)."""
    dev, dt, xp = _like(x, dtype, device)
    with backend.device_context(dev):
        return _finish(xp.ones(x.array.shape, dtype=dt), requires_grad)


def empty_like(x: Tensor, dtype: Any = None, device: Any = None) -> Tensor:
    """Uninitialised with x's shape (and dtype/device unless given)."""
    dev, dt, xp = _like(x, dtype, device)
    with backend.device_context(dev):
        return _finish(xp.empty(x.array.shape, dtype=dt), False)


def full_like(x: Tensor, fill_value: Any, dtype: Any = None, device: Any = None) -> Tensor:
    """fill_value with x's shape (and dtype/device unless given)."""
    dev, dt, xp = _like(x, dtype, device)
    with backend.device_context(dev):
        return _finish(xp.full(x.array.shape, fill_value, dtype=dt), False)


def _random_float(kind: str, size: tuple, dtype: Any, device: Any, requires_grad: bool,
                  generator: Any) -> Tensor:
    dev, dt, xp = _target(dtype, device)
    if np.dtype(dt).kind == "c":
        return _random_complex(kind, size, dt, dev, requires_grad, generator)
    if np.dtype(dt).kind != "f" and dt != dtypes.bfloat16.np:
        raise dtypes.DTypeError(f"{kind}: needs a floating point dtype, got {dtypes.from_np(dt)!r}.")
    if generator is not None:  # its twister draws on the cpu (core/ops/random.py)
        draw = _random.normal_from if kind == "randn" else _random.uniform_from
        n = int(np.prod(size, dtype=np.int64))
        arr = draw(_random.check_generator(generator, kind), n, dt).reshape(size).astype(dt)
        return _finish(backend.to_device(arr, dev), requires_grad)
    gen = _random.generator(xp, dev.index)
    # numpy/cupy generators draw float32 or float64 directly; other floats are cast after.
    draw = dt if dt in (np.float32, np.float64) else np.float32
    with backend.device_context(dev):
        if kind == "randn":
            arr = gen.standard_normal(size, dtype=draw)
        else:
            arr = gen.random(size, dtype=draw)
        if arr.dtype != dt:
            arr = arr.astype(dt)
    return _finish(arr, requires_grad)


def _random_complex(kind: str, size: tuple, dt: Any, dev: Any, requires_grad: bool,
                    generator: Any) -> Tensor:
    """torch's complex randn/rand: real draws for the interleaved (real, imag) pairs, randn's
    scaled by 1/sqrt(2) so each element has variance 1 (same values as torch's for a seed)."""
    real_dt = dtypes.from_np(np.dtype(dt)).to_real()
    pairs = _random_float(kind, size + (2,), real_dt, dev, False, generator).array
    if kind == "randn":
        pairs = pairs * np.sqrt(0.5).astype(pairs.dtype)
    arr = backend.xp_for(dev).ascontiguousarray(pairs).view(dt).reshape(size)
    return _finish(arr, requires_grad)


def randn(*size: Any, generator: Any = None, dtype: Any = None, device: Any = None,
          requires_grad: bool = False) -> Tensor:
    """Standard normal samples from the global generator (see manual_seed), or `generator`."""
    return _random_float("randn", _dims(size), dtype, device, requires_grad, generator)


def rand(*size: Any, generator: Any = None, dtype: Any = None, device: Any = None,
         requires_grad: bool = False) -> Tensor:
    """Uniform [0, 1) samples from the global generator (see manual_seed), or `generator`."""
    return _random_float("rand", _dims(size), dtype, device, requires_grad, generator)


def randint(
    low: int, high: int | None = None, size: Sequence[int] = (), *, generator: Any = None,
    dtype: Any = None, device: Any = None,
) -> Tensor:
    """Uniform integers in [low, high) (int64 by default)."""
    if high is None:
        low, high = 0, low
    dev, dt, xp = _target(dtype, device, dtypes.int64)
    if generator is not None:
        n = int(np.prod(tuple(size), dtype=np.int64))
        arr = _random.integers_from(_random.check_generator(generator, "randint"), low, high, n)
        return _finish(backend.to_device(arr.reshape(tuple(size)).astype(dt), dev), False)
    gen = _random.generator(xp, dev.index)
    with backend.device_context(dev):
        arr = gen.integers(low, high, size=tuple(size)).astype(dt, copy=False)
    return _finish(arr, False)


def randperm(n: int, *, generator: Any = None, dtype: Any = None, device: Any = None) -> Tensor:
    """A random permutation of 0..n-1 (torch's for the same seed with a `generator`)."""
    dev, dt, xp = _target(dtype, device, dtypes.int64)
    if generator is not None:
        arr = _random.check_generator(generator, "randperm").randperm(n).astype(dt)
    else:
        arr = _random.generator(np, None).permutation(n).astype(dt)
    return _finish(backend.to_device(arr, dev), False)


def arange(
    start: Any, end: Any = None, step: Any = 1, dtype: Any = None, device: Any = None,
    requires_grad: bool = False,
) -> Tensor:
    """Evenly spaced values in [start, end); int64 for integer arguments, else the default
    dtype."""
    if end is None:
        start, end = 0, start
    if dtype is None:
        ints = all(isinstance(v, int) for v in (start, end, step))
        dtype = dtypes.int64 if ints else dtypes.get_default_dtype()
    dev, dt, xp = _target(dtype, device)
    with backend.device_context(dev):
        return _finish(xp.arange(start, end, step, dtype=dt), requires_grad)


def linspace(start: float, end: float, steps: int, dtype: Any = None, device: Any = None) -> Tensor:
    """`steps` evenly spaced values from start to end inclusive."""
    dev, dt, xp = _target(dtype, device)
    with backend.device_context(dev):
        return _finish(xp.linspace(start, end, steps, dtype=dt), False)


def eye(n: int, m: int | None = None, dtype: Any = None, device: Any = None) -> Tensor:
    """The identity matrix."""
    dev, dt, xp = _target(dtype, device)
    with backend.device_context(dev):
        return _finish(xp.eye(n, m, dtype=dt), False)


class Size(tuple):
    """torch.Size: a tuple of dimension lengths."""

    def numel(self) -> int:
        """The number of elements a tensor of this shape holds."""
        n = 1
        for d in self:
            n *= int(d)
        return n

    def __repr__(self) -> str:
        return f"core.Size({list(self)})"


def _typed_constructor(dtype: Any, name: str) -> Any:
    """torch's legacy constructors: T(sizes...) is uninitialised, T(data) copies the data."""

    def construct(*args: Any) -> Tensor:
        if not args:
            return empty(0, dtype=dtype)
        if all(isinstance(a, int) and not isinstance(a, bool) for a in args):
            return empty(*args, dtype=dtype)
        if len(args) == 1:
            return tensor(args[0], dtype=dtype)
        raise TypeError(f"{name}(): pass sizes (ints) or one sequence of data, got {args!r}.")

    construct.__name__ = construct.__qualname__ = name
    construct.__doc__ = f"torch.{name}: a {dtype!r} tensor from sizes or data."
    return construct


FloatTensor = _typed_constructor(dtypes.float32, "FloatTensor")
DoubleTensor = _typed_constructor(dtypes.float64, "DoubleTensor")
LongTensor = _typed_constructor(dtypes.int64, "LongTensor")
IntTensor = _typed_constructor(dtypes.int32, "IntTensor")
