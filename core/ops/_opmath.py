"""torch's "opmath" for 16-bit floats on CPU: elementwise math in float32, rounded once.

torch's CPU kernels for bfloat16 and float16 load the operands, widen them to float32, compute
and round the result to the output dtype once (round to nearest even); a fused kernel (gelu,
tanh's or sigmoid's backward) rounds once at its end. Ops here do the same: `widen` the 16-bit
operands to float32 arrays, compute with numpy's float32 loops, and `narrow` the result to the
output dtype. That gives torch's values and is also the fast way on numpy:

- ml_dtypes' bfloat16 ufuncs convert, call a scalar C function and round back one element at a
  time (np.tanh on bfloat16 is ~20x slower than on float32, add/mul ~2x), while the casts to
  and from float32 are vectorised and cheap. So bfloat16 always widens.
- numpy's own float16 loops already compute each element in float32 and round once (add, mul)
  or run SIMD float16 code (tanh, exp), and its float16 <-> float32 casts are slow, so one
  ufunc on float16 costs less as it is. A chain of ufuncs (gelu's formula, a backward formula)
  widens float16 too: numpy would round after each step, where torch rounds once, and each
  float16 step with a Python scalar is slow (gelu: ~4x faster widened).

Only numpy arrays widen; cupy's float16 kernels compute in float32 already. Python scalars and
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


def widen(a: Any, chain: bool = False) -> Any:
    """`a` as a 16-bit float op computes on it: bfloat16 numpy arrays as float32 copies, and
    float16 ones too when `chain` (the caller runs several ufuncs on it); anything else as is."""
    if a.__class__ is not _ndarray:
        return a
    dt = a.dtype
    if dt is _BF16 or (chain and dt is _F16):
        return a.astype(_F32)
    return a


def compute_dtype(dtype: np.dtype, chain: bool = False) -> np.dtype:
    """The dtype `widen` computes an array of `dtype` in (to build a buffer there directly)."""
    return _F32 if dtype is _BF16 or (chain and dtype is _F16) else dtype


def narrow(a: Any, dtype: np.dtype) -> Any:
    """A result computed in float32 rounded once to `dtype` when that is a 16-bit float (the
    input dtype `widen` made float32); any other result as it is (exp of int64 is float64)."""
    if (dtype is _BF16 or dtype is _F16) and a.dtype is not dtype:
        return a.astype(dtype)
    return a
