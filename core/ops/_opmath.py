"""torch's "opmath" for 16-bit floats on CPU: elementwise math in float32, rounded once.

torch's CPU kernels for bfloat16 and float16 load the operands, widen them to float32, compute
and round the result to the output dtype once (round to nearest even); a fused kernel (gelu,
tanh's or sigmoid's backward) rounds once at its end. Ops here do the same: `widen` the 16-bit
operands to float32 arrays, compute with numpy's float32 loops, and `narrow` the result to the
output dtype. That gives torch's values and is also the fast way on numpy:

- ml_dtypes' bfloat16 ufuncs convert, call a scalar C function and round back one element at
  a time (np.tanh on bfloat16 is ~20x slower than on float32, add, mul and comparisons 2-20x),
  while its casts to and from float32 are vectorised and cheap. So bfloat16 always widens.
- numpy's own float16 loops compute each element in float32 and round once too, but they
  round a Python number operand to float16 first (torch's mul and div keep it in float32), and
  a formula of several ufuncs rounds after each. So float16 widens as well (`widen`), except
  for a lone ufunc with numpy's fast float16 loop (exp, log, sqrt, tanh) or an exact one
  (relu, abs, clamp, comparisons): numpy's float16 <-> float32 casts are slow, and those give
  torch's values as they are (`widen_bf16`).

Only numpy arrays widen; cupy's float16 kernels compute in float32 already. Python numbers and
None pass through. Gradients come back in their input's dtype, as torch's do.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

_ndarray = np.ndarray
_F16 = np.dtype(np.float16)
_BF16 = np.dtype(ml_dtypes.bfloat16)
_F32 = np.dtype(np.float32)


def widen(a: Any) -> Any:
    """`a` as a 16-bit float op computes on it: a bfloat16 or float16 numpy array as a float32
    copy; anything else as it is."""
    if a.__class__ is not _ndarray:
        return a
    dt = a.dtype
    if dt is _BF16 or dt is _F16:
        return a.astype(_F32)
    return a


def widen_bf16(a: Any) -> Any:
    """`widen` for a lone ufunc that numpy runs well on float16 (exp, log, sqrt, tanh) or that
    is exact (relu, abs, clamp, comparisons): bfloat16 widens, float16 stays as it is."""
    if a.__class__ is _ndarray and a.dtype is _BF16:
        return a.astype(_F32)
    return a


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype `widen` computes an array of `dtype` in (to build a buffer there directly)."""
    return _F32 if dtype is _BF16 or dtype is _F16 else dtype


def narrow(a: Any, dtype: np.dtype) -> Any:
    """A result computed in float32 rounded once to `dtype` when that is a 16-bit float (the
    input dtype `widen` made float32); any other result as it is (exp of int64 is float64)."""
    if (dtype is _BF16 or dtype is _F16) and a.dtype is not dtype:
        return a.astype(dtype)
    return a


def rounded_number(a: Any, dtype: np.dtype) -> Any:
    """A Python number operand of a 16-bit op rounded to that dtype first, as torch casts the
    number of an add, a sub, a pow or a comparison to the tensor's dtype (x + 0.1 adds
    bfloat16(0.1) = 0.10009765625; mul and div keep the number in float32). Arrays, other
    dtypes and None pass as they are."""
    if (dtype is _BF16 or dtype is _F16) and isinstance(a, (int, float)):
        with np.errstate(over="ignore"):  # 70000 in float16 is inf, as in torch
            return float(np.asarray(float(a), dtype=dtype))
    return a
