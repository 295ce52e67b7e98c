"""TransformerEncoderLayer and TransformerEncoder with torch's structure and state_dict keys."""

from __future__ import annotations

import copy
from typing import Any, Callable

from shoal.core.nn import functional as F
from shoal.core.nn.attention import MultiheadAttention
from shoal.core.nn.containers import ModuleList
from shoal.core.nn.layers import Dropout, LayerNorm, Linear
from shoal.core.nn.module import Module
from shoal.core.tensor import Tensor

_ACTIVATIONS: dict[str, Callable] = {"relu": F.relu, "gelu": F.gelu}


def resolve_activation(activation: str | Callable) -> Callable:
    """A layer's activation: a callable as it is, or "relu"/"gelu" by name (torch's error else)."""
    if not isinstance(activation, str):
        return activation
    if activation not in _ACTIVATIONS:
        raise RuntimeError(f"activation should be relu/gelu, not {activation}")
    return _ACTIVATIONS[activation]


class TransformerEncoderLayer(Module):
    """Self-attention then a feed-forward block, each with a residual, post- or pre-norm."""

    def __init__(
        self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
        activation: str | Callable = "relu", layer_norm_eps: float = 1e-5,
        batch_first: bool = False, norm_first: bool = False, bias: bool = True,
        device: Any = None, dtype: Any = None,
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                            batch_first=batch_first, **kw)
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, **kw)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, **kw)
        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.activation = resolve_activation(activation)

    def forward(
        self, src: Tensor, src_mask: Any = None, src_key_padding_mask: Any = None,
        is_causal: bool = False,
    ) -> Tensor:
        """One encoder layer over src ((N, S, E) with batch_first, else (S, N, E))."""
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x

    def _sa_block(self, x: Tensor, attn_mask: Any, key_padding_mask: Any, is_causal: bool) -> Tensor:
        out = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                             need_weights=False, is_causal=is_causal)[0]
        return self.dropout1(out)

    def _ff_block(self, x: Tensor) -> Tensor:
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))


class TransformerEncoder(Module):
    """num_layers deep copies of encoder_layer, then an optional final norm."""

    def __init__(
        self, encoder_layer: TransformerEncoderLayer, num_layers: int, norm: Module | None = None,
        enable_nested_tensor: bool = True, mask_check: bool = True,
    ) -> None:
        super().__init__()
        self.layers = ModuleList([copy.deepcopy(encoder_layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm

    def forward(
        self, src: Tensor, mask: Any = None, src_key_padding_mask: Any = None,
        is_causal: bool | None = None,
    ) -> Tensor:
        """Run every layer in turn with the same masks."""
        x = src
        for layer in self.layers:
            x = layer(x, src_mask=mask, src_key_padding_mask=src_key_padding_mask,
                      is_causal=bool(is_causal))
        return self.norm(x) if self.norm is not None else x
