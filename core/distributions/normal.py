"""torch.distributions.Normal."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from shoal.core.distributions import constraints
from shoal.core.distributions.distribution import LOG_SQRT_2PI, Distribution, broadcast_all
from shoal.core.ops.creation import randn
from shoal.core.tensor import Tensor


class Normal(Distribution):
    """The normal distribution of mean `loc` and standard deviation `scale`."""

    arg_constraints = {"loc": constraints.real, "scale": constraints.positive}
    support = constraints.real
    has_rsample = True

    def __init__(self, loc: Any, scale: Any, validate_args: Optional[bool] = None) -> None:
        self.loc, self.scale = broadcast_all(loc, scale)
        super().__init__(self.loc.shape, validate_args=validate_args)

    @property
    def mean(self) -> Tensor:
        """loc."""
        return self.loc

    mode = mean

    @property
    def stddev(self) -> Tensor:
        """scale."""
        return self.scale

    @property
    def variance(self) -> Tensor:
        """scale ** 2."""
        return self.stddev.pow(2)

    def rsample(self, sample_shape: Sequence[int] = ()) -> Tensor:
        """loc + eps * scale, eps standard normal from core's generator."""
        eps = randn(*self._extended_shape(sample_shape), dtype=self.loc.dtype,
                    device=self.loc.device)
        return self.loc + eps * self.scale

    def log_prob(self, value: Any) -> Tensor:
        """-(value - loc)^2 / (2 scale^2) - log(scale) - log(sqrt(2 pi))."""
        if self._validate_args:
            self._validate_sample(value)
        var = self.scale ** 2
        return -((value - self.loc) ** 2) / (2 * var) - self.scale.log() - LOG_SQRT_2PI

    def entropy(self) -> Tensor:
        """1/2 + log(sqrt(2 pi)) + log(scale)."""
        return 0.5 + 0.5 * math.log(2 * math.pi) + self.scale.log()
