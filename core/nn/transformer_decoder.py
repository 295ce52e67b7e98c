"""TransformerDecoderLayer, TransformerDecoder and Transformer with torch's structure, so their
state_dict keys (self_attn, multihead_attn, linear1/2, norm1/2/3; encoder.layers.N...,
decoder.layers.N..., encoder.norm, decoder.norm) are torch's and its checkpoints load."""

from __future__ import annotations

import copy
from typing import Any, Callable

import numpy as np

from shoal.core import dtypes
from shoal.core.nn import functional as F
from shoal.core.nn import init
from shoal.core.nn.attention import MultiheadAttention
from shoal.core.nn.containers import ModuleList
from shoal.core.nn.layers import Dropout, LayerNorm, Linear
from shoal.core.nn.module import Module
from shoal.core.nn.transformer import (
    TransformerEncoder, TransformerEncoderLayer, resolve_activation,
)
from shoal.core.ops import creation
from shoal.core.tensor import Tensor

__all__ = ["TransformerDecoderLayer", "TransformerDecoder", "Transformer"]


def generate_square_subsequent_mask(sz: int, device: Any = None, dtype: Any = None) -> Tensor:
    """An (sz, sz) additive mask: -inf above the diagonal (future positions), 0 elsewhere."""
    mask = np.triu(np.full((sz, sz), -np.inf, dtype=np.float32), 1)
    return creation.tensor(mask, dtype=dtype or dtypes.float32, device=device)


def _detect_is_causal_mask(mask: Any, is_causal: bool | None, size: int | None) -> bool:
    """torch's rule: an explicit is_causal wins; None with a mask asks whether the mask is
    exactly the square subsequent mask."""
    if is_causal is not None or mask is None:
        return bool(is_causal)
    arr = mask.detach().numpy(force=True) if isinstance(mask, Tensor) else np.asarray(mask)
    sz = size if size is not None else arr.shape[-2]
    causal = np.triu(np.full((sz, sz), -np.inf), 1)
    return arr.shape == causal.shape and bool((arr.astype(np.float64) == causal).all())


class TransformerDecoderLayer(Module):
    """Self-attention, attention over the encoder's memory, then a feed-forward block, each with
    a residual, post- or pre-norm."""

    def __init__(
        self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
        activation: str | Callable = F.relu, layer_norm_eps: float = 1e-5,
        batch_first: bool = False, norm_first: bool = False, bias: bool = True,
        device: Any = None, dtype: Any = None,
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                            batch_first=batch_first, **kw)
        self.multihead_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                                 batch_first=batch_first, **kw)
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, **kw)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, **kw)
        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.norm3 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.dropout3 = Dropout(dropout)
        self.activation = resolve_activation(activation)

    def forward(
        self, tgt: Tensor, memory: Tensor, tgt_mask: Any = None, memory_mask: Any = None,
        tgt_key_padding_mask: Any = None, memory_key_padding_mask: Any = None,
        tgt_is_causal: bool = False, memory_is_causal: bool = False,
    ) -> Tensor:
        """One decoder layer over tgt, attending to memory (the encoder's output)."""
        x = tgt
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask, tgt_key_padding_mask, tgt_is_causal)
            x = x + self._mha_block(self.norm2(x), memory, memory_mask,
                                    memory_key_padding_mask, memory_is_causal)
            x = x + self._ff_block(self.norm3(x))
        else:
            x = self.norm1(x + self._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal))
            x = self.norm2(x + self._mha_block(x, memory, memory_mask, memory_key_padding_mask,
                                               memory_is_causal))
            x = self.norm3(x + self._ff_block(x))
        return x

    def _sa_block(self, x: Tensor, attn_mask: Any, key_padding_mask: Any,
                  is_causal: bool) -> Tensor:
        out = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                             is_causal=is_causal, need_weights=False)[0]
        return self.dropout1(out)

    def _mha_block(self, x: Tensor, mem: Tensor, attn_mask: Any, key_padding_mask: Any,
                   is_causal: bool) -> Tensor:
        out = self.multihead_attn(x, mem, mem, attn_mask=attn_mask,
                                  key_padding_mask=key_padding_mask, is_causal=is_causal,
                                  need_weights=False)[0]
        return self.dropout2(out)

    def _ff_block(self, x: Tensor) -> Tensor:
        return self.dropout3(self.linear2(self.dropout(self.activation(self.linear1(x)))))


