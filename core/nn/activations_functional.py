"""torch.nn.functional's activations, distances and padding that core lacked: leaky_relu, elu,
selu, celu, silu, mish, softplus, softsign, the shrinks, hardtanh, relu6, hardsigmoid,
hardswish, logsigmoid, threshold, glu, prelu, softmin, normalize, cosine_similarity,
pairwise_distance, pad, pixel_shuffle and pixel_unshuffle.

Each composes core's differentiable ops with torch's formula, so its gradient is theirs; the
branch points (x == 0 for leaky_relu, the thresholds) take torch's side (torch's derivative
at the kink is the branch `x > 0` selects).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from shoal.core.ops import arith, creation, reduce, shape, unary
from shoal.core.ops import binary_table as _binary
from shoal.core.ops import unary_table as _unary_table
from shoal.core.ops._autocast import autocast_op
from shoal.core.ops._util import wrap, xp_of
from shoal.core.tensor import Tensor

_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def _where(cond: Tensor, a: Any, b: Any) -> Tensor:
    return shape.where(cond, a, b)


def leaky_relu(input: Tensor, negative_slope: float = 0.01, inplace: bool = False) -> Tensor:  # noqa: A002
    """x where x > 0, negative_slope * x elsewhere."""
    return _where(input > 0, input, arith.mul(input, negative_slope))


def rrelu(input: Tensor, lower: float = 1.0 / 8, upper: float = 1.0 / 3,  # noqa: A002
          training: bool = False, inplace: bool = False) -> Tensor:
    """x where x > 0, else x times a slope: in training one drawn per element uniformly from
    [lower, upper] (core's generator; x == 0 draws too, as torch), in eval (lower + upper) / 2."""
    if lower > upper:
        raise RuntimeError("Lower bound should be less than or equal to the upper bound")
    if not training:
        return leaky_relu(input, (lower + upper) / 2)
    u = creation.rand(*input.shape, dtype=input.dtype, device=input.device).array
    noise = xp_of(u).where(input.array > 0, 1.0, lower + (upper - lower) * u).astype(u.dtype)
    return arith.mul(input, wrap(noise))  # the slopes are constants: d out / d x = noise


def elu(input: Tensor, alpha: float = 1.0, inplace: bool = False) -> Tensor:  # noqa: A002
    """x where x > 0, alpha * (exp(x) - 1) elsewhere."""
    neg = arith.mul(_unary_table.OPS["expm1"](_clamp_max0(input)), alpha)
    return _where(input > 0, input, neg)


def _clamp_max0(x: Tensor) -> Tensor:
    """min(x, 0): keeps exp from overflowing on the branch that is not taken."""
    return unary.clamp(x, None, 0.0)


def selu(input: Tensor, inplace: bool = False) -> Tensor:  # noqa: A002
    """scale * elu(x, alpha) with SELU's constants."""
    return arith.mul(elu(input, _SELU_ALPHA), _SELU_SCALE)


def celu(input: Tensor, alpha: float = 1.0, inplace: bool = False) -> Tensor:  # noqa: A002
    """max(0, x) + min(0, alpha * (exp(x / alpha) - 1))."""
    neg = arith.mul(_unary_table.OPS["expm1"](arith.div(_clamp_max0(input), alpha)), alpha)
    return _where(input > 0, input, neg)


def silu(input: Tensor, inplace: bool = False) -> Tensor:  # noqa: A002
    """x * sigmoid(x)."""
    return arith.mul(input, unary.sigmoid(input))


def softplus(input: Tensor, beta: float = 1.0, threshold: float = 20.0) -> Tensor:  # noqa: A002
    """log(1 + exp(beta * x)) / beta, and x itself where beta * x > threshold (as torch)."""
    bx = arith.mul(input, beta)
    soft = arith.div(_binary.OPS["logaddexp"](bx, 0.0), beta)
    return _where(bx > threshold, input, soft)


def mish(input: Tensor, inplace: bool = False) -> Tensor:  # noqa: A002
    """x * tanh(softplus(x))."""
    return arith.mul(input, unary.tanh(softplus(input)))


def softsign(input: Tensor) -> Tensor:  # noqa: A002
    """x / (1 + |x|)."""
    return arith.div(input, arith.add(unary.abs(input), 1.0))


def softshrink(input: Tensor, lambd: float = 0.5) -> Tensor:  # noqa: A002
    """x - lambd above lambd, x + lambd below -lambd, 0 between."""
    zero = arith.mul(input, 0.0)
    return _where(input > lambd, arith.sub(input, lambd),
                  _where(input < -lambd, arith.add(input, lambd), zero))


def hardshrink(input: Tensor, lambd: float = 0.5) -> Tensor:  # noqa: A002
    """x where |x| > lambd, 0 elsewhere."""
    keep = (input > lambd).logical_or(input < -lambd)
    return _where(keep, input, arith.mul(input, 0.0))


def tanhshrink(input: Tensor) -> Tensor:  # noqa: A002
    """x - tanh(x)."""
    return arith.sub(input, unary.tanh(input))


def hardtanh(input: Tensor, min_val: float = -1.0, max_val: float = 1.0,  # noqa: A002
             inplace: bool = False) -> Tensor:
    """x clamped to [min_val, max_val]."""
    if min_val > max_val:
        raise ValueError("min_val cannot be greater than max_val")
    return unary.clamp(input, min_val, max_val)


def relu6(input: Tensor, inplace: bool = False) -> Tensor:  # noqa: A002
    """min(max(x, 0), 6)."""
    return hardtanh(input, 0.0, 6.0)


def hardsigmoid(input: Tensor, inplace: bool = False) -> Tensor:  # noqa: A002
    """relu6(x + 3) / 6."""
    return arith.div(relu6(arith.add(input, 3.0)), 6.0)


def hardswish(input: Tensor, inplace: bool = False) -> Tensor:  # noqa: A002
    """x * relu6(x + 3) / 6."""
    return arith.mul(input, hardsigmoid(input))


def logsigmoid(input: Tensor) -> Tensor:  # noqa: A002
    """log(sigmoid(x)) = -softplus(-x), without overflow."""
    return arith.neg(_binary.OPS["logaddexp"](arith.neg(input), 0.0))


def threshold(input: Tensor, threshold: float, value: float, inplace: bool = False) -> Tensor:  # noqa: A002
    """x where x > threshold, value elsewhere."""
    return _where(input > threshold, input, arith.add(arith.mul(input, 0.0), value))


def glu(input: Tensor, dim: int = -1) -> Tensor:  # noqa: A002
    """a * sigmoid(b) for the two halves (a, b) of dim."""
    size = input.shape[dim]
    if size % 2:
        raise RuntimeError(f"Halving dimension must be even, but dimension {dim} is size {size}")
    a, b = shape.chunk(input, 2, dim)
    return arith.mul(a, unary.sigmoid(b))


@autocast_op("prelu")
def prelu(input: Tensor, weight: Tensor) -> Tensor:  # noqa: A002
    """x where x > 0, weight * x elsewhere (weight per channel, dim 1, or one for all)."""
    w = weight
    if weight.numel() > 1:
        if input.ndim < 2 or input.shape[1] != weight.numel():
            raise RuntimeError("Mismatch of parameter numbers and input channel size. Found "
                               f"parameter numbers = {weight.numel()} and channel size = "
                               f"{input.shape[1] if input.ndim > 1 else 1}.")
        w = shape.reshape(weight, (1, -1) + (1,) * (input.ndim - 2))
    return _where(input > 0, input, arith.mul(input, w))


def softmin(input: Tensor, dim: int | None = None, dtype: Any = None) -> Tensor:  # noqa: A002
    """softmax(-x) along dim."""
    x = input if dtype is None else input.to(dtype)
    return reduce.softmax(arith.neg(x), -1 if dim is None else dim)


def normalize(input: Tensor, p: float = 2.0, dim: int = 1, eps: float = 1e-12) -> Tensor:  # noqa: A002
    """x / max(||x||_p along dim, eps)."""
    norm = _p_norm(input, p, dim, keepdim=True)
    return arith.div(input, unary.clamp(norm, eps, None))


def _p_norm(x: Tensor, p: float, dim: int, keepdim: bool) -> Tensor:
    if p == 2:
        return unary.sqrt(reduce.sum(arith.mul(x, x), dim, keepdim))
    if p == math.inf:
        return reduce.amax(unary.abs(x), dim, keepdim)
    return arith.pow(reduce.sum(arith.pow(unary.abs(x), p), dim, keepdim), 1.0 / p)


def cosine_similarity(x1: Tensor, x2: Tensor, dim: int = 1, eps: float = 1e-8) -> Tensor:
    """x1 . x2 / (max(||x1||, eps) * max(||x2||, eps)) along dim (torch's clamping of each
    norm)."""
    dot = reduce.sum(arith.mul(x1, x2), dim)
    n1 = unary.clamp(_p_norm(x1, 2, dim, False), eps, None)
    n2 = unary.clamp(_p_norm(x2, 2, dim, False), eps, None)
    return arith.div(dot, arith.mul(n1, n2))


def pairwise_distance(x1: Tensor, x2: Tensor, p: float = 2.0, eps: float = 1e-6,
                      keepdim: bool = False) -> Tensor:
    """||x1 - x2 + eps||_p over the last dim."""
    return _p_norm(arith.add(arith.sub(x1, x2), eps), p, -1, keepdim)


def pad(input: Tensor, pad: Sequence[int], mode: str = "constant", value: float | None = None) -> Tensor:  # noqa: A002
    """Pad the last len(pad) // 2 dims: (left, right) of the last dim first, as torch orders."""
    if len(pad) % 2:
        raise RuntimeError("Padding length must be divisible by 2")
    n = len(pad) // 2
    if n > input.ndim:
        raise RuntimeError(f"Padding length should be less than or equal to two times the input "
                           f"dimension but got padding length {len(pad)} and input of dimension "
                           f"{input.ndim}")
    x = input
    for i in range(n):
        d = input.ndim - 1 - i
        left, right = int(pad[2 * i]), int(pad[2 * i + 1])
        x = _pad_dim(x, d, left, right, mode, 0.0 if value is None else value)
    return x


def _pad_dim(x: Tensor, d: int, left: int, right: int, mode: str, value: float) -> Tensor:
    size = x.shape[d]
    if left < 0 or right < 0:  # negative padding crops, as torch's constant mode does
        x = shape.getitem(x, (slice(None),) * d + (slice(max(-left, 0), size - max(-right, 0)),))
        left, right = max(left, 0), max(right, 0)
        size = x.shape[d]
    if not left and not right:
        return x
    if mode == "constant":
        parts = [_const(x, d, left, value), x, _const(x, d, right, value)]
        return shape.cat([p for p in parts if p.shape[d]], d)
    if mode == "reflect":
        if left >= size or right >= size:
            raise RuntimeError(f"Argument #4: Padding size should be less than the corresponding "
                               f"input dimension, but got: padding ({left}, {right}) at dimension "
                               f"{d} of input {list(x.shape)}")
        take = list(range(left, 0, -1)) + list(range(size)) + \
            list(range(size - 2, size - 2 - right, -1))
    elif mode == "replicate":
        take = [0] * left + list(range(size)) + [size - 1] * right
    elif mode == "circular":
        take = [(i - left) % size for i in range(left + size + right)]
    else:
        raise NotImplementedError(f"Padding mode {mode!r} is not one of constant, reflect, "
                                  f"replicate, circular")
    from shoal.core.ops.indexing import index_select  # noqa: PLC0415 - sibling layer's op

    return index_select(x, d, wrap(_int64(take)))


def _int64(values: list) -> Any:
    return np.asarray(values, dtype=np.int64)


def _const(x: Tensor, d: int, n: int, value: float) -> Tensor:
    from shoal.core.ops.creation import full  # noqa: PLC0415 - creation imports shape ops

    dims = list(x.shape)
    dims[d] = n
    return full(tuple(dims), value, dtype=x.dtype)


def pixel_shuffle(input: Tensor, upscale_factor: int) -> Tensor:  # noqa: A002
    """(*, C r^2, H, W) -> (*, C, H r, W r)."""
    r = upscale_factor
    *lead, c, h, w = input.shape
    if c % (r * r):
        raise RuntimeError(f"pixel_shuffle expects its input's 'channel' dimension to be "
                           f"divisible by the square of upscale_factor, but input.size(-3)={c} "
                           f"is not divisible by {r * r}")
    x = shape.reshape(input, tuple(lead) + (c // (r * r), r, r, h, w))
    k = len(lead)
    x = shape.permute(x, *range(k), k, k + 3, k + 1, k + 4, k + 2)
    return shape.reshape(x, tuple(lead) + (c // (r * r), h * r, w * r))


def pixel_unshuffle(input: Tensor, downscale_factor: int) -> Tensor:  # noqa: A002
    """(*, C, H r, W r) -> (*, C r^2, H, W)."""
    r = downscale_factor
    *lead, c, h, w = input.shape
    if h % r or w % r:
        raise RuntimeError(f"pixel_unshuffle expects height and width to be divisible by "
                           f"downscale_factor {r}")
    x = shape.reshape(input, tuple(lead) + (c, h // r, r, w // r, r))
    k = len(lead)
    x = shape.permute(x, *range(k), k, k + 2, k + 4, k + 1, k + 3)
    return shape.reshape(x, tuple(lead) + (c * r * r, h // r, w // r))

