"""Fused Adam and AdamW step (L2 or decoupled weight decay, amsgrad, maximize), as torch.optim.

`adam_step` updates `param`, `exp_avg`, `exp_avg_sq` (and `max_exp_avg_sq` with amsgrad) in
place. The bias corrections depend only on the step count, so the caller computes them once per
step on the host; the kernel and the reference then do the per-element work.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shoal.core.kernels._blocks import blocks
from shoal.core.kernels._cuda import (
    ACC_PREAMBLE,
    GRAD_PARAM_PROLOGUE,
    cached_kernel,
    cupy,
    is_cuda_array,
)


def adam_step_reference(
    param: np.ndarray,
    grad: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    max_exp_avg_sq: np.ndarray | None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    decoupled: bool = False,
    maximize: bool = False,
    scratch: np.ndarray | None = None,
) -> None:
    """One Adam (decoupled=False) or AdamW (decoupled=True) step on numpy arrays, in place.

    `step` is the step count after this step (1 on the first call); `scratch`, when given, is a
    flat array of param's dtype holding at least 2 * param.size elements.
    """
    work = np.empty(2 * param.size, param.dtype) if scratch is None else scratch.reshape(-1)
    hyper = (lr, beta1, beta2, eps, weight_decay, decoupled, maximize,
             *_bias_terms(lr, beta1, beta2, step))
    arrays = (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq)
    for (p, g, m, v, vmax), s in blocks(arrays, work, factor=2):
        _adam_block(p, g, m, v, vmax, s, *hyper)


def _bias_terms(lr: float, beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """(step_size, bias_correction2_sqrt): lr / (1 - beta1**step) and sqrt(1 - beta2**step)."""
    return lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step)


def _adam_block(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, scratch, lr, beta1, beta2,
                eps, weight_decay, decoupled, maximize, step_size, bias_correction2_sqrt) -> None:
    """adam_step_reference on one block, with the bias corrections already folded in."""
    n = param.size
    tmp = scratch[:n].reshape(param.shape)
    g = grad
    if decoupled:
        if weight_decay != 0.0:
            param *= 1.0 - lr * weight_decay
    elif weight_decay != 0.0 or maximize:
        # The L2 term changes the gradient Adam sees; build it once in the second scratch half.
        g = scratch[n : 2 * n].reshape(param.shape)
        np.multiply(param, weight_decay, out=g)
        if maximize:
            g -= grad
        else:
            g += grad
        maximize = False
    if decoupled and maximize:
        g = scratch[n : 2 * n].reshape(param.shape)
        np.negative(grad, out=g)
    # exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
    exp_avg_sq *= beta2
    np.multiply(g, g, out=tmp)
    tmp *= 1.0 - beta2
    exp_avg_sq += tmp
    # exp_avg = lerp(exp_avg, g, 1 - beta1), as torch computes it
    np.subtract(g, exp_avg, out=tmp)
    tmp *= 1.0 - beta1
    exp_avg += tmp
    second = exp_avg_sq
    if max_exp_avg_sq is not None:
        np.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        second = max_exp_avg_sq
    # param -= step_size * exp_avg / (sqrt(second) / sqrt(bc2) + eps), step_size = lr / bc1
    np.sqrt(second, out=tmp)
    tmp /= bias_correction2_sqrt
    tmp += eps
    np.divide(exp_avg, tmp, out=tmp)
    tmp *= -step_size
    param += tmp


_ADAM_OPERATION = GRAD_PARAM_PROLOGUE + r"""if (decoupled) {
    p *= (A)(1.0 - lr * weight_decay);
} else if (weight_decay != 0.0) {
    g += (A)weight_decay * p;
}
A m = (A)exp_avg;
m += (g - m) * (A)(1.0 - beta1);
A v = (A)beta2 * (A)exp_avg_sq + (A)(1.0 - beta2) * g * g;
exp_avg = (T)m;
exp_avg_sq = (T)v;
A second = v;
#if SHOAL_AMSGRAD
second = max((A)max_exp_avg_sq, v);
max_exp_avg_sq = (T)second;
#endif
A denom = sqrt(second) / (A)bias_correction2_sqrt + (A)eps;
param = (T)(p - (A)step_size * m / denom);
"""

_ADAM_INPUTS = (
    "T grad, float64 lr, float64 beta1, float64 beta2, float64 eps, float64 weight_decay, "
    "float64 step_size, float64 bias_correction2_sqrt, bool decoupled, bool maximize"
)


@cached_kernel
def _adam_kernel():
    return cupy().ElementwiseKernel(
        _ADAM_INPUTS,
        "T param, T exp_avg, T exp_avg_sq",
        _ADAM_OPERATION,
        "shoal_adam_step",
        preamble="#define SHOAL_AMSGRAD 0\n" + ACC_PREAMBLE,
    )


@cached_kernel
def _adam_amsgrad_kernel():
    return cupy().ElementwiseKernel(
        _ADAM_INPUTS,
        "T param, T exp_avg, T exp_avg_sq, T max_exp_avg_sq",
        _ADAM_OPERATION,
        "shoal_adam_amsgrad_step",
        preamble="#define SHOAL_AMSGRAD 1\n" + ACC_PREAMBLE,
    )


def adam_step_cuda(
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    max_exp_avg_sq: Any | None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    decoupled: bool = False,
    maximize: bool = False,
    scratch: Any | None = None,
) -> None:
    """One Adam/AdamW step on cupy arrays as a single fused kernel launch."""
    del scratch
    scalars = (
        float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
        *_bias_terms(float(lr), beta1, beta2, step), bool(decoupled), bool(maximize),
    )
    if max_exp_avg_sq is None:
        _adam_kernel()(grad, *scalars, param, exp_avg, exp_avg_sq)
    else:
        _adam_amsgrad_kernel()(grad, *scalars, param, exp_avg, exp_avg_sq, max_exp_avg_sq)


def adam_step(
    param: Any, grad: Any, exp_avg: Any, exp_avg_sq: Any, max_exp_avg_sq: Any | None, **kwargs
) -> None:
    """One in-place Adam/AdamW step: the fused CUDA kernel for cupy arrays, numpy otherwise."""
    if is_cuda_array(param):
        adam_step_cuda(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, **kwargs)
    else:
        adam_step_reference(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, **kwargs)
