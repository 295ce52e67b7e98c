"""RNN, LSTM and GRU (stacked, bidirectional, with LSTM's proj_size) and their cells, with
torch.nn's parameter names, shapes, initialisation and gate order.

Each step is vectorised over the batch and built from differentiable ops (linear, sigmoid,
tanh), so autograd gives the gradients; the sequence is a Python loop over time steps, as
torch's CPU kernel loops too. The input projection of a whole layer is one GEMM before the
loop.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from shoal.core.errors import ShapeError
from shoal.core.nn import functional as F
from shoal.core.nn import init
from shoal.core.nn.module import Module
from shoal.core.nn.parameter import Parameter
from shoal.core.ops import creation
from shoal.core.ops.shape import cat, stack
from shoal.core.tensor import Tensor

_GATES = {"RNN_TANH": 1, "RNN_RELU": 1, "LSTM": 4, "GRU": 3}


def rnn_step(mode: str) -> Callable:
    """The Elman step for mode 'RNN_TANH' or 'RNN_RELU', as a function of (xg, h, w_hh, b_hh)."""
    act = F.relu if mode == "RNN_RELU" else F.tanh

    def step(xg: Tensor, h: Tensor, w_hh: Tensor, b_hh: Tensor | None) -> Tensor:
        return act(xg + F.linear(h, w_hh, b_hh))

    return step


def lstm_step(
    xg: Tensor, state: tuple, w_hh: Tensor, b_hh: Tensor | None, w_hr: Tensor | None = None,
) -> tuple:
    """One LSTM step from the input's projection xg; gates in torch's order i, f, g, o."""
    h, c = state
    i, f, g, o = (xg + F.linear(h, w_hh, b_hh)).chunk(4, dim=-1)
    c = F.sigmoid(f) * c + F.sigmoid(i) * F.tanh(g)
    h = F.sigmoid(o) * F.tanh(c)
    if w_hr is not None:
        h = F.linear(h, w_hr)
    return h, c


def gru_step(xg: Tensor, h: Tensor, w_hh: Tensor, b_hh: Tensor | None) -> Tensor:
    """One GRU step; gates r, z, n; the reset gate scales the hidden projection with its bias."""
    x_r, x_z, x_n = xg.chunk(3, dim=-1)
    h_r, h_z, h_n = F.linear(h, w_hh, b_hh).chunk(3, dim=-1)
    r = F.sigmoid(x_r + h_r)
    z = F.sigmoid(x_z + h_z)
    n = F.tanh(x_n + r * h_n)
    return n + z * (h - n)  # (1 - z) * n + z * h, one op fewer


class RNNBase(Module):
    """The stacked, optionally bidirectional recurrence shared by RNN, LSTM and GRU."""

    def __init__(
        self, mode: str, input_size: int, hidden_size: int, num_layers: int = 1,
        bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
        bidirectional: bool = False, proj_size: int = 0, device: Any = None, dtype: Any = None,
    ) -> None:
        super().__init__()
        _check_sizes(mode, hidden_size, num_layers, dropout, proj_size)
        self.mode = mode
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.bias = bias
        self.batch_first = batch_first
        self.dropout = float(dropout)
        self.bidirectional = bidirectional
        self.proj_size = proj_size
        directions = 2 if bidirectional else 1
        out_size = proj_size or hidden_size
        gates = _GATES[mode] * hidden_size
        self._flat_weights_names: list[str] = []
        for layer in range(num_layers):
            layer_input = input_size if layer == 0 else out_size * directions
            for direction in range(directions):
                suffix = f"_l{layer}" + ("_reverse" if direction else "")
                shapes = [("weight_ih", (gates, layer_input)), ("weight_hh", (gates, out_size))]
                if bias:
                    shapes += [("bias_ih", (gates,)), ("bias_hh", (gates,))]
                if proj_size:
                    shapes.append(("weight_hr", (proj_size, hidden_size)))
                for name, shape in shapes:
                    param = Parameter(creation.empty(*shape, dtype=dtype, device=device))
                    setattr(self, name + suffix, param)
                    self._flat_weights_names.append(name + suffix)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every weight and bias from U(-1/sqrt(hidden_size), 1/sqrt(hidden_size))."""
        bound = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0.0
        for param in self.parameters():
            init.uniform_(param, -bound, bound)

    def flatten_parameters(self) -> None:
        """Accepted for torch compatibility: shoal's weights need no flattening."""

    def _weights(self, layer: int, direction: int) -> tuple:
        suffix = f"_l{layer}" + ("_reverse" if direction else "")
        get = lambda name: getattr(self, name + suffix, None)  # noqa: E731 - a local shorthand
        return get("weight_ih"), get("weight_hh"), get("bias_ih"), get("bias_hh"), get("weight_hr")

    def forward(self, input: Tensor, hx: Any = None) -> tuple:  # noqa: A002 - torch's name
        """(output, h_n) for RNN and GRU, (output, (h_n, c_n)) for LSTM, as torch's."""
        batched = input.ndim == 3
        if input.ndim not in (2, 3):
            raise ShapeError(
                f"{type(self).__name__}: Expected input to be 2D or 3D, got {input.ndim}D "
                "instead."
            )
        if not batched:
            input = input.unsqueeze(1)  # noqa: A001
        elif self.batch_first:
            input = input.transpose(0, 1)  # noqa: A001
        if input.shape[-1] != self.input_size:
            raise ShapeError(
                f"input.size(-1) must be equal to input_size. Expected {self.input_size}, "
                f"got {input.shape[-1]}"
            )
        state = self._initial_state(input, hx, batched)
        output, finals = self._run_layers(input, state)
        if not batched:
            output = output.squeeze(1)
            finals = [f.squeeze(1) for f in finals]
        elif self.batch_first:
            output = output.transpose(0, 1)
        if self.mode == "LSTM":
            return output, (finals[0], finals[1])
        return output, finals[0]

    def _initial_state(self, input: Tensor, hx: Any, batched: bool) -> list:  # noqa: A002
        """The initial hidden (and cell) states, each (layers * directions, batch, size)."""
        directions = 2 if self.bidirectional else 1
        batch = input.shape[1]
        sizes = [self.proj_size or self.hidden_size]
        if self.mode == "LSTM":
            sizes.append(self.hidden_size)
        if hx is None:
            return [
                creation.zeros(self.num_layers * directions, batch, size, dtype=input.dtype,
                               device=input.device)
                for size in sizes
            ]
        states = list(hx) if self.mode == "LSTM" else [hx]
        if len(states) != len(sizes):
            raise ShapeError(f"{type(self).__name__}: hx must hold {len(sizes)} tensors.")
        out = []
        for state, size in zip(states, sizes):
            if not batched:
                if state.ndim != 2:
                    raise ShapeError(
                        f"For unbatched 2-D input, hx should also be 2-D but got "
                        f"{state.ndim}-D tensor"
                    )
                state = state.unsqueeze(1)
            expected = (self.num_layers * directions, batch, size)
            if tuple(state.shape) != expected:
                raise ShapeError(
                    f"Expected hidden size {expected}, got {list(state.shape)}"
                )
            out.append(state)
        return out

    def _run_layers(self, x: Tensor, state: list) -> tuple:
        directions = 2 if self.bidirectional else 1
        finals: list[list[Tensor]] = [[] for _ in state]
        for layer in range(self.num_layers):
            outputs = []
            for direction in range(directions):
                index = layer * directions + direction
                start = tuple(s[index] for s in state)
                out, last = self._run_direction(x, start, layer, direction)
                outputs.append(out)
                for bucket, value in zip(finals, last):
                    bucket.append(value)
            x = outputs[0] if directions == 1 else cat(outputs, dim=-1)
            if self.dropout and self.training and layer < self.num_layers - 1:
                x = F.dropout(x, self.dropout, training=True)
        return x, [stack(bucket, dim=0) for bucket in finals]

    def _run_direction(self, x: Tensor, start: tuple, layer: int, direction: int) -> tuple:
        """One layer in one direction over the whole sequence: (outputs (T, B, H), finals)."""
        w_ih, w_hh, b_ih, b_hh, w_hr = self._weights(layer, direction)
        projected = F.linear(x, w_ih, b_ih)  # every time step's input projection in one GEMM
        steps = range(x.shape[0] - 1, -1, -1) if direction else range(x.shape[0])
        outputs: list[Tensor | None] = [None] * x.shape[0]
        if self.mode == "LSTM":
            state = start
            for t in steps:
                state = lstm_step(projected[t], state, w_hh, b_hh, w_hr)
                outputs[t] = state[0]
            return stack(outputs, dim=0), state
        step = gru_step if self.mode == "GRU" else rnn_step(self.mode)
        (h,) = start
        for t in steps:
            h = step(projected[t], h, w_hh, b_hh)
            outputs[t] = h
        return stack(outputs, dim=0), (h,)

    def extra_repr(self) -> str:
        text = f"{self.input_size}, {self.hidden_size}"
        if self.proj_size:
            text += f", proj_size={self.proj_size}"
        for name, default in (("num_layers", 1), ("bias", True), ("batch_first", False),
                              ("dropout", 0.0), ("bidirectional", False)):
            if getattr(self, name) != default:
                text += f", {name}={getattr(self, name)}"
        return text


