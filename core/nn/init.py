"""In-place initialisers for parameters, with torch.nn.init's names and formulas.

They write into `tensor.array` from core's global generator (core.manual_seed), so they record
nothing for autograd.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shoal.core import backend
from shoal.core.errors import ShapeError
from shoal.core.ops import random as _random
from shoal.core.ops import random_fill as _fills
from shoal.core.tensor import Tensor


def _draw(tensor: Tensor, kind: str, a: float, b: float) -> Tensor:
    data = tensor.array
    xp = backend.array_module(data)
    gen = _random.generator(xp, backend.device_of(data).index)
    # Generators draw float32 or float64; half types draw float32 and round once.
    draw = data.dtype if data.dtype in (np.float32, np.float64) else np.float32
    if kind == "uniform":
        sample = gen.random(data.shape, dtype=draw)
        sample *= b - a
        sample += a
    else:
        sample = gen.standard_normal(data.shape, dtype=draw)
        sample *= b
        sample += a
    data[...] = sample
    return tensor


def uniform_(tensor: Tensor, a: float = 0.0, b: float = 1.0, generator: Any = None) -> Tensor:
    """Fill with samples from U(a, b) (from `generator`, a core.Generator, when given)."""
    if generator is not None:
        return _fills.uniform_(tensor, a, b, generator=generator)
    return _draw(tensor, "uniform", a, b)


def normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, generator: Any = None) -> Tensor:
    """Fill with samples from N(mean, std^2) (from `generator` when given)."""
    if generator is not None:
        return _fills.normal_(tensor, mean, std, generator=generator)
    return _draw(tensor, "normal", mean, std)


def constant_(tensor: Tensor, val: float) -> Tensor:
    """Fill with `val`."""
    tensor.array[...] = val
    return tensor


def zeros_(tensor: Tensor) -> Tensor:
    """Fill with zeros."""
    return constant_(tensor, 0.0)


def ones_(tensor: Tensor) -> Tensor:
    """Fill with ones."""
    return constant_(tensor, 1.0)


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    """The recommended gain for a nonlinearity, as torch.nn.init.calculate_gain."""
    linear = ("linear", "conv1d", "conv2d", "conv3d", "sigmoid")
    if nonlinearity in linear:
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else float(param)
        return math.sqrt(2.0 / (1 + slope**2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ValueError(f"calculate_gain: unsupported nonlinearity {nonlinearity!r}.")


def _calculate_fan_in_and_fan_out(tensor: Tensor) -> tuple[int, int]:
    shape = tensor.shape
    if len(shape) < 2:
        raise ShapeError(
            f"Fan in and fan out need a tensor of at least 2 dims; got shape {tuple(shape)}."
        )
    receptive = int(np.prod(shape[2:])) if len(shape) > 2 else 1
    return shape[1] * receptive, shape[0] * receptive


def kaiming_uniform_(
    tensor: Tensor, a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu"
) -> Tensor:
    """U(-bound, bound) with bound = gain * sqrt(3 / fan), as torch (Linear uses a=sqrt(5))."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    fan = fan_in if mode == "fan_in" else fan_out
    bound = calculate_gain(nonlinearity, a) * math.sqrt(3.0 / fan) if fan else 0.0
    return uniform_(tensor, -bound, bound)


def kaiming_normal_(
    tensor: Tensor, a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu"
) -> Tensor:
    """N(0, std^2) with std = gain / sqrt(fan)."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    fan = fan_in if mode == "fan_in" else fan_out
    std = calculate_gain(nonlinearity, a) / math.sqrt(fan) if fan else 0.0
    return normal_(tensor, 0.0, std)


def xavier_uniform_(tensor: Tensor, gain: float = 1.0) -> Tensor:
    """U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out))."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(tensor, -bound, bound)


def xavier_normal_(tensor: Tensor, gain: float = 1.0) -> Tensor:
    """N(0, std^2) with std = gain * sqrt(2 / (fan_in + fan_out))."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return normal_(tensor, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)))


__all__ = [
    "calculate_gain", "constant_", "kaiming_normal_", "kaiming_uniform_", "normal_", "ones_",
    "uniform_", "xavier_normal_", "xavier_uniform_", "zeros_",
]
