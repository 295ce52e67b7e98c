"""scaled_dot_product_attention as one graph node: softmax(q k^T * scale + mask) v.

One node instead of five (matmul, scale, mask, softmax, matmul) keeps the probabilities for the
backward pass and lets it run four batched GEMMs and one fused softmax gradient.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shoal.core import backend
from shoal.core.amp.autocast_mode import STATE as _AMP
from shoal.core.ops import _autocast
from shoal.core.errors import ShapeError
from shoal.core.ops import random as _random
from shoal.core.ops._opmath import widen
from shoal.core.ops._promote import as_dtype, result_dtype
from shoal.core.ops._util import needs_grad, result, unbroadcast, val, xp_of
from shoal.core.tensor import Tensor


def scaled_dot_product_attention(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Any = None, dropout_p: float = 0.0,
    is_causal: bool = False, scale: float | None = None,
) -> Tensor:
    """torch's F.scaled_dot_product_attention: a boolean mask keeps True entries, a float mask
    adds (in the query's dtype, as torch casts it); the output has the query's dtype."""
    if _AMP.active:
        query, key, value, attn_mask = _autocast.cast(
            "scaled_dot_product_attention", query, key, value, attn_mask
        )
    qd, kd, vd = query.array, key.array, value.array
    _check_arguments(qd, kd, vd, attn_mask, dropout_p, is_causal)
    xp = xp_of(qd)
    sc = 1.0 / math.sqrt(qd.shape[-1]) if scale is None else float(scale)
    # 16-bit inputs are computed on in float32 (scores, softmax, both products) and the output
    # rounded once, as torch's CPU attention kernels; the backward widens them again rather
    # than keep float32 copies alive between the passes.
    scores = widen(qd) @ widen(kd).swapaxes(-1, -2)
    scores *= sc
    md, mask_dtype = _mask_array(attn_mask, is_causal, xp, qd.shape[-2], kd.shape[-2], qd.dtype)
    if md is not None:
        scores = _apply_mask(scores, md, xp)
    probs = scores - scores.max(axis=-1, keepdims=True)
    xp.exp(probs, out=probs)
    probs /= probs.sum(axis=-1, keepdims=True)
    # A row with every key masked out is NaN, as in torch's math path.
    keep = None
    dropped = probs
    if dropout_p > 0.0:
        gen = _random.generator(xp, backend.device_of(qd).index)
        keep = (gen.random(probs.shape, dtype=np.float32) >= dropout_p) * (1.0 / (1.0 - dropout_p))
        dropped = probs * keep.astype(probs.dtype)
    out = as_dtype(dropped @ widen(vd), result_dtype(qd, kd, vd))
    mask_grad = md is not None and md.dtype != bool and needs_grad(attn_mask)

    def backward(g: Any) -> tuple:
        gq = gk = gv = gmask = None
        g = widen(g)
        if needs_grad(value):
            gv = as_dtype(unbroadcast(dropped.swapaxes(-1, -2) @ g, vd.shape), vd.dtype)
        gp = g @ widen(vd).swapaxes(-1, -2)
        if keep is not None:
            gp *= keep
        gs = probs * (gp - (gp * probs).sum(axis=-1, keepdims=True))
        if mask_grad:
            gmask = as_dtype(unbroadcast(gs, md.shape), mask_dtype)
        # not in place: a full-shape mask's gradient may be gs itself (nothing to sum, no cast)
        gs = gs * sc
        if needs_grad(query):
            gq = as_dtype(unbroadcast(gs @ widen(kd), qd.shape), qd.dtype)
        if needs_grad(key):
            gk = as_dtype(unbroadcast(gs.swapaxes(-1, -2) @ widen(qd), kd.shape),
                          kd.dtype)
        return gq, gk, gv, gmask

    return result(out, "ScaledDotProductAttentionBackward", backward,
                  (query, key, value, attn_mask), exact_dtype=True)


def _check_arguments(
    qd: Any, kd: Any, vd: Any, attn_mask: Any, dropout_p: float, is_causal: bool
) -> None:
    """Refuse shapes that do not fit together, a mask with is_causal, a dropout outside [0, 1)."""
    if qd.ndim < 2 or kd.ndim != qd.ndim or vd.ndim != qd.ndim:
        raise ShapeError(
            f"scaled_dot_product_attention: query, key and value must have the same number of "
            f"dims (at least 2), got {tuple(qd.shape)}, {tuple(kd.shape)}, {tuple(vd.shape)}."
        )
    if qd.shape[-1] != kd.shape[-1] or kd.shape[-2] != vd.shape[-2]:
        raise ShapeError(
            f"scaled_dot_product_attention: query {tuple(qd.shape)} and key {tuple(kd.shape)} "
            f"must share the last dim, key and value {tuple(vd.shape)} the sequence dim."
        )
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: pass either attn_mask or is_causal, not both.")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"scaled_dot_product_attention: dropout_p must be in [0, 1), got {dropout_p}.")


def _mask_array(
    attn_mask: Any, is_causal: bool, xp: Any, L: int, S: int, query_dtype: Any
) -> tuple:
    """(the mask as an array or None, the mask's own dtype for its gradient): a causal mask is
    a boolean lower triangle; an additive mask takes the query's dtype (torch's rule)."""
    md = None if attn_mask is None else val(attn_mask)
    if md is not None and not backend.is_array(md):
        md = xp.asarray(md)
    if is_causal:
        md = xp.tril(xp.ones((L, S), dtype=bool))
    mask_dtype = None if md is None else md.dtype
    if md is not None and md.dtype != bool and md.dtype != query_dtype:
        md = md.astype(query_dtype)
    return md, mask_dtype


def _apply_mask(scores: Any, md: Any, xp: Any) -> Any:
    """The scores with a boolean mask's False entries at -inf, or an additive mask added."""
    if md.dtype == bool:
        return xp.where(md, scores, -xp.inf)
    try:
        return scores + widen(md)
    except ValueError as exc:
        raise ShapeError(
            f"scaled_dot_product_attention: attn_mask of shape {tuple(md.shape)} does not "
            f"broadcast to the scores' shape {tuple(scores.shape)}."
        ) from exc
