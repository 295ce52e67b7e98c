"""torch.special: SciPy-style special functions on scipy.special (cpu) or cupyx.scipy.special.

Each function computes in its input's floating dtype (integers and bools in float32, as torch
promotes them; float16 and bfloat16 in float32, rounded once at the end, torch's "opmath") and
records its derivative beside it, written with the same special functions (d erf = 2/sqrt(pi)
exp(-x^2), d i0 = i1, d digamma = polygamma(1, .), ...). Complex inputs are refused as torch's
CPU kernels refuse them.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import scipy.special as _scipy_special

from shoal.core.ops import reduce as _reduce
from shoal.core.ops._opmath import narrow, widen
from shoal.core.ops._promote import category, promote
from shoal.core.ops._util import broadcast_error, needs_grad, result, unbroadcast, val, xp_of
from shoal.core.ops.complex import _scalar_name
from shoal.core.ops.unary import sigmoid as _sigmoid
from shoal.core.tensor import Tensor, wrap

__all__ = [
    "erf", "erfc", "erfcx", "erfinv", "expit", "logit", "xlogy", "xlog1py", "i0", "i0e", "i1",
    "i1e", "gammaln", "digamma", "psi", "polygamma", "multigammaln", "ndtr", "ndtri",
    "log_ndtr", "sinc", "entr", "expm1", "exp2", "log1p", "logsumexp", "softmax", "log_softmax",
    "bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1", "modified_bessel_i0", "modified_bessel_i1",
    "modified_bessel_k0", "modified_bessel_k1", "scaled_modified_bessel_k0",
    "scaled_modified_bessel_k1", "spherical_bessel_j0", "airy_ai", "round", "gammainc",
    "gammaincc", "zeta",
]

_F32 = np.dtype(np.float32)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
_SQRT_PI_OVER_2 = math.sqrt(math.pi) / 2.0
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2PI = math.sqrt(2.0 * math.pi)
# torch's CPU kernels that have no float16/bfloat16 loop.
_NO_HALF = frozenset(("erfcx", "ndtri", "log_ndtr"))


def _sp(arr: Any) -> Any:
    """scipy.special for numpy arrays, cupyx.scipy.special for cupy ones."""
    if isinstance(arr, np.ndarray):
        return _scipy_special
    import cupyx.scipy.special  # noqa: PLC0415 - cuda only

    return cupyx.scipy.special


def _float_input(x: Tensor, op: str) -> tuple:
    """(the array to compute on, the output dtype): torch's promotion for a special function."""
    if not isinstance(x, Tensor):
        raise TypeError(f"special.{op}(): argument 'input' must be Tensor, not "
                        f"{type(x).__name__}")
    xd = x.array
    dt = xd.dtype
    if dt.kind == "c":
        raise RuntimeError(f'"{op}_cpu" not implemented for \'{_scalar_name(dt)}\'')
    if category(dt) < 2:
        return xd.astype(_F32), _F32
    if dt.itemsize == 2 and op in _NO_HALF:
        raise RuntimeError(f'"{op}_cpu" not implemented for \'{_scalar_name(dt)}\'')
    return widen(xd), dt


def _unary(op: str, forward: Callable, derivative: Callable) -> Callable:
    """A special function of one tensor: forward(sp, x) and derivative(sp, x, out) on arrays
    (`sp` is scipy.special or cupyx.scipy.special, `x` in float32 or float64)."""

    def fn(input: Tensor) -> Tensor:  # noqa: A002 - torch's name
        work, dt = _float_input(input, op)
        sp = _sp(work)
        with np.errstate(all="ignore"):  # poles and logs of 0 give torch's inf/nan quietly
            out_w = forward(sp, work)
        out = narrow(out_w.astype(work.dtype, copy=False), dt)

        def backward(g: Any) -> tuple:
            with np.errstate(all="ignore"):
                gi = widen(g) * derivative(sp, work, out_w)
            return (gi.astype(input.array.dtype, copy=False),)

        name = "Special" + op.title().replace("_", "") + "Backward"
        return result(out, name, backward, (input,), exact_dtype=True)

    fn.__name__ = fn.__qualname__ = op
    return fn


