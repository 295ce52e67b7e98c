"""torch.distributions.Uniform."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from shoal.core.distributions import constraints
from shoal.core.distributions.distribution import Distribution, broadcast_all
from shoal.core.ops.creation import rand
from shoal.core.ops.shape import where
from shoal.core.tensor import Tensor


class Uniform(Distribution):
    """The uniform distribution on the half-open interval [low, high)."""

    has_rsample = True

    def __init__(self, low: Any, high: Any, validate_args: Optional[bool] = None) -> None:
        self.low, self.high = broadcast_all(low, high)
        super().__init__(self.low.shape, validate_args=validate_args)

    @property
    def arg_constraints(self) -> dict:
        """low < high, elementwise."""
        return {"low": constraints.less_than(self.high),
                "high": constraints.greater_than(self.low)}

    @property
    def support(self) -> Any:
        """[low, high]."""
        return constraints.interval(self.low, self.high)

    @property
    def mean(self) -> Tensor:
        """(high + low) / 2."""
        return (self.high + self.low) / 2

    @property
    def mode(self) -> Tensor:
        """NaN: every point is a mode."""
        return self.high * math.nan

    @property
    def stddev(self) -> Tensor:
        """(high - low) / sqrt(12)."""
        return (self.high - self.low) / 12 ** 0.5

    @property
    def variance(self) -> Tensor:
        """(high - low)^2 / 12."""
        return (self.high - self.low).pow(2) / 12

    def rsample(self, sample_shape: Sequence[int] = ()) -> Tensor:
        """low + u * (high - low), u uniform on [0, 1) from core's generator."""
        u = rand(*self._extended_shape(sample_shape), dtype=self.low.dtype,
                 device=self.low.device)
        return self.low + u * (self.high - self.low)

    def log_prob(self, value: Any) -> Tensor:
        """-log(high - low) inside [low, high), -inf outside."""
        if self._validate_args:
            self._validate_sample(value)
        inside = self.low.le(value).type_as(self.low) * self.high.gt(value).type_as(self.low)
        # torch takes log(inside) - log(high - low): the gradient reaches low and high through
        # the second term also outside the support; where() keeps that without log(0)'s warning
        return where(inside > 0, 0.0, -math.inf) - (self.high - self.low).log()

    def cdf(self, value: Any) -> Tensor:
        """(value - low) / (high - low), clamped to [0, 1]."""
        if self._validate_args:
            self._validate_sample(value)
        return ((value - self.low) / (self.high - self.low)).clamp(min=0, max=1)

    def icdf(self, value: Any) -> Tensor:
        """low + value * (high - low)."""
        return value * (self.high - self.low) + self.low

    def entropy(self) -> Tensor:
        """log(high - low)."""
        return (self.high - self.low).log()
