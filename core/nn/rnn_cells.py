"""RNNCell, LSTMCell and GRUCell: one step of the recurrences in core/nn/rnn.py, with torch's
parameter names (weight_ih, weight_hh, bias_ih, bias_hh), shapes and initialisation."""

from __future__ import annotations

import math
from typing import Any

from shoal.core.errors import ShapeError
from shoal.core.nn import functional as F
from shoal.core.nn import init
from shoal.core.nn.module import Module
from shoal.core.nn.parameter import Parameter
from shoal.core.nn.rnn import gru_step, lstm_step, rnn_step
from shoal.core.ops import creation
from shoal.core.tensor import Tensor


class RNNCellBase(Module):
    """The parameters and input checks the three cells share."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool, gates: int,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.bias = bias
        shape = (gates * hidden_size,)
        self.weight_ih = Parameter(creation.empty(*shape, input_size, dtype=dtype, device=device))
        self.weight_hh = Parameter(creation.empty(*shape, hidden_size, dtype=dtype, device=device))
        if bias:
            self.bias_ih = Parameter(creation.empty(*shape, dtype=dtype, device=device))
            self.bias_hh = Parameter(creation.empty(*shape, dtype=dtype, device=device))
        else:
            self.register_parameter("bias_ih", None)
            self.register_parameter("bias_hh", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every weight and bias from U(-1/sqrt(hidden_size), 1/sqrt(hidden_size))."""
        bound = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0.0
        for param in self.parameters():
            init.uniform_(param, -bound, bound)

    def _batched(self, input: Tensor) -> tuple[Tensor, bool]:  # noqa: A002 - torch's name
        if input.ndim not in (1, 2):
            raise ShapeError(
                f"{type(self).__name__}: Expected input to be 1D or 2D, got {input.ndim}D "
                "instead"
            )
        if input.shape[-1] != self.input_size:
            raise ShapeError(
                f"input has inconsistent input_size: got {input.shape[-1]} expected "
                f"{self.input_size}"
            )
        return (input, True) if input.ndim == 2 else (input.unsqueeze(0), False)

    def _state(self, hx: Any, input: Tensor, batched: bool) -> Tensor:  # noqa: A002
        if hx is None:
            return creation.zeros(input.shape[0], self.hidden_size, dtype=input.dtype,
                                  device=input.device)
        return hx if batched else hx.unsqueeze(0)

    def extra_repr(self) -> str:
        text = f"{self.input_size}, {self.hidden_size}"
        return text if self.bias else text + ", bias=False"


class RNNCell(RNNCellBase):
    """h' = tanh (or relu)(W_ih x + b_ih + W_hh h + b_hh)."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 nonlinearity: str = "tanh", device: Any = None, dtype: Any = None) -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"Unknown nonlinearity: {nonlinearity}")
        super().__init__(input_size, hidden_size, bias, 1, device, dtype)
        self.nonlinearity = nonlinearity

    def forward(self, input: Tensor, hx: Tensor | None = None) -> Tensor:  # noqa: A002
        """The next hidden state."""
        x, batched = self._batched(input)
        h = self._state(hx, x, batched)
        step = rnn_step("RNN_RELU" if self.nonlinearity == "relu" else "RNN_TANH")
        out = step(F.linear(x, self.weight_ih, self.bias_ih), h, self.weight_hh, self.bias_hh)
        return out if batched else out.squeeze(0)


class LSTMCell(RNNCellBase):
    """One LSTM step: (h, c) -> (h', c'), gates i, f, g, o."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__(input_size, hidden_size, bias, 4, device, dtype)

    def forward(self, input: Tensor, hx: tuple | None = None) -> tuple:  # noqa: A002
        """The next (hidden, cell) states."""
        x, batched = self._batched(input)
        h = self._state(None if hx is None else hx[0], x, batched)
        c = self._state(None if hx is None else hx[1], x, batched)
        xg = F.linear(x, self.weight_ih, self.bias_ih)
        h, c = lstm_step(xg, (h, c), self.weight_hh, self.bias_hh)
        return (h, c) if batched else (h.squeeze(0), c.squeeze(0))


class GRUCell(RNNCellBase):
    """One GRU step: h -> h', gates r, z, n."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__(input_size, hidden_size, bias, 3, device, dtype)

    def forward(self, input: Tensor, hx: Tensor | None = None) -> Tensor:  # noqa: A002
        """The next hidden state."""
        x, batched = self._batched(input)
        h = self._state(hx, x, batched)
        out = gru_step(F.linear(x, self.weight_ih, self.bias_ih), h, self.weight_hh,
                        self.bias_hh)
        return out if batched else out.squeeze(0)