_xp = xp_of  # numpy or cupy, whichever holds the array


erf = _unary("erf", lambda sp, x: sp.erf(x),
             lambda sp, x, y: _TWO_OVER_SQRT_PI * _xp(x).exp(-x * x))
erf.__doc__ = "The error function."
erfc = _unary("erfc", lambda sp, x: sp.erfc(x),
              lambda sp, x, y: -_TWO_OVER_SQRT_PI * _xp(x).exp(-x * x))
erfc.__doc__ = "The complementary error function, 1 - erf(x)."
erfcx = _unary("erfcx", lambda sp, x: sp.erfcx(x),
               lambda sp, x, y: 2 * x * y - _TWO_OVER_SQRT_PI)
erfcx.__doc__ = "The scaled complementary error function, exp(x^2) * erfc(x)."
erfinv = _unary("erfinv", lambda sp, x: sp.erfinv(x),
                lambda sp, x, y: _SQRT_PI_OVER_2 * _xp(x).exp(y * y))
erfinv.__doc__ = "The inverse of erf on (-1, 1)."
i0 = _unary("i0", lambda sp, x: sp.i0(x), lambda sp, x, y: sp.i1(x))
i0.__doc__ = "The modified Bessel function of the first kind, order 0."
i0e = _unary("i0e", lambda sp, x: sp.i0e(x),
             lambda sp, x, y: sp.i1e(x) - _xp(x).sign(x) * y)
i0e.__doc__ = "The exponentially scaled i0: exp(-|x|) * i0(x)."
i1 = _unary("i1", lambda sp, x: sp.i1(x),
            lambda sp, x, y: _at_zero(x, sp.i0(x) - y / _nonzero(x), 0.5))
i1.__doc__ = "The modified Bessel function of the first kind, order 1."
i1e = _unary("i1e", lambda sp, x: sp.i1e(x),
             lambda sp, x, y: _at_zero(x, sp.i0e(x) - y * (_xp(x).sign(x) + 1 / _nonzero(x)),
                                       0.5))
i1e.__doc__ = "The exponentially scaled i1: exp(-|x|) * i1(x)."
gammaln = _unary("gammaln", lambda sp, x: _xp(x).where(x == -np.inf, np.inf, sp.gammaln(x)),
                 lambda sp, x, y: sp.digamma(x))
gammaln.__doc__ = "The natural log of the absolute value of the gamma function."
digamma = _unary("digamma", lambda sp, x: sp.digamma(x),
                 lambda sp, x, y: sp.polygamma(1, x).astype(x.dtype, copy=False))
digamma.__doc__ = "The logarithmic derivative of the gamma function (psi)."
psi = digamma
ndtr = _unary("ndtr", lambda sp, x: sp.ndtr(x),
              lambda sp, x, y: _INV_SQRT_2PI * _xp(x).exp(-0.5 * x * x))
ndtr.__doc__ = "The standard normal cumulative distribution function."
ndtri = _unary("ndtri", lambda sp, x: sp.ndtri(x),
               lambda sp, x, y: _SQRT_2PI * _xp(x).exp(0.5 * y * y))
ndtri.__doc__ = "The inverse of ndtr: the standard normal quantile function."
log_ndtr = _unary("log_ndtr", lambda sp, x: sp.log_ndtr(x),
                  lambda sp, x, y: _INV_SQRT_2PI * _xp(x).exp(-0.5 * x * x - y))
log_ndtr.__doc__ = "log(ndtr(x)), accurate in the far left tail."
sinc = _unary("sinc", lambda sp, x: _xp(x).sinc(x), lambda sp, x, y: _sinc_derivative(x))
sinc.__doc__ = "The normalised sinc: sin(pi x) / (pi x), 1 at 0."
entr = _unary("entr", lambda sp, x: sp.entr(x), lambda sp, x, y: -(_xp(x).log(x) + 1))
entr.__doc__ = "-x ln(x) for x > 0, 0 at 0 and -inf below."
expm1 = _unary("expm1", lambda sp, x: _xp(x).expm1(x), lambda sp, x, y: y + 1)
expm1.__doc__ = "exp(x) - 1, accurate near 0."
exp2 = _unary("exp2", lambda sp, x: _xp(x).exp2(x), lambda sp, x, y: y * math.log(2.0))
exp2.__doc__ = "2 ** x."
log1p = _unary("log1p", lambda sp, x: _xp(x).log1p(x), lambda sp, x, y: 1 / (1 + x))
log1p.__doc__ = "log(1 + x), accurate near 0."


