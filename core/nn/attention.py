"""MultiheadAttention with torch's parameters (in_proj_weight, in_proj_bias, out_proj) and masks."""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.core import backend
from shoal.core.errors import ShapeError
from shoal.core.nn import functional as F
from shoal.core.nn import init
from shoal.core.nn.layers import Linear
from shoal.core.nn.module import Module
from shoal.core.nn.parameter import Parameter
from shoal.core.ops import creation
from shoal.core.ops.shape import cat
from shoal.core.ops._util import val, xp_of
from shoal.core.tensor import Tensor


def merge_masks(
    attn_mask: Any, key_padding_mask: Any, batch: int, heads: int, length: int, source: int,
    dtype: Any, is_causal: bool = False,
) -> Any:
    """One additive float mask (broadcastable to (N, H, L, S)) from torch's MHA masks, or None.

    Boolean masks follow MultiheadAttention's convention: True means "do not attend" (the
    opposite of scaled_dot_product_attention's), so they turn into -inf.
    """
    merged = None
    if attn_mask is None and is_causal:
        attn_mask = np.triu(np.ones((length, source), dtype=bool), 1)
    if attn_mask is not None:
        m = val(attn_mask)
        if not backend.is_array(m):
            m = np.asarray(m)
        xp = xp_of(m)
        if m.dtype == bool:
            m = xp.where(m, -xp.inf, 0.0).astype(dtype)
        if m.ndim == 3:
            if m.shape[0] != batch * heads:
                raise ShapeError(
                    f"MultiheadAttention: a 3-d attn_mask must have batch * num_heads = "
                    f"{batch * heads} as its first dim, got shape {tuple(m.shape)}."
                )
            m = m.reshape(batch, heads, length, source)
        elif m.shape != (length, source):
            raise ShapeError(
                f"MultiheadAttention: attn_mask of shape {tuple(m.shape)} should be "
                f"({length}, {source}) or ({batch * heads}, {length}, {source})."
            )
        merged = m
    if key_padding_mask is not None:
        k = val(key_padding_mask)
        if not backend.is_array(k):
            k = np.asarray(k)
        xp = xp_of(k)
        if tuple(k.shape) != (batch, source):
            raise ShapeError(
                f"MultiheadAttention: key_padding_mask of shape {tuple(k.shape)} should be "
                f"({batch}, {source})."
            )
        k = xp.where(k, -xp.inf, 0.0).astype(dtype) if k.dtype == bool else k.astype(dtype)
        k = k.reshape(batch, 1, 1, source)
        merged = k if merged is None else merged + k
    return merged


def _trainable_mask(attn_mask: Any) -> bool:
    return (isinstance(attn_mask, Tensor) and attn_mask.requires_grad
            and attn_mask.dtype.is_floating_point)


def _on_device_with_extra_keys(mask: Any, q: Tensor, extra: int) -> Any:
    """The additive mask on q's device, extended with zeros for the keys MHA added (bias_k,
    a zero attention column): those are never masked."""
    if mask is None:
        return None
    mask = backend.to_device(mask, backend.device_of(q.array))
    if extra:
        xp = xp_of(mask)
        mask = xp.concatenate(
            [mask, xp.zeros(mask.shape[:-1] + (extra,), dtype=mask.dtype)], axis=-1)
    return mask


