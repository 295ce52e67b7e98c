"""torch.nn.functional's losses and normalisations that core lacked: binary_cross_entropy (and
with logits), kl_div, huber_loss, soft_margin_loss, margin_ranking_loss, hinge_embedding_loss,
cosine_embedding_loss, gaussian_nll_loss, poisson_nll_loss, triplet_margin_loss, group_norm,
instance_norm, rms_norm and local_response_norm.

Each composes core's differentiable ops with torch's formula (torch's clamps included: BCE's
log clamped at -100, Gaussian NLL's variance at eps), so gradients are those ops'.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from shoal.core.ops import arith, reduce, shape, unary
from shoal.core.nn._reduction import reduction_of
from shoal.core.ops._autocast import autocast_op
from shoal.core.ops import binary_table as _binary
from shoal.core.tensor import Tensor
from shoal.core.nn.activations_functional import _p_norm, cosine_similarity, pad

_REDUCTIONS = ("mean", "sum", "none")


def _reduce(loss: Tensor, reduction: str) -> Tensor:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    if reduction == "none":
        return loss
    return reduce.sum(loss) if reduction == "sum" else reduce.mean(loss)


def _same_size(name: str, input: Tensor, target: Tensor) -> None:  # noqa: A002
    if tuple(input.shape) != tuple(target.shape):
        raise ValueError(f"Using a target size ({list(target.shape)}) that is different to the "
                         f"input size ({list(input.shape)}) is deprecated. Please ensure they "
                         f"have the same size.")


@autocast_op("binary_cross_entropy")
def binary_cross_entropy(input: Tensor, target: Tensor, weight: Any = None,  # noqa: A002
                         size_average: Any = None, reduce: Any = None,
                         reduction: str = "mean") -> Tensor:
    """-(t log p + (1 - t) log(1 - p)), each log clamped at -100 as torch does."""
    reduction = reduction_of(size_average, reduce, reduction)
    _same_size("binary_cross_entropy", input, target)
    if ((input.array < 0) | (input.array > 1)).any():
        raise RuntimeError("all elements of input should be between 0 and 1")
    log_p = unary.clamp(unary.log(input), -100.0, None)
    log_q = unary.clamp(_log1m(input), -100.0, None)
    loss = arith.neg(arith.add(arith.mul(target, log_p),
                               arith.mul(arith.rsub(target, 1.0), log_q)))
    if weight is not None:
        loss = arith.mul(loss, weight)
    return _reduce(loss, reduction)


def _log1m(x: Tensor) -> Tensor:
    from shoal.core.ops.unary_table import OPS  # noqa: PLC0415 - a table, imported once

    return OPS["log1p"](arith.neg(x))


def binary_cross_entropy_with_logits(input: Tensor, target: Tensor, weight: Any = None,  # noqa: A002
                                     size_average: Any = None, reduce: Any = None,
                                     reduction: str = "mean", pos_weight: Any = None) -> Tensor:
    """BCE of sigmoid(x), in the stable form (1 - t) x + (1 + (w - 1) t) softplus(-x)."""
    reduction = reduction_of(size_average, reduce, reduction)
    _same_size("binary_cross_entropy_with_logits", input, target)
    return bce_with_logits_broadcast(input, target, weight, reduction, pos_weight)


@autocast_op("binary_cross_entropy_with_logits")
def bce_with_logits_broadcast(input: Tensor, target: Tensor, weight: Any, reduction: str,  # noqa: A002
                              pos_weight: Any) -> Tensor:
    """binary_cross_entropy_with_logits without the functional form's equal-size check: aten's
    top-level op broadcasts input and target (a mismatch is the broadcast's RuntimeError)."""
    softplus_neg = _binary.OPS["logaddexp"](arith.neg(input), 0.0)  # log(1 + exp(-x))
    scale = 1.0 if pos_weight is None else arith.add(
        arith.mul(arith.sub(pos_weight, 1.0), target), 1.0)
    loss = arith.add(arith.mul(arith.rsub(target, 1.0), input), arith.mul(scale, softplus_neg))
    if weight is not None:
        loss = arith.mul(loss, weight)
    return _reduce(loss, reduction)


@autocast_op("kl_div")
def kl_div(input: Tensor, target: Tensor, size_average: Any = None, reduce: Any = None,  # noqa: A002
           reduction: str = "mean", log_target: bool = False) -> Tensor:
    """target * (log target - input) with input in log space (target too when log_target)."""
    reduction = reduction_of(size_average, reduce, reduction)
    if log_target:
        loss = arith.mul(unary.exp(target), arith.sub(target, input))
    else:
        xlogy = _binary_xlogy(target)
        loss = arith.sub(xlogy, arith.mul(target, input))
    if reduction == "batchmean":
        return arith.div(_reduce(loss, "sum"), input.shape[0] if input.ndim else 1)
    return _reduce(loss, reduction)


def _binary_xlogy(t: Tensor) -> Tensor:
    """t * log(t), 0 where t == 0 (torch's xlogy)."""
    safe = shape.where(t > 0, t, arith.add(arith.mul(t, 0.0), 1.0))
    return shape.where(t > 0, arith.mul(t, unary.log(safe)), arith.mul(t, 0.0))


@autocast_op("huber_loss")
def huber_loss(input: Tensor, target: Tensor, reduction: str = "mean", delta: float = 1.0,  # noqa: A002
               weight: Any = None) -> Tensor:
    """0.5 d^2 where |d| < delta, delta (|d| - 0.5 delta) elsewhere; d = input - target."""
    d = arith.sub(input, target)
    ad = unary.abs(d)
    loss = shape.where(ad < delta, arith.mul(arith.mul(d, d), 0.5),
                       arith.mul(arith.sub(ad, 0.5 * delta), delta))
    if weight is not None:
        loss = arith.mul(loss, weight)
    return _reduce(loss, reduction)


@autocast_op("soft_margin_loss")
def soft_margin_loss(input: Tensor, target: Tensor, size_average: Any = None,  # noqa: A002
                     reduce: Any = None, reduction: str = "mean") -> Tensor:
    """log(1 + exp(-y x))."""
    reduction = reduction_of(size_average, reduce, reduction)
    return _reduce(_binary.OPS["logaddexp"](arith.neg(arith.mul(target, input)), 0.0), reduction)


@autocast_op("margin_ranking_loss")
def margin_ranking_loss(input1: Tensor, input2: Tensor, target: Tensor, margin: float = 0.0,
                        size_average: Any = None, reduce: Any = None,
                        reduction: str = "mean") -> Tensor:
    """max(0, -y (x1 - x2) + margin)."""
    reduction = reduction_of(size_average, reduce, reduction)
    raw = arith.add(arith.neg(arith.mul(target, arith.sub(input1, input2))), margin)
    return _reduce(unary.clamp(raw, 0.0, None), reduction)


@autocast_op("hinge_embedding_loss")
def hinge_embedding_loss(input: Tensor, target: Tensor, margin: float = 1.0,  # noqa: A002
                         size_average: Any = None, reduce: Any = None,
                         reduction: str = "mean") -> Tensor:
    """x where y == 1, max(0, margin - x) where y == -1."""
    reduction = reduction_of(size_average, reduce, reduction)
    neg = unary.clamp(arith.rsub(input, margin), 0.0, None)
    zero = arith.mul(input, 0.0)
    loss = arith.add(shape.where(target == 1, input, zero),
                     shape.where(target == -1, neg, zero))
    return _reduce(loss, reduction)


@autocast_op("cosine_embedding_loss")
def cosine_embedding_loss(input1: Tensor, input2: Tensor, target: Tensor, margin: float = 0.0,
                          size_average: Any = None, reduce: Any = None,
                          reduction: str = "mean") -> Tensor:
    """1 - cos where y == 1, max(0, cos - margin) where y == -1."""
    reduction = reduction_of(size_average, reduce, reduction)
    cos = cosine_similarity(input1, input2, dim=-1, eps=1e-12)
    zero = arith.mul(cos, 0.0)
    loss = arith.add(shape.where(target == 1, arith.rsub(cos, 1.0), zero),
                     shape.where(target == -1, unary.clamp(arith.sub(cos, margin), 0.0, None),
                                 zero))
    return _reduce(loss, reduction)


def gaussian_nll_loss(input: Tensor, target: Tensor, var: Any, full: bool = False,  # noqa: A002
                      eps: float = 1e-6, reduction: str = "mean") -> Tensor:
    """0.5 (log max(var, eps) + (input - target)^2 / max(var, eps)) (+ 0.5 log 2 pi if full)."""
    v = var if isinstance(var, Tensor) else arith.add(arith.mul(input, 0.0), float(var))
    if isinstance(var, Tensor) and (var.array < 0).any():
        raise ValueError("var has negative entry/entries")
    v = _clamp_keep_grad(v, eps)
    d = arith.sub(input, target)
    loss = arith.mul(arith.add(unary.log(v), arith.div(arith.mul(d, d), v)), 0.5)
    if full:
        loss = arith.add(loss, 0.9189385332046727)  # 0.5 * log(2 pi)
    return _reduce(loss, reduction)


def _clamp_keep_grad(v: Tensor, eps: float) -> Tensor:
    """torch clamps var at eps without letting the clamp cut var's gradient (it clamps a
    no-grad copy in place)."""
    return arith.add(v, arith.sub(unary.clamp(v.detach(), eps, None), v.detach()))


@autocast_op("poisson_nll_loss")
def poisson_nll_loss(input: Tensor, target: Tensor, log_input: bool = True, full: bool = False,  # noqa: A002
                     size_average: Any = None, eps: float = 1e-8, reduce: Any = None,
                     reduction: str = "mean") -> Tensor:
    """exp(x) - t x (log_input) or x - t log(x + eps), plus Stirling's term when full."""
    reduction = reduction_of(size_average, reduce, reduction)
    if log_input:
        loss = arith.sub(unary.exp(input), arith.mul(target, input))
    else:
        loss = arith.sub(input, arith.mul(target, unary.log(arith.add(input, eps))))
    if full:
        t = target
        stirling = arith.add(arith.sub(arith.mul(t, unary.log(t)), t),
                             arith.mul(unary.log(arith.mul(t, 6.283185307179586)), 0.5))
        loss = arith.add(loss, shape.where(t > 1, stirling, arith.mul(t, 0.0)))
    return _reduce(loss, reduction)


@autocast_op("triplet_margin_loss")
def triplet_margin_loss(anchor: Tensor, positive: Tensor, negative: Tensor, margin: float = 1.0,
                        p: float = 2.0, eps: float = 1e-6, swap: bool = False,
                        size_average: Any = None, reduce: Any = None,
                        reduction: str = "mean") -> Tensor:
    """max(d(a, p) - d(a, n) + margin, 0) with pairwise p-norm distances."""
    reduction = reduction_of(size_average, reduce, reduction)
    def dist(x: Tensor, y: Tensor) -> Tensor:
        return _p_norm(arith.add(arith.sub(x, y), eps), p, -1, False)

    d_pos, d_neg = dist(anchor, positive), dist(anchor, negative)
    if swap:
        d_neg = shape.minimum(d_neg, dist(positive, negative))
    return _reduce(unary.clamp(arith.add(arith.sub(d_pos, d_neg), margin), 0.0, None), reduction)


def group_norm(input: Tensor, num_groups: int, weight: Any = None, bias: Any = None,  # noqa: A002
               eps: float = 1e-5) -> Tensor:
    """Normalise each group of channels of each sample, then scale and shift per channel."""
    n, c = input.shape[0], input.shape[1]
    if c % num_groups:
        raise RuntimeError(f"Expected number of channels in input to be divisible by "
                           f"num_groups, but got input of shape {list(input.shape)} and "
                           f"num_groups={num_groups}")
    x = shape.reshape(input, (n, num_groups, -1))
    mu = reduce.mean(x, -1, keepdim=True)
    d = arith.sub(x, mu)
    var = reduce.mean(arith.mul(d, d), -1, keepdim=True)
    y = shape.reshape(arith.div(d, unary.sqrt(arith.add(var, eps))), tuple(input.shape))
    return _affine(y, weight, bias)


def _affine(y: Tensor, weight: Any, bias: Any) -> Tensor:
    lead = (1, -1) + (1,) * (y.ndim - 2)
    if weight is not None:
        y = arith.mul(y, shape.reshape(weight, lead))
    if bias is not None:
        y = arith.add(y, shape.reshape(bias, lead))
    return y


def instance_norm(input: Tensor, running_mean: Any = None, running_var: Any = None,  # noqa: A002
                  weight: Any = None, bias: Any = None, use_input_stats: bool = True,
                  momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """Normalise each channel of each sample over its spatial dims."""
    if not use_input_stats or running_mean is not None:
        raise NotImplementedError("instance_norm: shoal normalises with the input's own "
                                  "statistics only (track_running_stats=False, torch's default)")
    return group_norm(input, input.shape[1], weight, bias, eps)


def rms_norm(input: Tensor, normalized_shape: Sequence[int], weight: Any = None,  # noqa: A002
             eps: float | None = None) -> Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dims, times weight."""
    dims = tuple(range(-len(tuple(normalized_shape)), 0))
    if eps is None:  # torch's default: the dtype's machine epsilon
        eps = float(np.finfo(input.array.dtype if input.array.dtype.kind == "f"
                             else np.float32).eps)
    ms = reduce.mean(arith.mul(input, input), dims, keepdim=True)
    y = arith.mul(input, arith.pow(arith.add(ms, eps), -0.5))
    return y if weight is None else arith.mul(y, weight)


def local_response_norm(input: Tensor, size: int, alpha: float = 1e-4, beta: float = 0.75,  # noqa: A002
                        k: float = 1.0) -> Tensor:
    """x / (k + alpha * mean of x^2 over `size` neighbouring channels) ** beta."""
    sq = arith.mul(input, input)
    padded = pad(sq, [0, 0] * (input.ndim - 2) + [size // 2, (size - 1) // 2])
    windows = [shape.getitem(padded, (slice(None), slice(i, i + input.shape[1])))
               for i in range(size)]
    total = windows[0]
    for w in windows[1:]:
        total = arith.add(total, w)
    denom = arith.pow(arith.add(arith.mul(total, alpha / size), k), beta)
    return arith.div(input, denom)
