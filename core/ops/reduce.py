"""Reductions over dims with keepdim (sum, mean, max, min, ...) and softmax/log_softmax."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import builtins

import ml_dtypes
import numpy as np

from shoal.core import dtypes
from shoal.core.amp.autocast_mode import STATE as _AMP
from shoal.core.ops import _autocast
from shoal.core.ops._util import cj, norm_dims, result, xp_of
from shoal.core.ops.shape import maximum
from shoal.core.tensor import Tensor, wrap

_HALF = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))

MaxResult = namedtuple("MaxResult", ["values", "indices"])


def _expand_back(g: Any, dims: tuple | None, keepdim: bool, shape: tuple) -> Any:
    """Broadcast a reduced gradient back to the input shape (a read-only view)."""
    xp = xp_of(g)
    if dims is not None and not keepdim:
        g = xp.expand_dims(g, dims)
    return xp.broadcast_to(g, shape)


def sum(x: Any, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Any:  # noqa: A001
    """Sum over `dim` (all dims when None)."""
    if _AMP.active:
        (x,) = _autocast.cast("sum", x)
    xd = x.array
    dims = norm_dims(dim, xd.ndim, "sum")
    np_dtype = None
    if dtype is not None:
        np_dtype = dtypes.get(dtype).np
    elif xd.dtype.kind in "biu":
        np_dtype = np.int64  # torch sums every integer and bool dtype to int64 (numpy: uint64)
    if np_dtype is None and xd.dtype in _HALF:
        # Accumulate half precisions in float32 (as torch does), then return the input's dtype.
        out = _as_array(xd.sum(axis=dims, keepdims=keepdim, dtype=np.float32), xd).astype(xd.dtype)
    else:
        out = xd.sum(axis=dims, keepdims=keepdim, dtype=np_dtype)

    def backward(g: Any) -> tuple:
        return (_expand_back(g, dims, keepdim, xd.shape),)

    return result(_as_array(out, xd), "SumBackward", backward, (x,))


def mean(x: Any, dim: Any = None, keepdim: bool = False) -> Any:
    """Arithmetic mean over `dim` (all dims when None)."""
    xd = x.array
    dims = norm_dims(dim, xd.ndim, "mean")
    if xd.dtype in _HALF:
        out = _as_array(xd.mean(axis=dims, keepdims=keepdim, dtype=np.float32), xd).astype(xd.dtype)
    else:
        out = xd.mean(axis=dims, keepdims=keepdim)
    count = xd.size // builtins.max(_as_array(out, xd).size, 1) if xd.size else 1

    def backward(g: Any) -> tuple:
        return (_expand_back(g / count, dims, keepdim, xd.shape),)

    return result(_as_array(out, xd), "MeanBackward", backward, (x,))


def prod(x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    """The product over one dim (all elements when None); integers and bools give int64."""
    if _AMP.active:
        (x,) = _autocast.cast("prod", x)  # torch's autocast lists compute prod in float32
    xd = x.array
    if dtype is not None:
        xd = xd.astype(dtypes.get(dtype).np)
    elif xd.dtype.kind in "biu":
        xd = xd.astype(np.int64)  # torch multiplies every integer and bool dtype in int64
    if dim is not None and not isinstance(dim, int):
        raise TypeError(f"prod(): dim must be an int or None, got {type(dim).__name__}.")
    axis = None if dim is None else norm_dims(dim, xd.ndim, "prod")[0]
    half = xd.dtype in _HALF
    work = xd.astype(np.float32) if half else xd
    out = _as_array(work.prod(axis=axis, keepdims=keepdim), xd).astype(xd.dtype)

    def backward(g: Any) -> tuple:
        # The product of the other elements, from exclusive running products on both sides
        # (no division, so zeros get torch's gradient); conjugated for complex inputs.
        flat = work.reshape(-1) if axis is None else work
        ax = 0 if axis is None else axis
        others = _exclusive_cumprod(flat, ax, False) * _exclusive_cumprod(flat, ax, True)
        others = others.reshape(work.shape)
        gk = _expand_back(g, None if axis is None else (axis,), keepdim or axis is None, xd.shape)
        return ((gk * cj(others)).astype(x.array.dtype),)

    return result(out, "ProdBackward", backward, (x,), exact_dtype=True)


def _exclusive_cumprod(a: Any, axis: int, reverse: bool) -> Any:
    """Products of the elements before (after, when reversed) each position along axis."""
    xp = xp_of(a)
    if reverse:
        a = xp.flip(a, axis)
    ones = xp.ones_like(xp.take(a, [0], axis=axis))
    shifted = xp.concatenate([ones, xp.take(a, range(a.shape[axis] - 1), axis=axis)], axis)
    out = xp.cumprod(shifted, axis=axis)
    return xp.flip(out, axis) if reverse else out


def _as_array(out: Any, like: Any) -> Any:
    # numpy returns numpy scalars for full reductions; tensors always hold arrays.
    if isinstance(out, np.generic) or not hasattr(out, "flags"):
        return xp_of(like).asarray(out)
    return out


def _extreme(x: Any, dim: Any, keepdim: bool, largest: bool) -> Any:
    op = "max" if largest else "min"
    xd = x.array
    xp = xp_of(xd)
    if dim is None:
        out = _as_array(xd.max() if largest else xd.min(), xd)

        def backward_all(g: Any) -> tuple:
            # Ties share the gradient evenly (torch's rule for a full max/min).
            mask = xd == out
            return (mask * (g / mask.sum()),)

        return result(out, f"{op.capitalize()}Backward", backward_all, (x,))
    (axis,) = norm_dims(dim, xd.ndim, op)
    idx = (xd.argmax if largest else xd.argmin)(axis=axis, keepdims=True)
    values = xp.take_along_axis(xd, idx, axis=axis)
    if not keepdim:
        values = values.squeeze(axis)

    def backward(g: Any) -> tuple:
        if not keepdim:
            g = xp.expand_dims(g, axis)
        positions = xp.arange(xd.shape[axis]).reshape(
            (-1,) + (1,) * (xd.ndim - axis - 1)
        )
        return ((positions == idx) * g,)

    vals = result(values, f"{op.capitalize()}Backward", backward, (x,))
    indices = wrap(idx if keepdim else idx.squeeze(axis))
    return MaxResult(vals, indices)


def max(x: Any, dim: Any = None, keepdim: bool = False) -> Any:  # noqa: A001
    """The maximum; with dim, a (values, indices) pair as in torch."""
    if isinstance(dim, Tensor):
        return maximum(x, dim)
    return _extreme(x, dim, keepdim, True)


def min(x: Any, dim: Any = None, keepdim: bool = False) -> Any:  # noqa: A001
    """The minimum; with dim, a (values, indices) pair as in torch."""
    return _extreme(x, dim, keepdim, False)


def _amax(x: Any, dim: Any, keepdim: bool, largest: bool) -> Any:
    xd = x.array
    dims = norm_dims(dim, xd.ndim, "amax" if largest else "amin")
    fn = xd.max if largest else xd.min
    out = _as_array(fn(axis=dims, keepdims=keepdim), xd)

    def backward(g: Any) -> tuple:
        full = _expand_back(out, dims, keepdim, xd.shape)
        mask = xd == full
        count = mask.sum(axis=dims, keepdims=True)
        gk = g if keepdim or dims is None else xp_of(g).expand_dims(g, dims)
        return (mask * (gk / count),)

    return result(out, "AmaxBackward" if largest else "AminBackward", backward, (x,))


def amax(x: Any, dim: Any = None, keepdim: bool = False) -> Any:
    """The maximum over dims; ties share the gradient evenly."""
    return _amax(x, dim, keepdim, True)


def amin(x: Any, dim: Any = None, keepdim: bool = False) -> Any:
    """The minimum over dims; ties share the gradient evenly."""
    return _amax(x, dim, keepdim, False)


def argmax(x: Any, dim: Any = None, keepdim: bool = False) -> Any:
    """Indices of the maxima (int64, no grad)."""
    xd = x.array
    if dim is None:
        return wrap(_as_array(xd.argmax(), xd))
    (axis,) = norm_dims(dim, xd.ndim, "argmax")
    return wrap(xd.argmax(axis=axis, keepdims=keepdim))


def argmin(x: Any, dim: Any = None, keepdim: bool = False) -> Any:
    """Indices of the minima (int64, no grad)."""
    xd = x.array
    if dim is None:
        return wrap(_as_array(xd.argmin(), xd))
    (axis,) = norm_dims(dim, xd.ndim, "argmin")
    return wrap(xd.argmin(axis=axis, keepdims=keepdim))


def var(x: Any, dim: Any = None, keepdim: bool = False, correction: int = 1) -> Any:
    """Variance with Bessel's correction by default (as torch)."""
    mu = mean(x, dim, keepdim=True)
    d = x - mu
    n = x.array.size // mu.array.size
    if d.array.dtype.kind == "c":  # |d|^2: a complex tensor's variance is real, as in torch
        return sum((d * d.conj()).real, dim, keepdim) / (n - correction)
    return sum(d * d, dim, keepdim) / (n - correction)