class TransformerDecoder(Module):
    """num_layers deep copies of decoder_layer, then an optional final norm."""

    def __init__(self, decoder_layer: TransformerDecoderLayer, num_layers: int,
                 norm: Module | None = None) -> None:
        super().__init__()
        self.layers = ModuleList([copy.deepcopy(decoder_layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm

    def forward(
        self, tgt: Tensor, memory: Tensor, tgt_mask: Any = None, memory_mask: Any = None,
        tgt_key_padding_mask: Any = None, memory_key_padding_mask: Any = None,
        tgt_is_causal: bool | None = None, memory_is_causal: bool = False,
    ) -> Tensor:
        """Run every layer in turn with the same memory and masks."""
        seq_len = tgt.shape[1] if self.layers[0].self_attn.batch_first and tgt.ndim == 3 \
            else tgt.shape[0]
        tgt_is_causal = _detect_is_causal_mask(tgt_mask, tgt_is_causal, seq_len)
        x = tgt
        for layer in self.layers:
            x = layer(x, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                      tgt_key_padding_mask=tgt_key_padding_mask,
                      memory_key_padding_mask=memory_key_padding_mask,
                      tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)
        return self.norm(x) if self.norm is not None else x


class Transformer(Module):
    """An encoder-decoder transformer (Vaswani et al.) with torch's arguments and layout."""

    def __init__(
        self, d_model: int = 512, nhead: int = 8, num_encoder_layers: int = 6,
        num_decoder_layers: int = 6, dim_feedforward: int = 2048, dropout: float = 0.1,
        activation: str | Callable = F.relu, custom_encoder: Module | None = None,
        custom_decoder: Module | None = None, layer_norm_eps: float = 1e-5,
        batch_first: bool = False, norm_first: bool = False, bias: bool = True,
        device: Any = None, dtype: Any = None,
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        layer_args = (d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps,
                      batch_first, norm_first, bias)
        if custom_encoder is not None:
            self.encoder = custom_encoder
        else:
            self.encoder = TransformerEncoder(
                TransformerEncoderLayer(*layer_args, **kw), num_encoder_layers,
                LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw))
        if custom_decoder is not None:
            self.decoder = custom_decoder
        else:
            self.decoder = TransformerDecoder(
                TransformerDecoderLayer(*layer_args, **kw), num_decoder_layers,
                LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw))
        for p in self.parameters():  # torch's _reset_parameters: Xavier for every matrix
            if p.ndim > 1:
                init.xavier_uniform_(p)
        self.d_model = d_model
        self.nhead = nhead
        self.batch_first = batch_first

    def forward(
        self, src: Tensor, tgt: Tensor, src_mask: Any = None, tgt_mask: Any = None,
        memory_mask: Any = None, src_key_padding_mask: Any = None,
        tgt_key_padding_mask: Any = None, memory_key_padding_mask: Any = None,
        src_is_causal: bool | None = None, tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
    ) -> Tensor:
        """Encode src, then decode tgt against the encoder's memory."""
        batch_axis = 0 if self.batch_first else 1
        if src.ndim == 3 and src.shape[batch_axis] != tgt.shape[batch_axis]:
            raise RuntimeError("the batch number of src and tgt must be equal")
        if src.shape[-1] != self.d_model or tgt.shape[-1] != self.d_model:
            raise RuntimeError("the feature number of src and tgt must be equal to d_model")
        memory = self.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                              is_causal=src_is_causal)
        return self.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                            tgt_key_padding_mask=tgt_key_padding_mask,
                            memory_key_padding_mask=memory_key_padding_mask,
                            tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)

    generate_square_subsequent_mask = staticmethod(generate_square_subsequent_mask)
