"""torch.distributions.Distribution: shapes, argument validation and the shared helpers."""

from __future__ import annotations

import math
from numbers import Number
from typing import Any, Optional, Sequence

import numpy as np

from shoal.core.distributions import constraints
from shoal.core.grad_mode import no_grad
from shoal.core.ops import reduce, shape as shape_ops
from shoal.core.ops.creation import Size, tensor
from shoal.core.tensor import Tensor


def broadcast_all(*values: Any) -> tuple:
    """Tensors of one shape from tensors and numbers (numbers take a tensor's dtype and device,
    float32 when none is a tensor), as torch.distributions.utils.broadcast_all."""
    ref = next((v for v in values if isinstance(v, Tensor)), None)
    out = []
    for v in values:
        if isinstance(v, Tensor):
            out.append(v)
        elif isinstance(v, Number):
            out.append(tensor(float(v)) if ref is None
                       else tensor(v, dtype=ref.dtype, device=ref.device))
        else:
            raise ValueError("Input arguments must all be instances of numbers.Number, "
                             "torch.Tensor or objects implementing __torch_function__.")
    common = tuple(np.broadcast_shapes(*(v.shape for v in out)))
    return tuple(v if v.shape == common else v.expand(*common) for v in out)


def clamp_probs(probs: Tensor) -> Tensor:
    """Probabilities kept in [eps, 1 - eps] of their dtype, so their logs are finite."""
    eps = float(np.finfo(probs.dtype.np).eps)
    return probs.clamp(min=eps, max=1 - eps)


def softplus(x: Tensor) -> Tensor:
    """log(1 + exp(x)) without overflow, with torch's gradient sigmoid(x) at every x
    (logsumexp of (0, x): its backward is the softmax of the pair)."""
    return reduce.logsumexp(shape_ops.stack([x * 0.0, x]), 0)


def binary_cross_entropy_with_logits(logits: Tensor, target: Any) -> Tensor:
    """torch's elementwise BCE-with-logits: (1 - t) * x + softplus(-x)."""
    return (1 - target) * logits + softplus(-logits)


class Distribution:
    """Base of the distributions: batch and event shapes, sample shapes, validation."""

    has_rsample = False
    has_enumerate_support = False
    _validate_args = __debug__  # torch validates unless Python runs with -O

    @staticmethod
    def set_default_validate_args(value: bool) -> None:
        """Turn argument validation on or off for distributions made from now on."""
        if value not in (True, False):
            raise ValueError
        Distribution._validate_args = value

    def __init__(self, batch_shape: Sequence[int] = (), event_shape: Sequence[int] = (),
                 validate_args: Optional[bool] = None) -> None:
        self._batch_shape = Size(batch_shape)
        self._event_shape = Size(event_shape)
        if validate_args is not None:
            self._validate_args = validate_args
        if not self._validate_args:
            return
        for param, constraint in self.arg_constraints.items():
            if constraints.is_dependent(constraint) or param not in self.__dict__:
                continue  # lazily computed parameters are not checked (as torch's)
            value = getattr(self, param)
            if not bool(constraint.check(value).all()):
                raise ValueError(
                    f"Expected parameter {param} ({type(value).__name__} of shape "
                    f"{tuple(value.shape)}) of distribution {self!r} to satisfy the "
                    f"constraint {constraint!r}, but found invalid values:\n{value}")

    @property
    def batch_shape(self) -> Size:
        """The shape over which parameters are batched."""
        return self._batch_shape

    @property
    def event_shape(self) -> Size:
        """The shape of a single sample (without batching)."""
        return self._event_shape

    @property
    def arg_constraints(self) -> dict:
        """Parameter name -> the constraint it must satisfy."""
        raise NotImplementedError

    @property
    def support(self) -> Any:
        """The constraint every value of the distribution satisfies."""
        raise NotImplementedError

    @property
    def mean(self) -> Tensor:
        """The distribution's mean."""
        raise NotImplementedError

    @property
    def mode(self) -> Tensor:
        """The distribution's mode."""
        raise NotImplementedError(f"{type(self)} does not implement mode")

    @property
    def variance(self) -> Tensor:
        """The distribution's variance."""
        raise NotImplementedError

    @property
    def stddev(self) -> Tensor:
        """The standard deviation: the variance's square root."""
        return self.variance.sqrt()

    def sample(self, sample_shape: Sequence[int] = ()) -> Tensor:
        """Samples of shape sample_shape + batch_shape + event_shape, without a gradient."""
        with no_grad():
            return self.rsample(sample_shape)

    def rsample(self, sample_shape: Sequence[int] = ()) -> Tensor:
        """Reparameterized samples: gradients flow to the parameters."""
        raise NotImplementedError

    def log_prob(self, value: Tensor) -> Tensor:
        """Log of the density (or mass) at `value`."""
        raise NotImplementedError

    def cdf(self, value: Tensor) -> Tensor:
        """The cumulative distribution function at `value`."""
        raise NotImplementedError

    def icdf(self, value: Tensor) -> Tensor:
        """The inverse cumulative distribution function at `value`."""
        raise NotImplementedError

    def entropy(self) -> Tensor:
        """The entropy, batched over batch_shape."""
        raise NotImplementedError

    def perplexity(self) -> Tensor:
        """exp(entropy)."""
        return self.entropy().exp()

    def _extended_shape(self, sample_shape: Sequence[int] = ()) -> Size:
        return Size(tuple(sample_shape) + self._batch_shape + self._event_shape)

    def _validate_sample(self, value: Any) -> None:
        if not isinstance(value, Tensor):
            raise ValueError("The value argument to log_prob must be a Tensor")
        shape = Size(value.shape)
        start = len(shape) - len(self._event_shape)
        if shape[start:] != self._event_shape:
            raise ValueError(f"The right-most size of value must match event_shape: {shape} vs "
                             f"{self._event_shape}.")
        expected = Size(self._batch_shape + self._event_shape)
        for i, j in zip(reversed(shape), reversed(expected)):
            if i != 1 and j != 1 and i != j:
                raise ValueError(f"Value is not broadcastable with batch_shape+event_shape: "
                                 f"{shape} vs {expected}.")
        if not bool(self.support.check(value).all()):
            raise ValueError(
                f"Expected value argument ({type(value).__name__} of shape {tuple(shape)}) to be "
                f"within the support ({self.support!r}) of the distribution {self!r}, but "
                f"found invalid values:\n{value}")

    def __repr__(self) -> str:
        names = [k for k in self.arg_constraints if k in self.__dict__]
        parts = []
        for p in names:
            v = self.__dict__[p]
            parts.append(f"{p}: {v.item() if v.numel() == 1 and v.ndim == 0 else Size(v.shape)}")
        return f"{type(self).__name__}({', '.join(parts)})"


LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))
