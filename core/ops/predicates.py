"""torch's elementwise predicates and repairs (isnan, isinf, isfinite, isposinf, isneginf,
signbit, isreal, nan_to_num), and the top-level names torch keeps for functions that live in
core.special and core.linalg (erf, erfc, erfinv, lgamma, digamma, logit, xlogy, i0, sinc,
cross), forwarded on call so that `import shoal.core` does not load scipy."""

from __future__ import annotations

from typing import Any, Callable

import ml_dtypes
import numpy as np

from shoal.core.ops._util import result, wrap, xp_of
from shoal.core.tensor import Tensor


def _predicate(name: str, fn: Callable[[Any, Any], Any]) -> Callable[[Tensor], Tensor]:
    def op(input: Any) -> Tensor:  # noqa: A002 - torch's argument name
        if not isinstance(input, Tensor):
            raise TypeError(f"{name}(): argument 'input' (position 1) must be Tensor, not "
                            f"{type(input).__name__}")
        xd = input.array
        xp = xp_of(xd)
        if xd.dtype.kind not in "fcV":  # integers and bools are always finite, never NaN
            return wrap(xp.full(xd.shape, name in ("isfinite", "isreal"), dtype=bool))
        return wrap(xp.asarray(fn(xp, xd.astype(np.float32) if xd.dtype.kind == "V" else xd)))

    op.__name__ = name
    op.__doc__ = f"torch.{name}: a bool tensor, no gradient."
    return op


def _signbit(input: Any) -> Tensor:  # noqa: A002 - torch's argument name
    """torch.signbit: whether the sign bit is set (x < 0 for integers; -0.0 and -NaN count)."""
    if not isinstance(input, Tensor):
        raise TypeError(f"signbit(): argument 'input' (position 1) must be Tensor, not "
                        f"{type(input).__name__}")
    xd = input.array
    xp = xp_of(xd)
    if xd.dtype.kind in "biu":
        return wrap(xp.asarray(xd < 0) if xd.dtype.kind == "i" else xp.zeros(xd.shape, bool))
    if xd.dtype.kind == "V":  # bfloat16: read the bit itself (a NaN's sign survives no cast)
        return wrap((xd.view(np.uint16) & np.uint16(0x8000)) != 0)
    return wrap(xp.asarray(xp.signbit(xd)))


isnan = _predicate("isnan", lambda xp, x: xp.isnan(x))
isinf = _predicate("isinf", lambda xp, x: xp.isinf(x))
isfinite = _predicate("isfinite", lambda xp, x: xp.isfinite(x))
isposinf = _predicate("isposinf", lambda xp, x: xp.isposinf(x))
isneginf = _predicate("isneginf", lambda xp, x: xp.isneginf(x))
signbit = _signbit
isreal = _predicate("isreal", lambda xp, x: xp.imag(x) == 0 if x.dtype.kind == "c"
                    else xp.ones(x.shape, bool))


def nan_to_num(input: Tensor, nan: float = 0.0, posinf: float | None = None,  # noqa: A002
               neginf: float | None = None) -> Tensor:
    """NaN, +inf and -inf replaced (by 0 and the dtype's largest and smallest finite values)."""
    xd = input.array
    xp = xp_of(xd)
    if xd.dtype.kind not in "fV":
        return wrap(xd.copy())
    wide = xd.astype(np.float32) if xd.dtype.kind == "V" else xd
    info = np.finfo(np.float32 if xd.dtype.kind == "V" else xd.dtype)
    if xd.dtype.kind == "V":  # bfloat16's own range, not float32's
        info = ml_dtypes.finfo(xd.dtype)
    out = xp.nan_to_num(wide, nan=nan, posinf=float(info.max) if posinf is None else posinf,
                        neginf=float(info.min) if neginf is None else neginf).astype(xd.dtype)
    finite = xp.isfinite(wide)
    return result(out, "NanToNumBackward", lambda g: (g * finite,), (input,))


def _forward_to(module: str, name: str) -> Callable:
    def op(*args: Any, **kwargs: Any) -> Any:
        import importlib  # noqa: PLC0415 - loads scipy only when the function is called

        return getattr(importlib.import_module(f"shoal.core.{module}"), name)(*args, **kwargs)

    op.__name__ = name
    op.__doc__ = f"torch.{name}: core.{module}.{name}."
    return op


FORWARDED = {name: _forward_to("special", target) for name, target in (
    ("erf", "erf"), ("erfc", "erfc"), ("erfinv", "erfinv"), ("lgamma", "gammaln"),
    ("digamma", "digamma"), ("polygamma", "polygamma"), ("logit", "logit"), ("xlogy", "xlogy"),
    ("i0", "i0"), ("sinc", "sinc"),
)}


def cross(input: Tensor, other: Tensor, dim: int | None = None) -> Tensor:  # noqa: A002
    """The cross product along dim (torch's default: the first dim of size 3)."""
    from shoal.core import linalg  # noqa: PLC0415 - linalg loads scipy; only when called

    if dim is None:
        sizes = np.broadcast_shapes(tuple(input.shape), tuple(other.shape))
        dim = next((i for i, n in enumerate(sizes) if n == 3), None)
        if dim is None:
            raise RuntimeError("no dimension of size 3 in input")
    return linalg.cross(input, other, dim=dim)


