"""Fused neural-network ops: linear, embedding, layer_norm, dropout, the losses, one_hot."""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.core import backend
from shoal.core import kernels as _kernels
from shoal.core.errors import ShapeError
from shoal.core.amp.autocast_mode import STATE as _AMP
from shoal.core.ops import _autocast
from shoal.core.ops import random as _random
from shoal.core.ops._opmath import compute_dtype, narrow, widen, widen_bf16
from shoal.core.ops._promote import (
    as_dtype, is_reduced_float, norm_output_dtype, result_dtype,
)
from shoal.core.ops._util import (
    broadcast_error, cj, needs_grad, real_grad, result, unbroadcast, val, xp_of,
)
from shoal.core.ops.shape import _scatter_add
from shoal.core.tensor import Tensor, wrap

_REDUCTIONS = ("mean", "sum", "none")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias as one node; weight has shape (out_features, in_features)."""
    if _AMP.active:
        x, weight, bias = _autocast.cast("linear", x, weight, bias)
    xd, wd = x.array, weight.array
    bd = None if bias is None else bias.array
    if wd.ndim != 2 or xd.ndim == 0 or xd.shape[-1] != wd.shape[1]:
        raise ShapeError(
            f"linear: input of shape {tuple(xd.shape)} does not fit weight of shape "
            f"{tuple(wd.shape)} (weight is (out_features, in_features), so the input's last "
            f"dim must be {wd.shape[1] if wd.ndim == 2 else '?'})."
        )
    if bd is not None and bd.shape != (wd.shape[0],):
        raise ShapeError(
            f"linear: bias of shape {tuple(bd.shape)} does not match weight of shape "
            f"{tuple(wd.shape)}; expected ({wd.shape[0]},)."
        )
    dt = result_dtype(xd, wd) if bd is None else result_dtype(xd, wd, bd)
    # One 2-D GEMM over all leading dims: numpy's matmul runs a 3-D operand as a loop of small
    # per-batch GEMMs, several times slower than one tall GEMM on the same data. 16-bit
    # operands go through float32 BLAS (ml_dtypes' bfloat16 matmul widens internally anyway;
    # numpy's float16 one has no BLAS): float32 accumulation and the bias added before the
    # one rounding, as torch's CPU GEMMs do.
    lead = xd.shape[:-1]
    x2 = xd.reshape(-1, xd.shape[-1]) if xd.ndim != 2 else xd
    out2 = widen(x2) @ widen(wd).T  # BLAS reads the transpose: no copy
    if bd is not None:
        out2 += widen(bd)
    out2 = narrow(out2, dt)
    out = out2.reshape(lead + (wd.shape[0],)) if xd.ndim != 2 else out2

    def backward(g: Any) -> tuple:
        gx = gw = gb = None
        g2 = widen(g.reshape(-1, g.shape[-1]) if g.ndim != 2 else g)
        # Conjugated for complex operands, the real part for a real operand of a complex product.
        if needs_grad(x):
            gx = as_dtype(real_grad((g2 @ cj(widen(wd))).reshape(xd.shape), xd), xd.dtype)
        if needs_grad(weight):
            gw = as_dtype(real_grad(g2.T @ cj(widen(x2)), wd), wd.dtype)
        if bias is not None and bias.requires_grad:
            gb = as_dtype(real_grad(g2.sum(axis=0), bd), bd.dtype)  # float32 sums for 16 bits
        return gx, gw, gb

    return result(out, "AddmmBackward", backward, (x, weight, bias), exact_dtype=True)


def embedding(input: Any, weight: Tensor, padding_idx: int | None = None) -> Tensor:  # noqa: A002
    """Rows of weight picked by integer indices; the padding row gets no gradient."""
    idx = val(input)
    wd = weight.array
    xp = xp_of(wd)
    if not backend.is_array(idx):
        idx = xp.asarray(idx)
    if idx.dtype.kind not in "iu":
        raise ShapeError(f"embedding: indices must be integers, got dtype {idx.dtype}.")
    if idx.size and (int(idx.max()) >= wd.shape[0] or int(idx.min()) < -wd.shape[0]):
        raise ShapeError(
            f"embedding: index out of range for a table of {wd.shape[0]} rows "
            f"(indices span {int(idx.min())}..{int(idx.max())})."
        )
    out = xp.take(wd, idx, axis=0)

    def backward(g: Any) -> tuple:
        gw = xp.zeros(wd.shape, dtype=g.dtype)
        _scatter_add(xp, gw, idx.reshape(-1), g.reshape(-1, wd.shape[1]))
        if padding_idx is not None:
            gw[padding_idx] = 0
        return None, gw

    return result(out, "EmbeddingBackward", backward, (input, weight))


def layer_norm(
    x: Tensor,
    normalized_shape: Any,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """Normalise over the trailing `normalized_shape` dims, then scale and shift.

    A bfloat16/float16 input is normalised in float32 (torch's "opmath") and, with float32
    weight and bias, comes out in its own dtype, as torch's mixed-dtype layer_norm.
    """
    if _AMP.active:
        x, weight, bias = _autocast.cast("layer_norm", x, weight, bias)
    xd = x.array
    xp = xp_of(xd)
    out_dtype = norm_output_dtype(xd.dtype, weight, bias)
    if is_reduced_float(xd.dtype):
        xd = xd.astype(xp.float32)
    norm = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    k = len(norm)
    if tuple(xd.shape[xd.ndim - k :]) != norm or k == 0:
        raise ShapeError(
            f"layer_norm: normalized_shape {norm} does not match the trailing dims of input "
            f"shape {tuple(xd.shape)}."
        )
    axes = tuple(range(xd.ndim - k, xd.ndim))
    lead = tuple(range(xd.ndim - k))
    mu = xd.mean(axis=axes, keepdims=True)
    xc = xd - mu
    var = (xc * xc).mean(axis=axes, keepdims=True)
    rstd = 1.0 / xp.sqrt(var + eps)
    xhat = xc * rstd
    wd = None if weight is None else weight.array
    out = xhat * wd if wd is not None else xhat.copy()
    if bias is not None:
        out += bias.array
    out = as_dtype(out, out_dtype)

    def backward(g: Any) -> tuple:
        if g.dtype != xd.dtype and is_reduced_float(g.dtype):
            g = g.astype(xd.dtype)  # the forward's float32 arithmetic, for a 16-bit input
        gxhat = g * wd if wd is not None else g
        gx = gw = gb = None
        if needs_grad(x):
            m1 = gxhat.mean(axis=axes, keepdims=True)
            m2 = (gxhat * xhat).mean(axis=axes, keepdims=True)
            gx = as_dtype((gxhat - m1 - xhat * m2) * rstd, x.array.dtype)
        if needs_grad(weight):
            gw = as_dtype((g * xhat).sum(axis=lead) if lead else g * xhat, weight.array.dtype)
        if needs_grad(bias):
            gb = as_dtype(g.sum(axis=lead) if lead else g.copy(), bias.array.dtype)
        return gx, gw, gb

    return result(out, "LayerNormBackward", backward, (x, weight, bias), exact_dtype=True)


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """Zero each element with probability p and scale the rest by 1/(1-p) (training only)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout: probability must be in [0, 1], got {p}.")
    if not training or p == 0.0:
        return x
    xd = x.array
    xp = xp_of(xd)
    if p == 1.0:
        mask = xp.zeros(xd.shape, dtype=xd.dtype)
    else:
        dev = backend.device_of(xd)
        gen = _random.generator(xp, dev.index)
        keep = gen.random(xd.shape, dtype=np.float32) >= p
        # torch's mask holds 1/(1-p) in the input's dtype: rounded there, then used as is.
        mask = narrow(xp.multiply(keep, 1.0 / (1.0 - p), dtype=compute_dtype(xd.dtype)),
                      xd.dtype)
    dt = xd.dtype
    out = narrow(widen_bf16(xd) * widen_bf16(mask), dt)

    def backward(g: Any) -> tuple:
        return (narrow(widen_bf16(g) * widen_bf16(mask), dt),)

    return result(out, "DropoutBackward", backward, (x,))


def _check_reduction(reduction: str, op: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {_REDUCTIONS}, got {reduction!r}.")


def mse_loss(input: Tensor, target: Any, reduction: str = "mean") -> Tensor:  # noqa: A002
    """Mean (or sum, or elementwise) squared error."""
    if _AMP.active:
        input, target = _autocast.cast(  # noqa: A001 - torch's parameter name
            "mse_loss", input, target)
    _check_reduction(reduction, "mse_loss")
    xd, td = val(input), val(target)
    dt = result_dtype(xd, td)
    try:
        diff = widen(xd) - widen(td)  # float32 for 16-bit operands
    except ValueError as exc:
        raise broadcast_error("mse_loss", xd, td, exc) from exc
    sq = diff * diff
    if reduction == "none":
        out = narrow(sq, dt)
    else:
        out = narrow(xp_of(sq).asarray(sq.sum() if reduction == "sum" else sq.mean()), dt)
    scale = 2.0 / sq.size if reduction == "mean" else 2.0

    def backward(g: Any) -> tuple:
        g = widen(g)
        gd = diff * (g * scale) if reduction != "none" else diff * g * 2.0
        return (
            narrow(unbroadcast(gd, xd.shape), xd.dtype) if needs_grad(input) else None,
            narrow(unbroadcast(-gd, td.shape), td.dtype) if needs_grad(target) else None,
        )

    return result(out, "MseLossBackward", backward, (input, target))


def _class_rows(xd, n_classes: int, xp):
    """Scores of shape (C,), (N, C) or (N, C, d1, ...) as a (rows, C) matrix (a view where
    the layout allows)."""
    if xd.ndim == 1:
        return xd[None, :]
    if xd.ndim == 2:
        return xd
    return xp.moveaxis(xd, 1, -1).reshape(-1, n_classes)


def cross_entropy(
    input: Tensor,  # noqa: A002 - torch's name
    target: Any,
    weight: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """Softmax cross entropy over dim 1 (or the only dim) with class indices or probabilities."""
    if _AMP.active:
        input, target, weight = _autocast.cast(  # noqa: A001 - torch's parameter name
            "cross_entropy", input, target, weight)
    _check_reduction(reduction, "cross_entropy")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}.")
    xd, td = input.array, val(target)
    xp = xp_of(xd)
    if not backend.is_array(td):
        td = xp.asarray(td)
    wv = None if weight is None else widen(val(weight))
    probs_target = td.dtype.kind in "fV"  # ml_dtypes' bfloat16 is kind "V"
    if xd.ndim == 0:
        raise ShapeError("cross_entropy: input must have a class dimension, got a 0-d tensor.")
    n_classes = xd.shape[0] if xd.ndim == 1 else xd.shape[1]
    expected_t = xd.shape if probs_target else (xd.shape[:1] + xd.shape[2:] if xd.ndim > 1 else ())
    if tuple(td.shape) != tuple(expected_t):
        raise ShapeError(
            f"cross_entropy: target of shape {tuple(td.shape)} does not match input of shape "
            f"{tuple(xd.shape)}; expected target shape {tuple(expected_t)}."
        )
    # Work on a (rows, classes) matrix; remember how to map the gradient back. 16-bit logits
    # and probabilities are computed on in float32 and the loss and gradient rounded once.
    x2 = widen(_class_rows(xd, n_classes, xp))
    t2 = td.reshape(-1, n_classes) if probs_target and xd.ndim <= 2 else (
        xp.moveaxis(td, 1, -1).reshape(-1, n_classes) if probs_target else td.reshape(-1)
    )
    if probs_target:
        # Probability targets promote with the logits, as torch's (bfloat16 logits, float32
        # targets).
        dt = xp.result_type(xd.dtype, td.dtype)
        return _soft_cross_entropy(input, target, x2, widen(t2), wv, label_smoothing, reduction,
                                   dt)
    if wv is None and not label_smoothing:
        return _plain_cross_entropy(input, target, x2, t2, ignore_index, reduction)
    return _class_cross_entropy(input, target, x2, t2, wv, ignore_index, label_smoothing,
                                reduction)


def _soft_cross_entropy(
    input: Tensor, target: Any, x2: Any, t2: Any, wv: Any, label_smoothing: float,  # noqa: A002
    reduction: str, dt: Any,
) -> Tensor:
    """Probability targets: the loss of each row is logsumexp * (sum of weighted targets) minus
    the weighted targets' dot product with the logits."""
    xd = input.array
    xp = xp_of(xd)
    rows, n_classes = x2.shape
    e = x2 - x2.max(axis=1, keepdims=True)  # shifted logits; becomes exp() below
    eps = float(label_smoothing)
    tt = t2 * (1.0 - eps) + eps / n_classes if eps else t2
    wt = tt * wv if wv is not None else tt
    shifted_dot = (e * wt).sum(axis=1)
    xp.exp(e, out=e)
    se = e.sum(axis=1)
    lse = xp.log(se)
    loss_rows = lse * wt.sum(axis=1) - shifted_dot
    denom = float(rows) if reduction == "mean" else 1.0
    out = _reduce_loss(loss_rows, denom, reduction, xd, dt)

    def backward(g: Any) -> tuple:
        # d loss_row / d logits = softmax * (sum of target weights) - weighted target.
        r = _row_scale(g, reduction, denom, dt)
        p = e * (1.0 / se)[:, None]  # softmax, in a fresh buffer
        p *= wt.sum(axis=1, keepdims=True)
        p -= wt
        grad = p * (r[:, None] if reduction == "none" else r)
        return _to_input_layout(grad, xd, n_classes).astype(xd.dtype, copy=False), None

    return result(out, "CrossEntropyBackward", backward, (input, target))


def _class_cross_entropy(
    input: Tensor, target: Any, x2: Any, t2: Any, wv: Any, ignore_index: int,  # noqa: A002
    label_smoothing: float, reduction: str,
) -> Tensor:
    """Class indices with class weights or label smoothing (without either, the fused kernels
    of `_plain_cross_entropy` run instead)."""
    xd = input.array
    xp = xp_of(xd)
    rows, n_classes = x2.shape
    dt = xd.dtype
    if t2.dtype.kind not in "iu":
        raise ShapeError(f"cross_entropy: class targets must be integers, got dtype {t2.dtype}.")
    e = x2 - x2.max(axis=1, keepdims=True)  # shifted logits; becomes exp() below
    eps = float(label_smoothing)
    valid = t2 != ignore_index
    all_valid = bool(valid.all())
    safe_t = t2 if all_valid else xp.where(valid, t2, 0)
    _check_classes(t2 if all_valid else t2[valid], n_classes)
    ar = xp.arange(rows)
    picked = e[ar, safe_t]
    smooth_sum = None
    if eps:
        smooth_sum = (e * wv).sum(axis=1) if wv is not None else e.sum(axis=1)
    xp.exp(e, out=e)
    se = e.sum(axis=1)
    lse = xp.log(se)
    if wv is not None:
        row_w = wv[safe_t]
        if not all_valid:
            row_w = row_w * valid
    else:
        row_w = None if all_valid else valid.astype(compute_dtype(dt))
    nll = lse - picked
    loss_rows = nll * row_w if row_w is not None else nll
    if eps:
        wsum = float(wv.sum()) if wv is not None else float(n_classes)
        smooth = (lse * wsum - smooth_sum) / n_classes
        if not all_valid:
            smooth = smooth * valid
        loss_rows = loss_rows * (1.0 - eps) + smooth * eps
    if reduction == "mean":
        denom = float(row_w.sum()) if row_w is not None else float(rows)
    else:
        denom = 1.0
    out = _reduce_loss(loss_rows, denom, reduction, xd, dt)

    def backward(g: Any) -> tuple:
        # d loss_row / d logits = softmax * (sum of target weights) - weighted target.
        r = _row_scale(g, reduction, denom, dt)
        p = e * (1.0 / se)[:, None]  # softmax, in a fresh buffer
        coef = row_w
        if eps:
            wvec = wv if wv is not None else 1.0
            wsum = float(wv.sum()) if wv is not None else float(n_classes)
            vmask = valid[:, None] if not all_valid else 1.0
            base = p * ((1.0 - eps) * (coef[:, None] if coef is not None else 1.0))
            base += (p * wsum - wvec) * (eps / n_classes) * vmask
            base[ar, safe_t] -= (1.0 - eps) * (coef if coef is not None else 1.0)
            grad = base
        else:
            if coef is not None:
                p *= coef[:, None]
                p[ar, safe_t] -= coef
            else:
                p[ar, safe_t] -= 1.0
            grad = p
        grad *= r[:, None] if reduction == "none" else r
        return _to_input_layout(grad, xd, n_classes).astype(xd.dtype, copy=False), None

    return result(out, "CrossEntropyBackward", backward, (input, target))


def _reduce_loss(loss_rows: Any, denom: float, reduction: str, xd: Any, dt: Any) -> Any:
    """The per-row losses as `reduction` asks: in the target's shape, summed, or their mean
    over `denom` (the rows, or their total class weight)."""
    if reduction == "none":
        out_shape = xd.shape[:1] + xd.shape[2:] if xd.ndim > 1 else ()
        return loss_rows.reshape(out_shape).astype(dt, copy=False)
    total = loss_rows.sum()
    return xp_of(xd).asarray(total / denom if reduction == "mean" else total, dtype=dt)


def _row_scale(g: Any, reduction: str, denom: float, dt: Any) -> Any:
    """The output gradient as each row's factor: one per row for "none", else one scalar."""
    g = widen(g)
    if reduction == "none":
        return g.reshape(-1).astype(compute_dtype(dt), copy=False)
    return g / denom if reduction == "mean" else g


def _to_input_layout(grad: Any, xd: Any, n_classes: int) -> Any:
    """A (rows, C) gradient back in the input's layout: (C,), or (N, C, d1, ...) from classes-last."""
    if xd.ndim == 1:
        return grad.reshape(xd.shape)
    if xd.ndim > 2:
        moved = (xd.shape[0],) + xd.shape[2:] + (n_classes,)
        return xp_of(xd).moveaxis(grad.reshape(moved), -1, 1)
    return grad


def _check_classes(kept: Any, n_classes: int, op: str = "cross_entropy") -> None:
    """Refuse class indices outside [0, C) (ignored rows already removed)."""
    if kept.size and (int(kept.max()) >= n_classes or int(kept.min()) < 0):
        raise ShapeError(
            f"{op}: target class out of range [0, {n_classes}) "
            f"(targets span {int(kept.min())}..{int(kept.max())})."
        )


def _plain_cross_entropy(
    input: Tensor, target: Any, x2: Any, t2: Any, ignore_index: int, reduction: str  # noqa: A002
) -> Tensor:
    """Class indices without weights or smoothing: the fused kernels (numpy reference on cpu)."""
    xd = input.array
    xp = xp_of(xd)
    n_classes = x2.shape[1]
    if t2.dtype.kind not in "iu":
        raise ShapeError(f"cross_entropy: class targets must be integers, got dtype {t2.dtype}.")
    valid = t2 != ignore_index
    _check_classes(t2[valid], n_classes)
    loss_rows, lse = _kernels.cross_entropy_forward(x2, t2, ignore_index)
    dt = xd.dtype
    if reduction == "none":
        out = loss_rows.reshape(xd.shape[:1] + xd.shape[2:] if xd.ndim > 1 else ()).astype(dt, copy=False)
        denom = 1.0
    else:
        denom = float(valid.sum()) if reduction == "mean" else 1.0
        total = loss_rows.sum()
        out = xp.asarray(total / denom if reduction == "mean" else total, dtype=dt)

    def backward(g: Any) -> tuple:
        g = widen(g)
        rows = g.reshape(-1) if reduction == "none" else (g / denom if reduction == "mean" else g)
        grad = _kernels.cross_entropy_backward(x2, t2, lse, rows, ignore_index)
        return narrow(_to_input_layout(grad, xd, n_classes), dt), None

    return result(out, "CrossEntropyBackward", backward, (input, target))


def nll_loss(
    input: Tensor, target: Any, weight: Tensor | None = None, ignore_index: int = -100,  # noqa: A002
    reduction: str = "mean",
) -> Tensor:
    """Negative log likelihood of log-probabilities over dim 1 (or the only dim), as torch's."""
    if _AMP.active:
        input, target, weight = _autocast.cast(  # noqa: A001 - torch's parameter name
            "nll_loss", input, target, weight)
    _check_reduction(reduction, "nll_loss")
    xd, td = input.array, val(target)
    xp = xp_of(xd)
    if not backend.is_array(td):
        td = xp.asarray(td)
    if xd.ndim == 0:
        raise ShapeError("nll_loss: input must have a class dimension, got a 0-d tensor.")
    n_classes = xd.shape[0] if xd.ndim == 1 else xd.shape[1]
    expected_t = xd.shape[:1] + xd.shape[2:] if xd.ndim > 1 else ()
    if tuple(td.shape) != tuple(expected_t):
        raise ShapeError(
            f"nll_loss: target of shape {tuple(td.shape)} does not match input of shape "
            f"{tuple(xd.shape)}; expected target shape {tuple(expected_t)}."
        )
    if td.dtype.kind not in "iu":
        raise ShapeError(f"nll_loss: class targets must be integers, got dtype {td.dtype}.")
    x2 = _class_rows(xd, n_classes, xp)
    t2 = td.reshape(-1)
    valid = t2 != ignore_index
    _check_classes(t2[valid], n_classes, "nll_loss")
    safe_t = xp.where(valid, t2, 0)
    # The picked log-probabilities and weights in float32 for 16-bit inputs: the sums below
    # accumulate there, and the loss is rounded once, as torch's.
    row_w = valid.astype(compute_dtype(xd.dtype))
    if weight is not None:
        row_w = row_w * widen(val(weight)[safe_t])
    rows = xp.arange(t2.shape[0])
    loss_rows = -widen(x2[rows, safe_t]) * row_w
    # torch divides by the summed weights of the kept rows: 0/0 = nan when all are ignored.
    denom = row_w.sum() if reduction == "mean" else None
    if reduction == "none":
        none_dt = xd.dtype if weight is None else result_dtype(xd, val(weight))
        out = narrow(loss_rows.reshape(expected_t), none_dt)
    elif reduction == "sum":
        out = xp.asarray(loss_rows.sum(), dtype=xd.dtype)
    else:
        with np.errstate(invalid="ignore", divide="ignore"):
            out = xp.asarray(loss_rows.sum() / denom, dtype=xd.dtype)

    def backward(g: Any) -> tuple:
        g = widen(g)
        if reduction == "none":
            r = g.reshape(-1) * row_w
        elif reduction == "sum":
            r = g * row_w
        else:
            with np.errstate(invalid="ignore", divide="ignore"):
                r = g * row_w / denom
        grad = xp.zeros_like(x2)
        grad[rows, safe_t] = -r
        return _to_input_layout(grad, xd, n_classes), None

    return result(out, "NllLossBackward", backward, (input, target))


def one_hot(tensor: Any, num_classes: int = -1) -> Tensor:
    """int64 one-hot encoding with a new last dim of num_classes (inferred as max + 1 if -1)."""
    td = val(tensor)
    xp = xp_of(td) if backend.is_array(td) else np
    if td.dtype.kind not in "iu":
        raise ShapeError(f"one_hot: only integer (class index) tensors apply, got dtype {td.dtype}.")
    if num_classes == -1:
        if td.size == 0:
            raise ShapeError(
                "one_hot: cannot infer the number of classes from an empty tensor; "
                "pass num_classes."
            )
        num_classes = int(td.max()) + 1
    if td.size and int(td.min()) < 0:
        raise ShapeError(f"one_hot: class values must be non-negative, got {int(td.min())}.")
    if td.size and int(td.max()) >= num_classes:
        raise ShapeError(
            f"one_hot: class values must be smaller than num_classes={num_classes}, "
            f"got {int(td.max())}."
        )
    out = (td[..., None] == xp.arange(num_classes)).astype(np.int64)
    return wrap(out)  # integer output: no gradient flows through it, as in torch
