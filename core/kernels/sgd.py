"""Fused SGD step (weight decay, momentum, dampening, nesterov, maximize), as torch.optim.SGD.

`sgd_step` updates `param` (and the momentum buffer) in place and picks the CUDA kernel for cupy
arrays and the numpy reference otherwise. The reference works in place with `out=` and one
scratch array, because it runs on every CPU training step.
"""

from __future__ import annotations

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


def sgd_step_reference(
    param: np.ndarray,
    grad: np.ndarray,
    momentum_buffer: np.ndarray | None,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    maximize: bool = False,
    first: bool = False,
    scratch: np.ndarray | None = None,
) -> None:
    """One SGD step on numpy arrays, in place; `first` seeds the momentum buffer with d_p.

    `scratch`, when given, is an array of param's dtype with at least param.size elements.
    """
    hyper = (lr, momentum, dampening, nesterov, weight_decay, maximize, first)
    work = np.empty(param.size, param.dtype) if scratch is None else scratch.reshape(-1)
    for (p, g, b), s in blocks((param, grad, momentum_buffer), work):
        _sgd_block(p, g, b, s, *hyper)


def _sgd_block(param, grad, momentum_buffer, scratch, lr, momentum, dampening, nesterov,
               weight_decay, maximize, first) -> None:
    """sgd_step_reference on one block (the hyper-parameters as there, in signature order)."""
    scratch = scratch[: param.size].reshape(param.shape)
    # d_p = (-grad if maximize else grad) + weight_decay * param, built in scratch only if needed.
    if weight_decay != 0.0:
        np.multiply(param, weight_decay, out=scratch)
        if maximize:
            scratch -= grad
        else:
            scratch += grad
        d_p = scratch
    elif maximize:
        np.negative(grad, out=scratch)
        d_p = scratch
    else:
        d_p = grad
    if momentum != 0.0:
        buf = momentum_buffer
        if first:
            np.copyto(buf, d_p)
        else:
            buf *= momentum
            if dampening == 0.0:
                buf += d_p
            elif d_p is scratch and not nesterov:
                scratch *= 1.0 - dampening
                buf += scratch
            else:
                # Rare combination (dampening with nesterov or a plain grad): one temporary.
                buf += d_p * (1.0 - dampening)
        if nesterov:
            if d_p is scratch:
                # d_p already fills scratch: apply lr * d_p and lr * momentum * buf separately
                # rather than allocate a second array for their sum.
                scratch *= -lr
                param += scratch
                np.multiply(buf, -lr * momentum, out=scratch)
                param += scratch
                return
            np.multiply(buf, momentum, out=scratch)
            scratch += d_p
            d_p = scratch
        else:
            d_p = buf
    np.multiply(d_p, -lr, out=scratch)
    param += scratch


# d_p = (-grad if maximize else grad) + weight_decay * param, in the accumulation type.
_SGD_D_P = GRAD_PARAM_PROLOGUE + r"""if (weight_decay != 0.0) g += (A)weight_decay * p;
"""

_SGD_OPERATION = _SGD_D_P + r"""A b = first ? g : (A)momentum * (A)buf + (A)(1.0 - dampening) * g;
buf = (T)b;
g = nesterov ? g + (A)momentum * b : b;
param = (T)(p - (A)lr * g);
"""


_SGD_PLAIN_OPERATION = _SGD_D_P + r"""param = (T)(p - (A)lr * g);
"""


@cached_kernel
def _sgd_momentum_kernel():
    return cupy().ElementwiseKernel(
        "T grad, float64 lr, float64 momentum, float64 dampening, float64 weight_decay, "
        "bool nesterov, bool maximize, bool first",
        "T param, T buf",
        _SGD_OPERATION,
        "shoal_sgd_momentum_step",
        preamble=ACC_PREAMBLE,
    )


@cached_kernel
def _sgd_plain_kernel():
    return cupy().ElementwiseKernel(
        "T grad, float64 lr, float64 weight_decay, bool maximize",
        "T param",
        _SGD_PLAIN_OPERATION,
        "shoal_sgd_step",
        preamble=ACC_PREAMBLE,
    )


def sgd_step_cuda(
    param: Any,
    grad: Any,
    momentum_buffer: Any | None,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    maximize: bool = False,
    first: bool = False,
    scratch: Any | None = None,
) -> None:
    """One SGD step on cupy arrays as a single fused kernel launch."""
    del scratch  # the fused kernel keeps d_p in registers
    if momentum == 0.0:
        _sgd_plain_kernel()(grad, float(lr), float(weight_decay), bool(maximize), param)
        return
    _sgd_momentum_kernel()(
        grad, float(lr), float(momentum), float(dampening), float(weight_decay),
        bool(nesterov), bool(maximize), bool(first), param, momentum_buffer,
    )


def sgd_step(param: Any, grad: Any, momentum_buffer: Any | None, **kwargs: Any) -> None:
    """One in-place SGD step: the fused CUDA kernel for cupy arrays, the numpy reference else."""
    if is_cuda_array(param):
        sgd_step_cuda(param, grad, momentum_buffer, **kwargs)
    else:
        sgd_step_reference(param, grad, momentum_buffer, **kwargs)
