"""torch.testing.assert_close: tolerances by dtype and torch's mismatch message."""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.core import dtypes
from shoal.core.tensor import Tensor

# torch's default (rtol, atol) per dtype; integers and bool compare exactly.
_TOLERANCES = {
    dtypes.float16: (1e-3, 1e-5), dtypes.bfloat16: (1.6e-2, 1e-5),
    dtypes.float32: (1.3e-6, 1e-5), dtypes.float64: (1e-7, 1e-7),
    dtypes.complex64: (1.3e-6, 1e-5), dtypes.complex128: (1e-7, 1e-7),  # their parts' dtypes
}


def _as_array(x: Any) -> tuple[np.ndarray, Any]:
    if isinstance(x, Tensor):
        return x.numpy(force=True), x.dtype
    arr = np.asarray(x)
    return arr, None


def assert_close(
    actual: Any, expected: Any, *, rtol: float | None = None, atol: float | None = None,
    equal_nan: bool = False, check_dtype: bool = True, msg: str | None = None,
) -> None:
    """Raise AssertionError unless |actual - expected| <= atol + rtol * |expected| everywhere."""
    if (rtol is None) != (atol is None):
        raise ValueError(
            f"Both 'rtol' and 'atol' must be either specified or omitted, but got no {'rtol' if rtol is None else 'atol'}."
        )
    if isinstance(actual, (list, tuple)) and isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            raise AssertionError(f"The length of the sequences mismatch: {len(actual)} != {len(expected)}")
        for a, e in zip(actual, expected):
            assert_close(a, e, rtol=rtol, atol=atol, equal_nan=equal_nan, check_dtype=check_dtype, msg=msg)
        return
    a, a_dt = _as_array(actual)
    e, e_dt = _as_array(expected)
    if a.shape != e.shape:
        raise AssertionError(msg or f"The values for attribute 'shape' do not match: {a.shape} != {e.shape}.")
    if check_dtype and a_dt is not None and e_dt is not None and a_dt != e_dt:
        raise AssertionError(msg or f"The values for attribute 'dtype' do not match: {a_dt} != {e_dt}.")
    if rtol is None:
        rtol, atol = _TOLERANCES.get(a_dt or e_dt, (0.0, 0.0)) if a.dtype.kind in "fVc" or e.dtype.kind in "fVc" else (0.0, 0.0)
    _compare(a, e, rtol, atol, equal_nan, msg)


def _compare(a: np.ndarray, e: np.ndarray, rtol: float, atol: float, equal_nan: bool, msg: str | None) -> None:
    # Complex values compare as complex (|a - e| is the distance in the plane), as in torch.
    wide = np.complex128 if a.dtype.kind == "c" or e.dtype.kind == "c" else np.float64
    a64, e64 = a.astype(wide), e.astype(wide)
    ok = np.isclose(a64, e64, rtol=rtol, atol=atol, equal_nan=equal_nan)
    if ok.all():
        return
    if msg is not None:
        raise AssertionError(msg)
    total, bad = ok.size, int((~ok).sum())
    with np.errstate(divide="ignore", invalid="ignore"):
        diff = np.abs(a64 - e64)
        rel = diff / np.abs(e64)
    exact = rtol == 0 and atol == 0
    word = "equal" if exact else "close"
    if exact and a.dtype.kind in "iub":  # torch prints integer differences as integers
        diff = np.abs(a.astype(np.int64) - e.astype(np.int64))
    abs_up, rel_up = ("", "") if exact else (f" (up to {atol} allowed)", f" (up to {rtol} allowed)")
    if a.size == 1:
        raise AssertionError(
            f"Scalars are not {word}!\n\nExpected {e.item()} but got {a.item()}.\n"
            f"Absolute difference: {diff.item()}{abs_up}\n"
            f"Relative difference: {rel.item()}{rel_up}"
        )
    abs_at = np.unravel_index(int(np.nanargmax(np.where(ok, -1, diff))), a.shape)
    rel_at = np.unravel_index(int(np.nanargmax(np.where(ok, -1, rel))), a.shape)
    raise AssertionError(
        f"Tensor-likes are not {word}!\n\n"
        f"Mismatched elements: {bad} / {total} ({100.0 * bad / total:.1f}%)\n"
        f"Greatest absolute difference: {diff[abs_at]} at index {tuple(int(i) for i in abs_at)} {abs_up}\n"
        f"Greatest relative difference: {rel[rel_at]} at index {tuple(int(i) for i in rel_at)} {rel_up}"
    )
