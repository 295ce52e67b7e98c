"""BatchNorm1d and BatchNorm2d (per-channel normalisation with running statistics), GroupNorm,
InstanceNorm1d/2d, RMSNorm and LocalResponseNorm, as torch.nn."""

from __future__ import annotations

from typing import Any

from shoal.core import dtypes
from shoal.core.nn import functional as F
from shoal.core.nn import init
from shoal.core.nn import losses_more as _norms
from shoal.core.nn.module import Module
from shoal.core.nn.parameter import Parameter
from shoal.core.ops import creation


class _BatchNorm(Module):
    """weight, bias, running_mean, running_var and num_batches_tracked, torch's keys and order."""

    _input_dims: tuple = ()

    def __init__(
        self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
        affine: bool = True, track_running_stats: bool = True, device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        if affine:
            self.weight = Parameter(creation.empty(num_features, dtype=dtype, device=device))
            self.bias = Parameter(creation.empty(num_features, dtype=dtype, device=device))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", creation.zeros(num_features, dtype=dtype, device=device))
            self.register_buffer("running_var", creation.ones(num_features, dtype=dtype, device=device))
            self.register_buffer(
                "num_batches_tracked", creation.zeros((), dtype=dtypes.int64, device=device)
            )
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        """Running mean 0, running variance 1, no batches tracked."""
        if self.track_running_stats:
            self.running_mean.array[...] = 0
            self.running_var.array[...] = 1
            self.num_batches_tracked.array[...] = 0

    def reset_parameters(self) -> None:
        """Reset the running statistics, then weight = 1 and bias = 0."""
        self.reset_running_stats()
        if self.affine:
            init.ones_(self.weight)
            init.zeros_(self.bias)

    def _check_input_dim(self, input: Any) -> None:  # noqa: A002 - torch's name
        if input.ndim not in self._input_dims:
            wanted = " or ".join(f"{d}D" for d in self._input_dims)
            raise ValueError(f"expected {wanted} input (got {input.ndim}D input)")

    def _momentum_and_mode(self) -> tuple[float | None, bool]:
        """torch's rule: momentum None is a cumulative average over the batches tracked."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.array[...] += 1
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked.array)
        use_batch = self.training or self.running_mean is None
        return factor, use_batch

    def _running(self) -> tuple:
        if not self.training or self.track_running_stats:
            return self.running_mean, self.running_var
        return None, None

    def forward(self, input: Any) -> Any:  # noqa: A002
        self._check_input_dim(input)
        factor, use_batch = self._momentum_and_mode()
        mean, var = self._running()
        return F.batch_norm(input, mean, var, self.weight, self.bias, use_batch, factor, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, track_running_stats={self.track_running_stats}")


class BatchNorm1d(_BatchNorm):
    """Batch normalisation over (N, C) or (N, C, L) inputs."""

    _input_dims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Batch normalisation over (N, C, H, W) inputs."""

    _input_dims = (4,)


class _ChannelAffine(Module):
    """weight (ones) and bias (zeros) of num_channels, or neither when affine is False."""

    def __init__(self, num_channels: int, eps: float, affine: bool, device: Any,
                 dtype: Any) -> None:
        super().__init__()
        self.eps, self.affine = eps, affine
        if affine:
            self.weight = Parameter(creation.ones(num_channels, dtype=dtype, device=device))
            self.bias = Parameter(creation.zeros(num_channels, dtype=dtype, device=device))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)


class GroupNorm(_ChannelAffine):
    """Normalise groups of channels per sample, then a per-channel scale and shift."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5,
                 affine: bool = True, device: Any = None, dtype: Any = None) -> None:
        if num_channels % num_groups:
            raise ValueError("num_channels must be divisible by num_groups")
        super().__init__(num_channels, eps, affine, device, dtype)
        self.num_groups, self.num_channels = num_groups, num_channels

    def forward(self, input: Any) -> Any:  # noqa: A002
        return _norms.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"


class _InstanceNorm(_ChannelAffine):
    """Each channel of each sample normalised over its own spatial dims (no running stats)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 affine: bool = False, track_running_stats: bool = False, device: Any = None,
                 dtype: Any = None) -> None:
        if track_running_stats:
            raise NotImplementedError("InstanceNorm: track_running_stats=True is not supported "
                                      "in shoal (torch's default is False)")
        super().__init__(num_features, eps, affine, device, dtype)
        self.num_features, self.momentum = num_features, momentum

    def forward(self, input: Any) -> Any:  # noqa: A002
        return _norms.instance_norm(input, weight=self.weight, bias=self.bias, eps=self.eps)


class InstanceNorm1d(_InstanceNorm):
    """Instance normalisation of (N, C, L) inputs."""


class InstanceNorm2d(_InstanceNorm):
    """Instance normalisation of (N, C, H, W) inputs."""


class RMSNorm(Module):
    """x / sqrt(mean(x^2) + eps) over the trailing normalized_shape dims, times a weight."""

    def __init__(self, normalized_shape: Any, eps: float | None = None,
                 elementwise_affine: bool = True, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.normalized_shape, self.eps = shape, eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = Parameter(creation.ones(*shape, dtype=dtype, device=device))
        else:
            self.register_parameter("weight", None)

    def forward(self, input: Any) -> Any:  # noqa: A002
        return _norms.rms_norm(input, self.normalized_shape, self.weight, self.eps)


class LocalResponseNorm(Module):
    """Normalise by the squares of neighbouring channels."""

    def __init__(self, size: int, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0) -> None:
        super().__init__()
        self.size, self.alpha, self.beta, self.k = size, alpha, beta, k

    def forward(self, input: Any) -> Any:  # noqa: A002
        return _norms.local_response_norm(input, self.size, self.alpha, self.beta, self.k)
