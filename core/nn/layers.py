"""Layers: Linear, Embedding, LayerNorm, Dropout and the activation modules, as torch.nn."""

from __future__ import annotations

import math
from typing import Any, Sequence

from shoal.core import ops as _ops  # noqa: F401 - ensures Tensor's methods are bound
from shoal.core.nn import functional as F
from shoal.core.nn import init
from shoal.core.nn import losses_functional as _losses
from shoal.core.nn.module import Module
from shoal.core.nn.parameter import Parameter
from shoal.core.ops import creation


def _empty(shape: tuple, device: Any, dtype: Any) -> Parameter:
    return Parameter(creation.empty(*shape, dtype=dtype, device=device))


class Linear(Module):
    """y = x @ weight.T + bias; weight (out_features, in_features), torch's default init."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True,
        device: Any = None, dtype: Any = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _empty((out_features, in_features), device, dtype)
        if bias:
            self.bias = _empty((out_features,), device, dtype)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """kaiming_uniform(a=sqrt(5)) for the weight, U(+-1/sqrt(fan_in)) for the bias."""
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
            init.uniform_(self.bias, -bound, bound)

    def forward(self, input: Any) -> Any:  # noqa: A002 - torch's name
        return F.linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class Embedding(Module):
    """A lookup table of num_embeddings vectors of size embedding_dim, initialised N(0, 1)."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
        device: Any = None, dtype: Any = None,
    ) -> None:
        super().__init__()
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(
                    f"Embedding padding_idx={padding_idx} must lie within the table of "
                    f"{num_embeddings} rows."
                )
            padding_idx = padding_idx % num_embeddings
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.weight = _empty((num_embeddings, embedding_dim), device, dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 1), with the padding row zeroed."""
        init.normal_(self.weight)
        if self.padding_idx is not None:
            self.weight.array[self.padding_idx] = 0

    def forward(self, input: Any) -> Any:  # noqa: A002
        return F.embedding(input, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"


class EmbeddingBag(Module):
    """Sums, means or maxima of bags of embeddings, without building the (N, L, D) lookup."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, max_norm: float | None = None,
        norm_type: float = 2.0, scale_grad_by_freq: bool = False, mode: str = "mean",
        sparse: bool = False, _weight: Any = None, include_last_offset: bool = False,
        padding_idx: int | None = None, device: Any = None, dtype: Any = None,
    ) -> None:
        super().__init__()
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError("padding_idx must be within num_embeddings")
            padding_idx = padding_idx % num_embeddings
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.mode = mode
        self.sparse = sparse
        self.include_last_offset = include_last_offset
        self.padding_idx = padding_idx
        if _weight is None:
            self.weight = _empty((num_embeddings, embedding_dim), device, dtype)
            self.reset_parameters()
        else:
            self.weight = Parameter(_weight)

    def reset_parameters(self) -> None:
        """N(0, 1), with the padding row zeroed."""
        init.normal_(self.weight)
        if self.padding_idx is not None:
            self.weight.array[self.padding_idx] = 0

    def forward(self, input: Any, offsets: Any = None, per_sample_weights: Any = None) -> Any:  # noqa: A002
        return _losses.embedding_bag(
            input, self.weight, offsets, self.max_norm, self.norm_type,
            self.scale_grad_by_freq, self.mode, self.sparse, per_sample_weights,
            self.include_last_offset, self.padding_idx,
        )

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}"


class LayerNorm(Module):
    """Normalise over the trailing normalized_shape dims, then scale (ones) and shift (zeros)."""

    def __init__(
        self, normalized_shape: int | Sequence[int], eps: float = 1e-5,
        elementwise_affine: bool = True, bias: bool = True, device: Any = None, dtype: Any = None,
    ) -> None:
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = _empty(self.normalized_shape, device, dtype)
            if bias:
                self.bias = _empty(self.normalized_shape, device, dtype)
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """weight = 1, bias = 0."""
        if self.weight is not None:
            init.ones_(self.weight)
        if self.bias is not None:
            init.zeros_(self.bias)

    def forward(self, input: Any) -> Any:  # noqa: A002
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class Dropout(Module):
    """Zero elements with probability p while training (scaling the rest by 1/(1-p))."""

    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p = p
        self.inplace = inplace

    def forward(self, input: Any) -> Any:  # noqa: A002
        return F.dropout(input, self.p, training=self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}"


class ReLU(Module):
    """max(x, 0)."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace

    def forward(self, input: Any) -> Any:  # noqa: A002
        return F.relu(input)


class GELU(Module):
    """x * Phi(x), exact or approximate='tanh'."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, input: Any) -> Any:  # noqa: A002
        return F.gelu(input, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class Tanh(Module):
    """tanh(x)."""

    def forward(self, input: Any) -> Any:  # noqa: A002
        return F.tanh(input)


class Sigmoid(Module):
    """1 / (1 + exp(-x))."""

    def forward(self, input: Any) -> Any:  # noqa: A002
        return F.sigmoid(input)


class Identity(Module):
    """Returns its input."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def forward(self, input: Any) -> Any:  # noqa: A002
        return input
