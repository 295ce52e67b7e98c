"""torch.nn.functional's multi-class margin losses: multi_margin_loss, multilabel_margin_loss
and multilabel_soft_margin_loss (their modules are in loss_margin_modules.py).

Each composes core's differentiable ops with aten's formula, so gradients are those ops'. The
targets (class indices) only select and mask: they are read as arrays, never differentiated.
The hinge is relu, whose gradient at 0 is 0, as aten's `z > 0` test.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.core.nn.activations_functional import logsigmoid
from shoal.core.nn._reduction import reduction_of
from shoal.core.nn.losses_more import _REDUCTIONS, _reduce
from shoal.core.ops import arith, unary
from shoal.core.ops import reduce as _red
from shoal.core.ops._autocast import autocast_op
from shoal.core.ops._util import xp_of
from shoal.core.ops.indexing import gather
from shoal.core.tensor import Tensor, wrap

__all__ = ["multi_margin_loss", "multilabel_margin_loss", "multilabel_soft_margin_loss"]

def _indices(target: Any, like: Any) -> Any:
    """The target's class indices as an int64 array on the input's device."""
    arr = target.array if isinstance(target, Tensor) else target
    return xp_of(like).asarray(arr).astype(np.int64)


def _as_matrix(input: Tensor, op: str) -> Tensor:  # noqa: A002
    if input.ndim > 2 or (input.ndim == 2 and input.shape[1] == 0) or (
            input.ndim < 2 and input.numel() == 0):
        raise RuntimeError(f"{op}: expected a non-empty vector or matrix with optional 0-dim "
                           f"batch size, but got: {list(input.shape)}")
    return input.reshape(1, -1) if input.ndim < 2 else input


@autocast_op("multi_margin_loss")
def multi_margin_loss(input: Tensor, target: Any, p: int = 1, margin: float = 1.0,  # noqa: A002
                      weight: Any = None, size_average: Any = None, reduce: Any = None,
                      reduction: str = "mean") -> Tensor:
    """sum over j != y of max(0, margin - x[y] + x[j])^p (times weight[y]), over the C classes."""
    reduction = reduction_of(size_average, reduce, reduction)
    if p not in (1, 2):
        raise ValueError("only p == 1 and p == 2 supported")
    x = _as_matrix(input, "multi_margin_loss")
    n, c = x.shape
    y = _indices(target, x.array).reshape(-1)
    if y.shape[0] != n or (input.ndim < 2 and _indices(target, x.array).ndim > 1):
        raise RuntimeError(
            f"multi_margin_loss: target tensor should be 1-D with size equal to the number of "
            f"input samples (batch size). Expected target size [{n}], but got "
            f"{list(np.shape(_indices(target, x.array)))}. Input has shape {list(input.shape)}.")
    if y.size and (int(y.min()) < 0 or int(y.max()) >= c):
        raise RuntimeError("target out of range")
    xp = xp_of(x.array)
    z = arith.add(arith.rsub(gather(x, 1, y[:, None]), margin), x)  # margin - x[y] + x[j]
    h = unary.relu(z)
    if p == 2:
        h = arith.mul(h, h)
    others = (xp.arange(c)[None, :] != y[:, None]).astype(x.array.dtype)
    if weight is not None:
        w = weight.array if isinstance(weight, Tensor) else xp.asarray(weight)
        if w.ndim != 1 or w.shape[0] != c:
            raise RuntimeError(f"inconsistent weight size, expected {c} but got "
                               f"{list(w.shape)}")
        others = others * w[y][:, None].astype(others.dtype)
    loss = arith.div(_red.sum(arith.mul(h, wrap(others)), 1), c)
    if _indices(target, x.array).ndim == 0:  # aten: one loss per target entry, 0-d for a 0-d one
        loss = loss.reshape(())
    return _reduce(loss, reduction)


@autocast_op("multilabel_margin_loss")
def multilabel_margin_loss(input: Tensor, target: Any, size_average: Any = None,  # noqa: A002
                           reduce: Any = None, reduction: str = "mean") -> Tensor:
    """sum over target classes j (up to the first -1) and non-target classes i of
    max(0, 1 - (x[j] - x[i])), over the C classes."""
    reduction = reduction_of(size_average, reduce, reduction)
    x = _as_matrix(input, "multilabel_margin_loss")
    n, c = x.shape
    raw = _indices(target, x.array)
    if tuple(raw.shape) != tuple(input.shape):
        raise RuntimeError(f"inconsistent target size: {list(raw.shape)} for input of size: "
                           f"{list(input.shape)}")
    y = raw.reshape(n, c)
    xp = xp_of(x.array)
    # a slot counts while no -1 came before it in its row; the rest of the row is ignored
    valid = xp.cumsum(y < 0, axis=1) == 0
    if bool(((y >= c) & valid).any()) or bool(((y < -1) & valid).any()):
        raise RuntimeError("argument #2 'target' is out of range")
    slots = xp.where(valid, y, 0)
    is_target = xp.zeros((n, c), dtype=bool)
    rows = xp.broadcast_to(xp.arange(n)[:, None], (n, c))
    is_target[rows[valid], slots[valid]] = True
    # only the longest row's target slots: the pair tensor is (n, slots, c), not (n, c, c)
    width = max(int(valid.sum(1).max()) if n else 0, 1)
    slots, valid = slots[:, :width], valid[:, :width]
    picked = gather(x, 1, slots)  # x[j] for each slot j: (n, width)
    z = arith.add(arith.rsub(picked.reshape(n, width, 1), 1.0), x.reshape(n, 1, c))
    pairs = (valid[:, :, None] & ~is_target[:, None, :]).astype(x.array.dtype)
    loss = arith.div(_red.sum(arith.mul(unary.relu(z), wrap(pairs)), (1, 2)), c)
    if input.ndim < 2:
        loss = loss.reshape(())
    return _reduce(loss, reduction)


def multilabel_soft_margin_loss(input: Tensor, target: Any, weight: Any = None,  # noqa: A002
                                size_average: Any = None, reduce: Any = None,
                                reduction: str = "mean") -> Tensor:
    """-(y log sigmoid(x) + (1 - y) log sigmoid(-x)), weighted, averaged over the classes."""
    reduction = reduction_of(size_average, reduce, reduction)
    loss = arith.neg(arith.add(arith.mul(target, logsigmoid(input)),
                               arith.mul(arith.rsub(target, 1.0), logsigmoid(arith.neg(input)))))
    if weight is not None:
        loss = arith.mul(loss, weight)
    class_dim = input.ndim - 1
    loss = arith.div(_red.sum(loss, class_dim), input.shape[class_dim])
    if reduction not in _REDUCTIONS:  # torch's wording for this composite loss
        raise ValueError(f"{reduction} is not valid")
    return _reduce(loss, reduction)