class MultiheadAttention(Module):
    """Attention over num_heads heads of embed_dim // num_heads each, as torch.nn.MultiheadAttention."""

    def __init__(
        self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
        add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
        vdim: int | None = None, batch_first: bool = False, device: Any = None, dtype: Any = None,
    ) -> None:
        super().__init__()
        if (kdim not in (None, embed_dim)) or (vdim not in (None, embed_dim)):
            raise NotImplementedError(
                "MultiheadAttention: kdim/vdim other than embed_dim are not supported."
            )
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.in_proj_weight = Parameter(creation.empty(3 * embed_dim, embed_dim, dtype=dtype, device=device))
        if bias:
            self.in_proj_bias = Parameter(creation.empty(3 * embed_dim, dtype=dtype, device=device))
        else:
            self.register_parameter("in_proj_bias", None)
        if add_bias_kv:
            self.bias_k = Parameter(creation.empty(1, 1, embed_dim, dtype=dtype, device=device))
            self.bias_v = Parameter(creation.empty(1, 1, embed_dim, dtype=dtype, device=device))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            init.zeros_(self.in_proj_bias)
            init.zeros_(self.out_proj.bias)
        if self.bias_k is not None:
            init.xavier_normal_(self.bias_k)
            init.xavier_normal_(self.bias_v)

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple:
        w, b = self.in_proj_weight, self.in_proj_bias
        if query is key and key is value:
            # Self-attention: one GEMM for q, k and v.
            return F.linear(query, w, b).chunk(3, dim=-1)
        e = self.embed_dim
        bs = (None, None, None) if b is None else (b[:e], b[e : 2 * e], b[2 * e :])
        return (F.linear(query, w[:e], bs[0]), F.linear(key, w[e : 2 * e], bs[1]),
                F.linear(value, w[2 * e :], bs[2]))

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Any = None,
        need_weights: bool = True, attn_mask: Any = None, average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """(attn_output, attention weights averaged over heads, or None if not need_weights)."""
        unbatched = query.ndim == 2
        same = query is key and key is value
        if unbatched or self.batch_first:
            # To torch's internal (L, N, E) layout; self-attention keeps one tensor for all three.
            move = (lambda t: t.unsqueeze(1)) if unbatched else (lambda t: t.transpose(0, 1))
            query = move(query)
            key, value = (query, query) if same else (move(key), move(value))
            if unbatched and key_padding_mask is not None:
                key_padding_mask = np.asarray(val(key_padding_mask))[None]
        # Now (L, N, E) as torch's kernel; work in (N, H, L, D).
        length, batch, e = query.shape
        source = key.shape[0]
        if e != self.embed_dim:
            raise ShapeError(
                f"MultiheadAttention: was expecting embedding dimension of {self.embed_dim}, "
                f"but got {e}."
            )
        q, k, v = self._project(query, key, value)
        h, d = self.num_heads, self.head_dim
        if self.bias_k is not None:
            # One more key and value, learned, that every query may attend to (torch's order:
            # after the projection, before the heads split).
            k = cat([k, self.bias_k.expand(1, batch, e)], dim=0)
            v = cat([v, self.bias_v.expand(1, batch, e)], dim=0)
        extra = k.shape[0] - source
        q = q.reshape(length, batch, h, d).permute(1, 2, 0, 3)
        k = k.reshape(source + extra, batch, h, d).permute(1, 2, 0, 3)
        v = v.reshape(source + extra, batch, h, d).permute(1, 2, 0, 3)
        if self.add_zero_attn:
            zeros = creation.zeros(batch, h, 1, d, dtype=k.dtype, device=k.device)
            k, v = cat([k, zeros], dim=2), cat([v, zeros], dim=2)
            extra += 1
        mask = merge_masks(attn_mask, key_padding_mask, batch, h, length, source,
                           q.array.dtype, is_causal)
        mask = _on_device_with_extra_keys(mask, q, extra)
        if _trainable_mask(attn_mask):
            # a float mask that requires grad stays in the graph (torch gives it a gradient):
            # the fixed parts (key padding, added keys) join it as a constant
            rest = _on_device_with_extra_keys(
                merge_masks(None, key_padding_mask, batch, h, length, source, q.array.dtype),
                q, extra)
            m = attn_mask.reshape(batch, h, length, source) if attn_mask.ndim == 3 else attn_mask
            if extra:
                m = F.pad(m, (0, extra))
            mask = m if rest is None else m + Tensor(rest)
        p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = (q @ k.transpose(-1, -2)) * (1.0 / float(np.sqrt(d)))
            if mask is not None:
                scores = scores + (mask if isinstance(mask, Tensor) else Tensor(mask))
            probs = F.softmax(scores, dim=-1)
            weights = probs.mean(dim=1) if average_attn_weights else probs
            out = F.dropout(probs, p, training=p > 0) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        out = out.permute(2, 0, 1, 3).reshape(length, batch, e)
        out = self.out_proj(out)
        if unbatched:
            out = out.squeeze(1)
            if weights is not None:
                weights = weights.squeeze(0)
        elif self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}"