def _nonzero(x: Any) -> Any:
    """x with zeros replaced by ones (a divisor whose zero entries `_at_zero` overrides)."""
    return _xp(x).where(x == 0, 1, x)


def _at_zero(x: Any, value: Any, limit: float) -> Any:
    """value, with its limit at x = 0 in place."""
    return _xp(x).where(x == 0, limit, value)


def _sinc_derivative(x: Any) -> Any:
    xp = _xp(x)
    px = math.pi * x
    safe = _nonzero(px)
    return _at_zero(x, (xp.cos(px) * px - xp.sin(px)) / (safe * _nonzero(x)), 0.0)


def expit(input: Tensor) -> Tensor:  # noqa: A002 - torch's name
    """The logistic sigmoid, 1 / (1 + exp(-x)) (core.sigmoid)."""
    _float_input(input, "expit")  # torch's refusals: not a tensor, complex
    if input.array.dtype.kind in "biu":
        return _sigmoid(Tensor(input.array.astype(_F32)))
    return _sigmoid(input)


def logit(input: Tensor, eps: float | None = None) -> Tensor:  # noqa: A002 - torch's names
    """log(p / (1 - p)); with eps, p is clamped to [eps, 1 - eps] first (gradient 0 outside)."""
    work, dt = _float_input(input, "logit")
    xp = xp_of(work)
    lo, hi = (None, None) if eps is None else (eps, 1 - eps)
    p = work if eps is None else xp.clip(work, lo, hi)
    with np.errstate(all="ignore"):
        out = narrow(xp.log(p / (1 - p)).astype(work.dtype, copy=False), dt)

    def backward(g: Any) -> tuple:
        with np.errstate(all="ignore"):
            gi = widen(g) / (work * (1 - work))
        if eps is not None:
            gi = xp.where((work < lo) | (work > hi), 0, gi)
        else:  # torch's logit_backward: nan outside [0, 1]
            gi = xp.where((work < 0) | (work > 1), np.nan, gi)
        return (gi.astype(input.array.dtype, copy=False),)

    return result(out, "SpecialLogitBackward", backward, (input,), exact_dtype=True)


def _binary(op: str, dy_fn: Callable, edge: float) -> Callable:
    """x * log(y) (or log1p) with 0 where x == 0 (nan stays nan), for tensors or numbers; x's
    gradient is xlogy(g, y), 0 where x == 0 and y <= edge (torch's formula)."""

    def fn(input: Any, other: Any) -> Tensor:  # noqa: A002 - torch's names
        if not isinstance(input, Tensor) and not isinstance(other, Tensor):
            raise TypeError(f"special.{op}(): at least one of input and other must be a Tensor")
        dt, xd, yd = promote(val(input), val(other))
        if category(dt) < 2:
            dt, xd, yd = promote(_as_float(xd), _as_float(yd))
        if dt.kind == "c":
            raise RuntimeError(f'"{op}_cpu" not implemented for \'{_scalar_name(dt)}\'')
        xw, yw = widen(xd), widen(yd)
        sp = _sp(xw if hasattr(xw, "shape") else yw)
        try:
            with np.errstate(all="ignore"):
                out = getattr(sp, op)(xw, yw)
        except ValueError as exc:
            raise broadcast_error(op, xd, yd, exc) from exc
        out = narrow(out.astype(widen_dtype(dt), copy=False), dt)

        def backward(g: Any) -> tuple:
            gw = widen(g)
            gx = gy = None
            with np.errstate(all="ignore"):
                if needs_grad(input):
                    gx = getattr(sp, op)(gw, yw)
                    gx = _xp(gx).where((_xp(gx).asarray(xw) == 0) & (yw <= edge), 0, gx)
                    gx = unbroadcast(gx, input.array.shape).astype(input.array.dtype)
                if needs_grad(other):
                    gy = unbroadcast(gw * dy_fn(xw, yw), other.array.shape)
                    gy = gy.astype(other.array.dtype)
            return gx, gy

        return result(out, "Special" + op.title() + "Backward", backward, (input, other),
                      exact_dtype=True)

    fn.__name__ = fn.__qualname__ = op
    return fn


