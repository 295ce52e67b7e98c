"""nn.utils: clip_grad_norm_ and clip_grad_value_, as torch.nn.utils."""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np

from shoal.core.ops._util import xp_of
from shoal.core.tensor import Tensor, wrap


def _grads(parameters: Any) -> list:
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    return [p.grad for p in parameters if p.grad is not None]


def clip_grad_norm_(
    parameters: Iterable[Tensor] | Tensor, max_norm: float, norm_type: float = 2.0,
    error_if_nonfinite: bool = False, foreach: Any = None,
) -> Tensor:
    """Scale gradients in place so their joint norm is at most max_norm; return the norm before."""
    grads = _grads(parameters)
    norm_type = float(norm_type)
    if not grads:
        return wrap(np.asarray(0.0, dtype=np.float32))
    xp = xp_of(grads[0].array)
    if math.isinf(norm_type):
        norms = [xp.abs(g.array).max() for g in grads]
        total = xp.max(xp.stack([xp.asarray(n, dtype=xp.float64) for n in norms]))
    else:
        acc = 0.0
        for g in grads:
            gd = (g.array.astype(xp.float64) if g.array.dtype.itemsize < 4 else g.array).ravel()
            acc += float(xp.vdot(gd, gd)) if norm_type == 2.0 else float((xp.abs(gd) ** norm_type).sum())
        total = acc ** (1.0 / norm_type)
    total_f = float(total)
    if error_if_nonfinite and not math.isfinite(total_f):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
            "by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    coef = float(max_norm) / (total_f + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.array *= g.array.dtype.type(coef)
    return wrap(xp.asarray(total_f, dtype=grads[0].array.dtype))


def clip_grad_value_(parameters: Iterable[Tensor] | Tensor, clip_value: float) -> None:
    """Clamp every gradient element into [-clip_value, clip_value] in place."""
    for g in _grads(parameters):
        xp_of(g.array).clip(g.array, -clip_value, clip_value, out=g.array)
