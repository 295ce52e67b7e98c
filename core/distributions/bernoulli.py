"""torch.distributions.Bernoulli."""

from __future__ import annotations

import math
from functools import cached_property
from numbers import Number
from typing import Any, Optional, Sequence

from shoal.core.distributions import constraints
from shoal.core.distributions.distribution import (
    Distribution, binary_cross_entropy_with_logits, broadcast_all, clamp_probs,
)
from shoal.core.ops.creation import arange, rand
from shoal.core.ops.shape import where
from shoal.core.tensor import Tensor

_ONE_OF = "Either `probs` or `logits` must be specified, but not both."


class Bernoulli(Distribution):
    """1 with probability `probs` (or sigmoid(`logits`)), else 0."""

    arg_constraints = {"probs": constraints.unit_interval, "logits": constraints.real}
    support = constraints.boolean
    has_enumerate_support = True

    def __init__(self, probs: Any = None, logits: Any = None,
                 validate_args: Optional[bool] = None) -> None:
        if (probs is None) == (logits is None):
            raise ValueError(_ONE_OF)
        param = probs if probs is not None else logits
        self._param_is_scalar = isinstance(param, Number)
        (value,) = broadcast_all(param)
        if probs is not None:
            self.probs = value
        else:
            self.logits = value
        super().__init__(value.shape, validate_args=validate_args)

    @cached_property
    def logits(self) -> Tensor:
        """log(p) - log(1 - p) of the clamped probabilities."""
        p = clamp_probs(self.probs)
        # no log1p in core: 1 - p is exact to half an ulp of 1, enough for p in [eps, 1 - eps]
        return p.log() - (1 - p).log()

    @cached_property
    def probs(self) -> Tensor:
        """sigmoid(logits)."""
        return self.logits.sigmoid()

    @property
    def param_shape(self) -> tuple:
        """The parameter's shape."""
        return tuple(self.__dict__.get("probs", self.__dict__.get("logits")).shape)

    @property
    def mean(self) -> Tensor:
        """probs."""
        return self.probs

    @property
    def mode(self) -> Tensor:
        """1 where probs > 1/2, 0 below, NaN at exactly 1/2."""
        p = self.probs
        return where(p == 0.5, math.nan, (p >= 0.5).type_as(p))

    @property
    def variance(self) -> Tensor:
        """probs * (1 - probs)."""
        return self.probs * (1 - self.probs)

    def sample(self, sample_shape: Sequence[int] = ()) -> Tensor:
        """0/1 draws in probs' dtype, from core's generator (no gradient, no rsample)."""
        p = self.probs.detach()
        u = rand(*self._extended_shape(sample_shape), dtype=p.dtype, device=p.device)
        return (u < p).type_as(p)

    def log_prob(self, value: Any) -> Tensor:
        """value * logits - softplus(logits), written as torch's -BCE-with-logits."""
        if self._validate_args:
            self._validate_sample(value)
        logits, value = broadcast_all(self.logits, value)
        return -binary_cross_entropy_with_logits(logits, value)

    def entropy(self) -> Tensor:
        """BCE-with-logits of the probabilities against themselves."""
        return binary_cross_entropy_with_logits(self.logits, self.probs)

    def enumerate_support(self, expand: bool = True) -> Tensor:
        """[0, 1] along a new first dim (expanded over the batch unless expand=False)."""
        values = arange(2, dtype=self.probs.dtype if "probs" in self.__dict__
                        else self.logits.dtype)
        values = values.reshape(2, *([1] * len(self._batch_shape)))
        return values.expand(2, *self._batch_shape) if expand else values