def widen_dtype(dt: np.dtype) -> np.dtype:
    """The dtype a 16-bit float computes in (float32); any other dtype itself."""
    return _F32 if dt.itemsize == 2 and dt.kind in "fV" else dt


def _as_float(d: Any) -> Any:
    if isinstance(d, (bool, int)):
        return float(d)
    return d if category(d.dtype) >= 2 else d.astype(_F32)


xlogy = _binary("xlogy", lambda x, y: x / y, 0.0)
xlogy.__doc__ = "x * log(y), 0 where x is 0 (unless y is nan)."
xlog1py = _binary("xlog1py", lambda x, y: x / (1 + y), -1.0)
xlog1py.__doc__ = "x * log1p(y), 0 where x is 0 (unless y is nan)."


def polygamma(n: int, input: Tensor) -> Tensor:  # noqa: A002 - torch's names
    """The n-th derivative of digamma (n = 0 is digamma itself)."""
    if not isinstance(n, int) or n < 0:
        raise RuntimeError(f"polygamma(n, x) does not support negative n, got {n}.")
    work, dt = _float_input(input, "polygamma")
    sp = _sp(work)
    with np.errstate(all="ignore"):
        out = narrow(sp.polygamma(n, work).astype(work.dtype, copy=False), dt)

    def backward(g: Any) -> tuple:
        with np.errstate(all="ignore"):
            gi = widen(g) * sp.polygamma(n + 1, work).astype(work.dtype, copy=False)
        return (gi.astype(input.array.dtype, copy=False),)

    return result(out, "SpecialPolygammaBackward", backward, (input,), exact_dtype=True)


def multigammaln(input: Tensor, p: int) -> Tensor:  # noqa: A002 - torch's names
    """The log of the multivariate gamma function of dimension p (defined for x > (p-1)/2;
    torch 2.13 no longer checks that, and neither does this)."""
    from shoal.core.ops import arith  # noqa: PLC0415 - composed from core's differentiable ops
    from shoal.core.ops import reduce  # noqa: PLC0415

    if p < 1:
        raise RuntimeError(f"p has to be greater than or equal to 1, got {p}")
    shifts = Tensor(xp_of(input.array).arange(p, dtype=input.array.dtype) / -2.0)
    terms = gammaln(arith.add(input.unsqueeze(-1), shifts))
    const = p * (p - 1) / 4 * math.log(math.pi)
    return arith.add(reduce.sum(terms, -1), const)


def logsumexp(input: Tensor, dim: Any, keepdim: bool = False) -> Tensor:  # noqa: A002
    """log(sum(exp(input))) over dim, computed stably (core.logsumexp)."""
    return _reduce.logsumexp(input, dim, keepdim)


def softmax(input: Tensor, dim: int, *, dtype: Any = None) -> Tensor:  # noqa: A002
    """exp(x) / sum(exp(x)) along dim, after casting to dtype when given."""
    return _reduce.softmax(input if dtype is None else input.to(dtype), dim)


def log_softmax(input: Tensor, dim: int, *, dtype: Any = None) -> Tensor:  # noqa: A002
    """x - logsumexp(x) along dim, after casting to dtype when given."""
    return _reduce.log_softmax(input if dtype is None else input.to(dtype), dim)


# -- torch.special's functions without a derivative: their results carry no graph in torch ------
def _no_derivative(op: str, forward: Callable) -> Callable:
    def fn(input: Tensor) -> Tensor:  # noqa: A002 - torch's name
        work, dt = _float_input(input, op)
        with np.errstate(all="ignore"):
            out = forward(_sp(work), work)
        return wrap(narrow(out.astype(work.dtype, copy=False), dt))

    fn.__name__ = fn.__qualname__ = op
    fn.__doc__ = f"torch.special.{op}, without a gradient (torch records none for it either)."
    return fn


