"""Conv1d and Conv2d with torch's arguments, defaults, initialisation and state_dict keys."""

from __future__ import annotations

import math
from typing import Any

from shoal.core.nn import functional as F
from shoal.core.nn import init
from shoal.core.nn.module import Module
from shoal.core.nn.parameter import Parameter
from shoal.core.ops import creation


def _tuple(value: Any, n: int, name: str) -> tuple:
    if isinstance(value, int):
        return (value,) * n
    out = tuple(value)
    if len(out) != n:
        raise ValueError(f"{name} must be an int or a tuple of {n} ints, got {value!r}.")
    return out


class _ConvNd(Module):
    """The shared parameters and settings of Conv1d and Conv2d."""

    _dims = 2

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1,
        padding: Any = 0, dilation: Any = 1, groups: int = 1, bias: bool = True,
        padding_mode: str = "zeros", device: Any = None, dtype: Any = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if groups < 1 or in_channels % groups or out_channels % groups:
            raise ValueError(
                f"{name}: groups={groups} must divide in_channels ({in_channels}) and "
                f"out_channels ({out_channels})."
            )
        if padding_mode != "zeros":
            raise ValueError(f"{name}: only padding_mode='zeros' is supported, got {padding_mode!r}.")
        n = self._dims
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = _tuple(kernel_size, n, "kernel_size")
        self.stride = _tuple(stride, n, "stride")
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(f"{name}: padding must be 'same', 'valid' or ints, got {padding!r}.")
            if padding == "same" and any(s != 1 for s in self.stride):
                raise ValueError("padding='same' is not supported for strided convolutions")
            self.padding = padding
        else:
            self.padding = _tuple(padding, n, "padding")
        self.dilation = _tuple(dilation, n, "dilation")
        self.groups = groups
        self.padding_mode = padding_mode
        shape = (out_channels, in_channels // groups) + self.kernel_size
        self.weight = Parameter(creation.empty(*shape, dtype=dtype, device=device))
        if bias:
            self.bias = Parameter(creation.empty(out_channels, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torch's default: kaiming_uniform(a=sqrt(5)) weight, U(+-1/sqrt(fan_in)) bias."""
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.weight.shape[1] * math.prod(self.kernel_size)
            bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
            init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        text = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}")
        if self.padding != (0,) * self._dims:
            text += f", padding={self.padding!r}"
        if self.dilation != (1,) * self._dims:
            text += f", dilation={self.dilation}"
        if self.groups != 1:
            text += f", groups={self.groups}"
        if self.bias is None:
            text += ", bias=False"
        return text


class Conv2d(_ConvNd):
    """2-D convolution over (N, C, H, W) inputs."""

    _dims = 2

    def forward(self, input: Any) -> Any:  # noqa: A002 - torch's name
        return F.conv2d(input, self.weight, self.bias, self.stride, self.padding, self.dilation,
                        self.groups)


class Conv1d(_ConvNd):
    """1-D convolution over (N, C, L) inputs."""

    _dims = 1

    def forward(self, input: Any) -> Any:  # noqa: A002
        return F.conv1d(input, self.weight, self.bias, self.stride, self.padding, self.dilation,
                        self.groups)
