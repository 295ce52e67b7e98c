"""Conv1d/2d/3d and ConvTranspose1d/2d/3d with torch's arguments, defaults, initialisation,
padding modes and state_dict keys."""

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


_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


class _ConvNd(Module):
    """The shared parameters and settings of the convolutions and transposed convolutions."""

    _dims = 2
    _transposed = False

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
        if padding_mode not in _PADDING_MODES:
            raise ValueError(f"padding_mode must be one of {set(_PADDING_MODES)}, but got "
                             f"padding_mode={padding_mode!r}")
        if self._transposed and padding_mode != "zeros":
            raise ValueError(f'Only "zeros" padding mode is supported for {name}')
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
        self.output_padding = (0,) * n
        self.groups = groups
        self.padding_mode = padding_mode
        self._reversed_padding_repeated_twice = _reversed_padding(
            self.padding, self.kernel_size, self.dilation)
        if self._transposed:
            shape = (in_channels, out_channels // groups) + self.kernel_size
        else:
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
            text += f", padding={self.padding}"  # torch prints same, not 'same'
        if self.dilation != (1,) * self._dims:
            text += f", dilation={self.dilation}"
        if self.output_padding != (0,) * self._dims:
            text += f", output_padding={self.output_padding}"
        if self.groups != 1:
            text += f", groups={self.groups}"
        if self.bias is None:
            text += ", bias=False"
        if self.padding_mode != "zeros":
            text += f", padding_mode={self.padding_mode}"
        return text

    def _conv_forward(self, input: Any, conv: Any) -> Any:  # noqa: A002 - torch's name
        """`conv` of the input; a padding mode other than zeros pads with F.pad first, as torch."""
        if self.padding_mode == "zeros":
            return conv(input, self.weight, self.bias, self.stride, self.padding, self.dilation,
                        self.groups)
        padded = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
        return conv(padded, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


def _reversed_padding(padding: Any, kernel: tuple, dilation: tuple) -> list:
    """F.pad's (left, right) pairs, last dim first, of a convolution's padding (torch's
    _reversed_padding_repeated_twice; 'same' puts the odd pixel on the right)."""
    out: list = []
    for i in reversed(range(len(kernel))):
        if padding == "valid":
            out += [0, 0]
        elif padding == "same":
            total = dilation[i] * (kernel[i] - 1)
            out += [total // 2, total - total // 2]
        else:
            out += [padding[i], padding[i]]
    return out


class Conv2d(_ConvNd):
    """2-D convolution over (N, C, H, W) inputs."""

    _dims = 2

    def forward(self, input: Any) -> Any:  # noqa: A002 - torch's name
        return self._conv_forward(input, F.conv2d)


class Conv1d(_ConvNd):
    """1-D convolution over (N, C, L) inputs."""

    _dims = 1

    def forward(self, input: Any) -> Any:  # noqa: A002
        return self._conv_forward(input, F.conv1d)


class Conv3d(_ConvNd):
    """3-D convolution over (N, C, D, H, W) inputs."""

    _dims = 3

    def forward(self, input: Any) -> Any:  # noqa: A002
        return self._conv_forward(input, F.conv3d)


class _ConvTransposeNd(_ConvNd):
    """The transposed convolutions: torch's argument order (groups, bias, dilation) and an
    `output_size=` in forward that picks the output padding."""

    _transposed = True

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1,
        padding: Any = 0, output_padding: Any = 0, groups: int = 1, bias: bool = True,
        dilation: Any = 1, padding_mode: str = "zeros", device: Any = None, dtype: Any = None,
    ) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, padding_mode, device, dtype)
        self.output_padding = _tuple(output_padding, self._dims, "output_padding")

    def _output_padding(self, input: Any, output_size: Any) -> tuple:  # noqa: A002
        """The output padding that makes the output `output_size` (torch's rule and error)."""
        if output_size is None:
            return self.output_padding
        n = self._dims
        leading = 2 if input.ndim == n + 2 else 1
        size = [int(v) for v in output_size]
        if len(size) == leading + n:
            size = size[leading:]
        if len(size) != n:
            raise ValueError(f"ConvTranspose{n}D: for {input.ndim}D input, output_size must have "
                             f"{n} or {leading + n} elements (got {len(size)})")
        smallest = [
            (input.shape[leading + d] - 1) * self.stride[d] - 2 * self.padding[d]
            + self.dilation[d] * (self.kernel_size[d] - 1) + 1 for d in range(n)]
        largest = [lo + s - 1 for lo, s in zip(smallest, self.stride)]
        if any(not lo <= v <= hi for v, lo, hi in zip(size, smallest, largest)):
            raise ValueError(f"requested an output size of {tuple(size)}, but valid sizes range "
                             f"from {smallest} to {largest} (for an input of "
                             f"{tuple(input.shape[leading:])})")
        return tuple(v - lo for v, lo in zip(size, smallest))

    def forward(self, input: Any, output_size: Any = None) -> Any:  # noqa: A002
        conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[self._dims - 1]
        return conv(input, self.weight, self.bias, self.stride, self.padding,
                    self._output_padding(input, output_size), self.groups, self.dilation)


class ConvTranspose1d(_ConvTransposeNd):
    """1-D transposed convolution over (N, C, L) inputs."""

    _dims = 1


class ConvTranspose2d(_ConvTransposeNd):
    """2-D transposed convolution over (N, C, H, W) inputs."""

    _dims = 2


class ConvTranspose3d(_ConvTransposeNd):
    """3-D transposed convolution over (N, C, D, H, W) inputs."""

    _dims = 3