bessel_j0 = _no_derivative("bessel_j0", lambda sp, x: sp.j0(x))
bessel_j1 = _no_derivative("bessel_j1", lambda sp, x: sp.j1(x))
bessel_y0 = _no_derivative("bessel_y0", lambda sp, x: sp.y0(x))
bessel_y1 = _no_derivative("bessel_y1", lambda sp, x: sp.y1(x))
modified_bessel_i0 = _no_derivative("modified_bessel_i0", lambda sp, x: sp.i0(x))
modified_bessel_i1 = _no_derivative("modified_bessel_i1", lambda sp, x: sp.i1(x))
modified_bessel_k0 = _no_derivative("modified_bessel_k0", lambda sp, x: sp.k0(x))
modified_bessel_k1 = _no_derivative("modified_bessel_k1", lambda sp, x: sp.k1(x))
scaled_modified_bessel_k0 = _no_derivative("scaled_modified_bessel_k0", lambda sp, x: sp.k0e(x))
scaled_modified_bessel_k1 = _no_derivative("scaled_modified_bessel_k1", lambda sp, x: sp.k1e(x))
spherical_bessel_j0 = _no_derivative(
    "spherical_bessel_j0", lambda sp, x: _xp(x).where(x == 0, 1.0, _xp(x).sin(x) / _nonzero(x)))
airy_ai = _no_derivative("airy_ai", lambda sp, x: sp.airy(x)[0])


def round(input: Tensor, *, decimals: int = 0) -> Tensor:  # noqa: A001,A002 - torch's names
    """Round half to even (to `decimals` places); the gradient is zero, as torch's."""
    xd = input.array
    out = xp_of(xd).round(xd, decimals)

    def backward(g: Any) -> tuple:
        return (xp_of(g).zeros_like(g),)

    return result(out, "RoundBackward", backward, (input,), exact_dtype=True)


def _second_argument_only(op: str, sp_name: str, d_other: Callable, input_name: str) -> Callable:
    """A two-argument function whose derivative torch has for `other` only (the first argument's
    raises at backward, with torch's message)."""

    def fn(input: Any, other: Any) -> Tensor:  # noqa: A002 - torch's names
        if not isinstance(input, Tensor) and not isinstance(other, Tensor):
            raise TypeError(f"special.{op}(): at least one of input and other must be a Tensor")
        dt, ad, xd = promote(val(input), val(other))
        if category(dt) < 2:
            dt, ad, xd = promote(_as_float(ad), _as_float(xd))
        aw, xw = widen(ad), widen(xd)
        sp = _sp(aw if hasattr(aw, "shape") else xw)
        try:
            with np.errstate(all="ignore"):
                out = getattr(sp, sp_name)(aw, xw)
        except ValueError as exc:
            raise broadcast_error(op, ad, xd, exc) from exc
        out = narrow(out.astype(widen_dtype(dt), copy=False), dt)

        def backward(g: Any) -> tuple:
            if needs_grad(input):
                raise RuntimeError(f"the derivative for '{input_name}' is not implemented.")
            with np.errstate(all="ignore"):
                gx = unbroadcast(widen(g) * d_other(sp, aw, xw), other.array.shape)
            return None, gx.astype(other.array.dtype)

        return result(out, "Special" + op.title() + "Backward", backward, (input, other),
                      exact_dtype=True)

    fn.__name__ = fn.__qualname__ = op
    return fn


gammainc = _second_argument_only(
    "gammainc", "gammainc", lambda sp, a, x: _xp(x).exp((a - 1) * _xp(x).log(x) - x - sp.gammaln(a)),
    "igamma: input")
gammainc.__doc__ = "The regularised lower incomplete gamma function P(input, other)."
gammaincc = _second_argument_only(
    "gammaincc", "gammaincc",
    lambda sp, a, x: -_xp(x).exp((a - 1) * _xp(x).log(x) - x - sp.gammaln(a)), "igammac: input")
gammaincc.__doc__ = "The regularised upper incomplete gamma function Q(input, other)."
zeta = _second_argument_only("zeta", "zeta", lambda sp, s, q: -s * sp.zeta(s + 1, q), "zeta")
zeta.__doc__ = "The Hurwitz zeta function zeta(input, other) (Riemann's for other = 1)."