def softmax(x: Any, dim: int = -1) -> Any:
    """exp(x) / sum(exp(x)) along dim, shifted by the max for stability."""
    if _AMP.active:
        (x,) = _autocast.cast("softmax", x)
    xd = x.array
    xp = xp_of(xd)
    (axis,) = norm_dims(dim, xd.ndim, "softmax")
    # asarray: on a 0-d input numpy's subtraction gives a scalar, which cannot be written into
    out = xp.asarray(xd - xd.max(axis=axis, keepdims=True))
    xp.exp(out, out=out)
    out /= out.sum(axis=axis, keepdims=True)

    def backward(g: Any) -> tuple:
        gy = g * out
        gy -= out * gy.sum(axis=axis, keepdims=True)
        return (gy,)

    return result(out, "SoftmaxBackward", backward, (x,))


def log_softmax(x: Any, dim: int = -1) -> Any:
    """x - logsumexp(x) along dim."""
    if _AMP.active:
        (x,) = _autocast.cast("log_softmax", x)
    xd = x.array
    xp = xp_of(xd)
    (axis,) = norm_dims(dim, xd.ndim, "log_softmax")
    out = xp.asarray(xd - xd.max(axis=axis, keepdims=True))  # an array for 0-d input too
    out -= xp.log(xp.exp(out).sum(axis=axis, keepdims=True))

    def backward(g: Any) -> tuple:
        return (g - xp.exp(out) * g.sum(axis=axis, keepdims=True),)

    return result(out, "LogSoftmaxBackward", backward, (x,))


def logsumexp(x: Any, dim: Any, keepdim: bool = False) -> Any:
    """log(sum(exp(x))) along dim, stably."""
    if _AMP.active:
        (x,) = _autocast.cast("logsumexp", x)
    xd = x.array
    xp = xp_of(xd)
    dims = norm_dims(dim, xd.ndim, "logsumexp")
    m = xd.max(axis=dims, keepdims=True)
    lse = xp.log(xp.exp(xd - m).sum(axis=dims, keepdims=True)) + m
    out = lse if keepdim else lse.squeeze(dims)

    def backward(g: Any) -> tuple:
        gk = g if keepdim else xp.expand_dims(g, dims)
        return (gk * xp.exp(xd - lse),)

    return result(out, "LogsumexpBackward", backward, (x,))
