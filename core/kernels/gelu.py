"""GELU forward and backward, exact (erf) or the tanh approximation, as torch.nn.functional.gelu.

numpy has no erf; the reference uses scipy.special.erf when scipy is installed and math.erf
element by element otherwise (exact, but slow: GELU is not on shoal's CPU hot path).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shoal.core.errors import ShoalError
from shoal.core.kernels._cuda import ACC_PREAMBLE, cached_kernel, cupy, is_cuda_array

_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TANH_K = math.sqrt(2.0 / math.pi)
_TANH_C = 0.044715
APPROXIMATIONS = ("none", "tanh")


def _erf_inplace(a: np.ndarray) -> None:
    try:
        from scipy.special import erf  # noqa: PLC0415 - optional accelerator
    except ImportError:
        a[...] = np.vectorize(math.erf, otypes=[a.dtype])(a)
    else:
        if a.dtype in (np.float32, np.float64):
            erf(a, out=a)
        else:  # float16 and bfloat16 have no scipy loop: evaluate in float32, round once
            a[...] = erf(a.astype(np.float32))


def _check(approximate: str) -> None:
    if approximate not in APPROXIMATIONS:
        raise ShoalError(
            f"gelu approximate={approximate!r} is not supported; use one of {APPROXIMATIONS}."
        )


def gelu_forward_reference(x: np.ndarray, approximate: str = "none") -> np.ndarray:
    """GELU(x) on numpy arrays: x * Phi(x), or its tanh approximation."""
    _check(approximate)
    if approximate == "tanh":
        out = x * x
        out *= _TANH_C * x
        out += x
        out *= _TANH_K
        np.tanh(out, out=out)
    else:
        out = np.multiply(x, _SQRT_HALF)
        _erf_inplace(out)
    out += 1.0
    out *= x
    out *= 0.5
    return out


def gelu_backward_reference(
    x: np.ndarray, grad_out: np.ndarray, approximate: str = "none"
) -> np.ndarray:
    """grad_out * GELU'(x) on numpy arrays."""
    _check(approximate)
    if approximate == "tanh":
        x2 = x * x
        t = x2 * (_TANH_C * x)
        t += x
        t *= _TANH_K
        np.tanh(t, out=t)
        # 0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 c x^2)
        dinner = x2
        dinner *= 3.0 * _TANH_C
        dinner += 1.0
        dinner *= _TANH_K
        sech2 = 1.0 - t * t
        dinner *= sech2
        dinner *= x
        t += 1.0
        t += dinner
        t *= 0.5
        grad = t
    else:
        # Phi(x) + x * phi(x)
        cdf = np.multiply(x, _SQRT_HALF)
        _erf_inplace(cdf)
        cdf += 1.0
        cdf *= 0.5
        pdf = x * x
        pdf *= -0.5
        np.exp(pdf, out=pdf)
        pdf *= _INV_SQRT_2PI
        pdf *= x
        cdf += pdf
        grad = cdf
    grad *= grad_out
    return grad


_GELU_FORWARD = r"""
typedef Acc<T>::type A;
A v = (A)x;
#if SHOAL_GELU_TANH
A inner = (A)0.7978845608028654 * (v + (A)0.044715 * v * v * v);
y = (T)((A)0.5 * v * ((A)1 + tanh(inner)));
#else
y = (T)((A)0.5 * v * ((A)1 + erf(v * (A)0.7071067811865476)));
#endif
"""

_GELU_BACKWARD = r"""
typedef Acc<T>::type A;
A v = (A)x;
#if SHOAL_GELU_TANH
A k = (A)0.7978845608028654;
A t = tanh(k * (v + (A)0.044715 * v * v * v));
A d = (A)0.5 * ((A)1 + t)
    + (A)0.5 * v * ((A)1 - t * t) * k * ((A)1 + (A)(3 * 0.044715) * v * v);
#else
A cdf = (A)0.5 * ((A)1 + erf(v * (A)0.7071067811865476));
A pdf = exp((A)-0.5 * v * v) * (A)0.3989422804014327;
A d = cdf + v * pdf;
#endif
grad = (T)(d * (A)grad_out);
"""


@cached_kernel
def _gelu_kernels():
    cp = cupy()
    kernels = {}
    for approximate, flag in (("none", 0), ("tanh", 1)):
        preamble = f"#define SHOAL_GELU_TANH {flag}\n" + ACC_PREAMBLE
        kernels[approximate, "forward"] = cp.ElementwiseKernel(
            "T x", "T y", _GELU_FORWARD, f"shoal_gelu_forward_{approximate}", preamble=preamble
        )
        kernels[approximate, "backward"] = cp.ElementwiseKernel(
            "T x, T grad_out", "T grad", _GELU_BACKWARD, f"shoal_gelu_backward_{approximate}",
            preamble=preamble,
        )
    return kernels


def gelu_forward_cuda(x: Any, approximate: str = "none") -> Any:
    """GELU(x) on a cupy array, one fused elementwise kernel."""
    _check(approximate)
    return _gelu_kernels()[approximate, "forward"](x)


def gelu_backward_cuda(x: Any, grad_out: Any, approximate: str = "none") -> Any:
    """grad_out * GELU'(x) on cupy arrays, one fused elementwise kernel."""
    _check(approximate)
    return _gelu_kernels()[approximate, "backward"](x, grad_out)


def gelu_forward(x: Any, approximate: str = "none") -> Any:
    """GELU(x): the CUDA kernel for cupy arrays, the numpy reference otherwise."""
    if is_cuda_array(x):
        return gelu_forward_cuda(x, approximate)
    return gelu_forward_reference(x, approximate)


def gelu_backward(x: Any, grad_out: Any, approximate: str = "none") -> Any:
    """grad_out * GELU'(x): the CUDA kernel for cupy arrays, the numpy reference otherwise."""
    if is_cuda_array(x):
        return gelu_backward_cuda(x, grad_out, approximate)
    return gelu_backward_reference(x, grad_out, approximate)