def _check_sizes(mode: str, hidden: int, layers: int, dropout: float, proj: int) -> None:
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout <= 1:
        raise ValueError(
            "dropout should be a number in range [0, 1] representing the probability of an "
            "element being zeroed"
        )
    if not isinstance(hidden, int) or hidden <= 0:
        raise ValueError("hidden_size must be greater than zero")
    if not isinstance(layers, int) or layers <= 0:
        raise ValueError("num_layers must be greater than zero")
    if proj < 0:
        raise ValueError("proj_size should be a positive integer or zero to disable projections")
    if proj and proj >= hidden:
        raise ValueError("proj_size has to be smaller than hidden_size")
    if proj and mode != "LSTM":
        raise ValueError("proj_size argument is only supported for LSTM, not RNN or GRU")


class RNN(RNNBase):
    """Elman RNN: h' = tanh (or relu)(W_ih x + b_ih + W_hh h + b_hh), stacked."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 nonlinearity: str = "tanh", bias: bool = True, batch_first: bool = False,
                 dropout: float = 0.0, bidirectional: bool = False, device: Any = None,
                 dtype: Any = None) -> None:
        modes = {"tanh": "RNN_TANH", "relu": "RNN_RELU"}
        if nonlinearity not in modes:
            raise ValueError(f"Unknown nonlinearity '{nonlinearity}'. Select from 'tanh' or 'relu'.")
        super().__init__(modes[nonlinearity], input_size, hidden_size, num_layers, bias,
                         batch_first, dropout, bidirectional, 0, device, dtype)
        self.nonlinearity = nonlinearity


class LSTM(RNNBase):
    """Long short-term memory, stacked, with an optional projection of h (proj_size)."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, proj_size: int = 0, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__("LSTM", input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, proj_size, device, dtype)


class GRU(RNNBase):
    """Gated recurrent unit, stacked."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, device: Any = None, dtype: Any = None) -> None:
        super().__init__("GRU", input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, 0, device, dtype)
