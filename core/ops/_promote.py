"""torch's type promotion (torch.result_type) over numpy dtypes, for ops with several operands.

numpy's rules differ from torch's in ways a torch user notices: numpy lets a 0-d array widen a
dimensioned one (float32 + 0-d float64 is float64), turns integers mixed with float32 into
float64, and ml_dtypes' bfloat16 has no weak Python scalars (bfloat16 + 2.5 is float32,
where(c, bfloat16, 0.0) float64). torch ranks operands in three tiers, each allowed to pick
the result only when it is of a higher category (bool < integer < floating < complex) than
every tier above it:

1. dimensioned tensors,
2. 0-d tensors,
3. Python numbers ("wrapped numbers"): a float counts as the default dtype (float32), an int
   as int64, a bool as bool.

So float32 + 0-d float64 is float32, bfloat16 + 2.5 is bfloat16, int64 + 0-d float64 is
float64 and int64 + 2.5 is float32. Within a tier dtypes promote as torch's table: the wider
of one category, the floating one across integer and floating (int64 with float16 is float16),
and bfloat16 with float16 is float32.

Ops call `promote(*operands)`: it returns the result dtype and the array operands cast to it.
Python scalars stay Python scalars (numpy treats them as weak, so they do not widen), and
the op casts its output to the result dtype at the end. A 16-bit result dtype is computed in
float32 and rounded once, torch's "opmath" (core/ops/_opmath.py): mul and div use a Python
number as it is there, add, sub, pow and comparisons round it to the 16-bit dtype first, as
torch does.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from shoal.core import dtypes

_ndarray = np.ndarray
_BOOL = np.dtype(np.bool_)
_I64 = np.dtype(np.int64)
_F16 = np.dtype(np.float16)
_BF16 = np.dtype(ml_dtypes.bfloat16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_C64 = np.dtype(np.complex64)
_C128 = np.dtype(np.complex128)
def default_float() -> np.dtype:
    """torch's default dtype (core.set_default_dtype): what a Python float and integer
    division give."""
    return dtypes.get_default_dtype().np

_DIM, _ZERO, _WRAPPED = 0, 1, 2


def category(dt: np.dtype) -> int:
    """0 bool, 1 integer, 2 floating (bfloat16 included: its numpy kind is 'V'), 3 complex."""
    kind = dt.kind
    if kind == "f" or dt == _BF16:
        return 2
    if kind in "iu":
        return 1
    if kind == "b":
        return 0
    if kind == "c":
        return 3
    raise TypeError(f"type promotion: dtype {dt} is not a number type torch knows.")


def is_reduced_float(dt: np.dtype) -> bool:
    """True for the 16-bit floating types, which torch computes in float32 ("opmath")."""
    return dt == _BF16 or dt == _F16


def promote_types(a: np.dtype, b: np.dtype) -> np.dtype:
    """torch.promote_types for two dtypes."""
    if a == b:
        return a
    ca, cb = category(a), category(b)
    if ca != cb:
        high, low = (a, b) if ca > cb else (b, a)
        if category(high) == 3 and category(low) == 2:  # complex64 with float64: complex128
            return np.promote_types(high, _F32 if is_reduced_float(low) else low)
        return high  # bool < integer < floating < complex: the higher one as it is
    if ca == 2 and (a == _BF16 or b == _BF16):
        other = b if a == _BF16 else a
        return _F32 if other == _F16 else other  # bfloat16 with float32/float64: the wider
    return np.promote_types(a, b)


def _combine(higher: np.dtype | None, lower: np.dtype | None) -> np.dtype | None:
    """torch's combine_categories: a lower tier counts only when its category is higher."""
    if higher is None:
        return lower
    if lower is None:
        return higher
    ch, cl = category(higher), category(lower)
    if ch == 3:
        return higher
    if cl == 3:  # a complex number keeps a floating tensor's precision
        if ch == 2:
            return _C128 if higher == _F64 else _C64
        return lower
    if ch == 2:
        return higher
    if ch == 0 or cl == 2:
        return promote_types(higher, lower)
    return higher


def _tier(x: Any) -> tuple[int, np.dtype] | None:
    dt = getattr(x, "dtype", None)
    if dt is not None:
        return (_DIM if x.ndim else _ZERO), dt
    if isinstance(x, bool):  # before int: bool subclasses int
        return _WRAPPED, _BOOL
    if isinstance(x, int):
        return _WRAPPED, _I64
    if isinstance(x, float):
        return _WRAPPED, default_float()
    if isinstance(x, complex):
        return _WRAPPED, dtypes.default_complex().np
    return None  # an absent operand (clamp's min=None)


def result_dtype(*operands: Any) -> np.dtype:
    """torch.result_type over arrays (0-d or not), Python numbers and Nones (skipped)."""
    tiers: list[np.dtype | None] = [None, None, None]
    for x in operands:
        found = _tier(x)
        if found is None:
            continue
        tier, dt = found
        seen = tiers[tier]
        tiers[tier] = dt if seen is None else promote_types(seen, dt)
    out = _combine(tiers[_DIM], _combine(tiers[_ZERO], tiers[_WRAPPED]))
    if out is None:
        raise TypeError("type promotion: no operand has a dtype (every operand is None).")
    return out


def promote(*operands: Any) -> tuple:
    """(result dtype, *operands) with every array operand cast to the result dtype.

    Python scalars and Nones pass unchanged. The common cases (same-dtype arrays, a floating
    array with a Python number) return at once: these ops run on every training step.
    """
    if len(operands) == 2:
        a, b = operands
        if a.__class__ is _ndarray:
            da = a.dtype
            if b.__class__ is _ndarray:
                if b.dtype == da:
                    return da, a, b
            elif (b.__class__ is float or b.__class__ is int) and da.kind == "f":
                return da, a, b
    dt = result_dtype(*operands)
    return (dt,) + tuple(
        x.astype(dt) if getattr(x, "dtype", dt) != dt else x for x in operands
    )


def as_dtype(a: Any, dt: np.dtype) -> Any:
    """`a` in dtype `dt` (itself when it already is): an output or a gradient put back in its
    operand's dtype (a gradient has its input's dtype)."""
    return a if a.dtype == dt else a.astype(dt)


def norm_output_dtype(input_dtype: np.dtype, *params: Any) -> np.dtype:
    """The output dtype of a normalisation (batch_norm, layer_norm) with these parameters.

    torch's mixed-dtype rule: a bfloat16 or float16 input with float32 weight, bias or running
    statistics keeps the input's dtype (the usual mixed-precision setup: float32 parameters,
    half-precision activations). Other mixes (torch refuses them) promote as arithmetic does.
    """
    # Parameters come as Tensors or arrays; compare numpy dtypes (a Tensor's is core's DType).
    dts = [np.dtype(getattr(p, "array", p).dtype) for p in params if p is not None]
    if is_reduced_float(input_dtype) and all(d == _F32 or d == input_dtype for d in dts):
        return input_dtype
    out = input_dtype
    for d in dts:
        out = promote_types(out, d)
    return out


def floating(arr: Any) -> Any:
    """An integer or bool array as the default floating dtype (what torch's floating unary ops,
    exp, sqrt, sin, ..., give for such input); a floating or complex one as it is."""
    return arr.astype(default_float()) if arr.dtype.kind in "iub" else arr
