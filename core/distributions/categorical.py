"""torch.distributions.Categorical."""

from __future__ import annotations

import math
from functools import cached_property
from typing import Any, Optional, Sequence

import numpy as np

from shoal.core.distributions import constraints
from shoal.core.distributions.distribution import Distribution, clamp_probs
from shoal.core.ops.creation import arange, full, rand, tensor
from shoal.core.ops.shape import where
from shoal.core.tensor import Tensor

_ONE_OF = "Either `probs` or `logits` must be specified, but not both."


class Categorical(Distribution):
    """One of K categories, with probabilities `probs` (normalized) or log-odds `logits`."""

    arg_constraints = {"probs": constraints.simplex, "logits": constraints.real_vector}
    has_enumerate_support = True

    def __init__(self, probs: Optional[Tensor] = None, logits: Optional[Tensor] = None,
                 validate_args: Optional[bool] = None) -> None:
        if (probs is None) == (logits is None):
            raise ValueError(_ONE_OF)
        if probs is not None:
            if probs.ndim < 1:
                raise ValueError("`probs` parameter must be at least one-dimensional.")
            self.probs = probs / probs.sum(-1, keepdim=True)
            param = self.probs
        else:
            if logits.ndim < 1:
                raise ValueError("`logits` parameter must be at least one-dimensional.")
            self.logits = logits - logits.logsumexp(-1, keepdim=True)
            param = self.logits
        self._param = param
        self._num_events = param.shape[-1]
        super().__init__(param.shape[:-1], validate_args=validate_args)

    @cached_property
    def logits(self) -> Tensor:
        """log of the clamped probabilities."""
        return clamp_probs(self.probs).log()

    @cached_property
    def probs(self) -> Tensor:
        """softmax(logits)."""
        return self.logits.softmax(-1)

    @property
    def param_shape(self) -> tuple:
        """The parameter's shape: batch_shape + (K,)."""
        return tuple(self._param.shape)

    @property
    def support(self) -> Any:
        """The integers 0 .. K - 1."""
        return constraints.integer_interval(0, self._num_events - 1)

    @property
    def mean(self) -> Tensor:
        """NaN, as torch's: categories have no order."""
        return full(self._extended_shape(), math.nan, dtype=self.probs.dtype)

    @property
    def mode(self) -> Tensor:
        """The most probable category."""
        return self.probs.argmax(-1)

    @property
    def variance(self) -> Tensor:
        """NaN, as torch's."""
        return full(self._extended_shape(), math.nan, dtype=self.probs.dtype)

    def sample(self, sample_shape: Sequence[int] = ()) -> Tensor:
        """int64 categories, by inverse CDF of uniforms from core's generator."""
        shape = self._extended_shape(sample_shape)
        u = rand(*shape, dtype=self.probs.dtype).numpy()
        cdf = np.cumsum(self.probs.detach().numpy(), axis=-1)
        # the count of CDF steps below u is the category (clipped: rounding may leave the last
        # step a hair under 1)
        idx = (u[..., None] >= cdf).sum(-1)
        return tensor(np.minimum(idx, self._num_events - 1).astype(np.int64),
                      device=self._param.device)

    def log_prob(self, value: Any) -> Tensor:
        """logits[..., value], broadcast as torch's gather over the last dim."""
        if self._validate_args:
            self._validate_sample(value)
        value = value.long().unsqueeze(-1)
        chosen = value == arange(self._num_events, device=self._param.device)
        return where(chosen, self.logits, 0.0).sum(-1)

    def entropy(self) -> Tensor:
        """-sum(p log p), logits clamped to the dtype's least finite value (0 * -inf = 0)."""
        min_real = float(np.finfo(self.logits.dtype.np).min)
        return -(self.logits.clamp(min=min_real) * self.probs).sum(-1)

    def enumerate_support(self, expand: bool = True) -> Tensor:
        """0 .. K - 1 along a new first dim (expanded over the batch unless expand=False)."""
        values = arange(self._num_events, device=self._param.device)
        values = values.reshape(-1, *([1] * len(self._batch_shape)))
        return values.expand(-1, *self._batch_shape) if expand else values
