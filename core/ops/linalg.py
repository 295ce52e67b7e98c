"""matmul with batching and torch's 1-D rules; its backward is two more matmuls."""

from __future__ import annotations

from typing import Any

from shoal.core.amp.autocast_mode import STATE as _AMP
from shoal.core.ops import _autocast
from shoal.core.errors import ShapeError
from shoal.core.ops._util import cj, needs_grad, result, unbroadcast, val


def matmul(x: Any, y: Any) -> Any:
    """x @ y: 1-D operands are promoted (and the added dim dropped) as in torch/numpy."""
    if _AMP.active:
        x, y = _autocast.cast("matmul", x, y)
    xd, yd = val(x), val(y)
    if xd.ndim == 0 or yd.ndim == 0:
        raise ShapeError(
            f"matmul: both operands need at least one dimension, got shapes "
            f"{tuple(xd.shape)} and {tuple(yd.shape)}."
        )
    try:
        out = xd @ yd
    except ValueError as exc:
        raise ShapeError(
            f"matmul: cannot multiply shapes {tuple(xd.shape)} and {tuple(yd.shape)} "
            f"(inner dimensions {xd.shape[-1]} and {yd.shape[-2] if yd.ndim > 1 else yd.shape[0]} "
            "differ, or the batch dimensions do not broadcast)."
        ) from exc

    def backward(g: Any) -> tuple:
        # Promote 1-D operands to matrices so one formula covers every case.
        a = xd[None, :] if xd.ndim == 1 else xd
        b = yd[:, None] if yd.ndim == 1 else yd
        if xd.ndim == 1 and yd.ndim == 1:
            g2 = g.reshape(1, 1)
        elif xd.ndim == 1:
            g2 = g[..., None, :]
        elif yd.ndim == 1:
            g2 = g[..., None]
        else:
            g2 = g
        gx = gy = None
        if needs_grad(x):
            gx = g2 @ cj(b).swapaxes(-1, -2)
            gx = unbroadcast(gx, a.shape).reshape(xd.shape)
        if needs_grad(y):
            gy = cj(a).swapaxes(-1, -2) @ g2
            gy = unbroadcast(gy, b.shape).reshape(yd.shape)
        return gx, gy

    return result(out, "MmBackward", backward, (x, y))


def rmatmul(x: Any, y: Any) -> Any:
    """y @ x (the reflected form)."""
    return matmul(y, x)
