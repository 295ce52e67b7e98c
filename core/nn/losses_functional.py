"""l1_loss, smooth_l1_loss and embedding_bag as torch.nn.functional's (re-exported there).

Each op's forward and backward sit side by side; 16-bit inputs compute in float32 and round
once, as core's other losses do.
"""

from __future__ import annotations

from typing import Any

from shoal.core.errors import ShapeError
from shoal.core.nn._reduction import reduction_of
from shoal.core.ops._autocast import autocast_op
from shoal.core.ops._opmath import narrow, widen
from shoal.core.ops._promote import result_dtype
from shoal.core.ops._util import broadcast_error, needs_grad, result, unbroadcast, val, xp_of
from shoal.core.ops.shape import _scatter_add
from shoal.core.tensor import Tensor

_REDUCTIONS = ("mean", "sum", "none")


def _elementwise_loss(name: str, x: Any, target: Any, reduction: str, value_and_slope: Any,
                      node: str) -> Tensor:
    """A loss of diff = x - target: value_and_slope(diff, xp) gives the elementwise loss
    and its derivative by diff; then torch's reduction."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    xd, td = val(x), val(target)
    dt = result_dtype(xd, td)
    try:
        diff = widen(xd) - widen(td)
    except ValueError as exc:
        raise broadcast_error(name, xd, td, exc) from exc
    xp = xp_of(diff)
    loss, slope = value_and_slope(diff, xp)
    if reduction == "none":
        out = narrow(loss, dt)
    else:
        total = loss.sum() if reduction == "sum" else loss.mean()
        out = narrow(xp.asarray(total), dt)
    scale = 1.0 / max(loss.size, 1) if reduction == "mean" else 1.0

    def backward(g: Any) -> tuple:
        gd = slope * (widen(g) * scale)
        return (
            narrow(unbroadcast(gd, xd.shape), xd.dtype) if needs_grad(x) else None,
            narrow(unbroadcast(-gd, td.shape), td.dtype) if needs_grad(target) else None,
        )

    return result(out, node, backward, (x, target))


@autocast_op("l1_loss")
def l1_loss(input: Tensor, target: Any, size_average: Any = None, reduce: Any = None,  # noqa: A002
            reduction: str = "mean") -> Tensor:
    """Mean (or sum, or elementwise) absolute error; the gradient at 0 is 0, as torch's."""
    reduction = reduction_of(size_average, reduce, reduction)
    return _elementwise_loss(
        "l1_loss", input, target, reduction, lambda d, xp: (xp.abs(d), xp.sign(d)),
        "L1LossBackward",
    )


@autocast_op("smooth_l1_loss")
def smooth_l1_loss(input: Tensor, target: Any, size_average: Any = None, reduce: Any = None,  # noqa: A002
                   reduction: str = "mean", beta: float = 1.0) -> Tensor:
    """Huber-like loss: 0.5 d^2 / beta where |d| < beta, else |d| - 0.5 beta (L1 at beta 0)."""
    reduction = reduction_of(size_average, reduce, reduction)
    if beta < 0:
        raise RuntimeError("smooth_l1_loss does not support negative values for beta.")

    def value_and_slope(d: Any, xp: Any) -> tuple:
        ad = xp.abs(d)
        if beta == 0:
            return ad, xp.sign(d)
        small = ad < beta
        return (xp.where(small, 0.5 * d * d / beta, ad - 0.5 * beta),
                xp.where(small, d / beta, xp.sign(d)))

    return _elementwise_loss("smooth_l1_loss", input, target, reduction, value_and_slope,
                             "SmoothL1LossBackward")


def embedding_bag(
    input: Any, weight: Tensor, offsets: Any = None, max_norm: float | None = None,  # noqa: A002
    norm_type: float = 2, scale_grad_by_freq: bool = False, mode: str = "mean",
    sparse: bool = False, per_sample_weights: Any = None, include_last_offset: bool = False,
    padding_idx: int | None = None,
) -> Tensor:
    """Sums, means or maxima of bags of embedding rows, as torch.nn.functional.embedding_bag.

    Bags are the rows of a 2-D input, or the stretches of a 1-D input that start at `offsets`;
    rows equal to padding_idx are left out (an empty bag gives zeros).
    """
    if max_norm is not None or scale_grad_by_freq or sparse:
        raise NotImplementedError(
            "embedding_bag: max_norm, scale_grad_by_freq and sparse are not supported."
        )
    if mode not in ("sum", "mean", "max"):
        raise ValueError(f"mode has to be one of sum, mean or max, got {mode!r}")
    wd = weight.array
    xp = xp_of(wd)
    idx, bag, bags = _bags(xp, val(input), offsets, include_last_offset)
    psw = None
    if per_sample_weights is not None:
        if mode != "sum":
            raise NotImplementedError(
                "embedding_bag: per_sample_weights was not None. per_sample_weights is only "
                f"supported for mode='sum' (got mode='{mode}'). Please open a feature request "
                "on GitHub."
            )
        psw = val(per_sample_weights).reshape(-1)
        if psw.shape != idx.shape:
            raise ShapeError(
                f"embedding_bag: per_sample_weights of shape {tuple(psw.shape)} must match "
                f"the {idx.size} indices."
            )
    keep = idx != padding_idx if padding_idx is not None else xp.ones(idx.shape, dtype=bool)
    if padding_idx is not None and padding_idx < 0:
        keep = idx != padding_idx % wd.shape[0]
    idx_k, bag_k = idx[keep], bag[keep]
    rows = wd[idx_k]
    if psw is not None:
        rows = rows * psw[keep][:, None]
    out = xp.zeros((bags, wd.shape[1]), dtype=wd.dtype)
    counts = xp.bincount(bag_k, minlength=bags).astype(wd.dtype)
    if mode == "max":
        out[...] = -xp.inf
        _scatter_extreme(xp, "maximum", out, bag_k, rows)
        out[counts == 0] = 0
    else:
        _scatter_add(xp, out, bag_k, rows)
        if mode == "mean":
            out /= xp.maximum(counts, 1)[:, None]

    def backward(g: Any) -> tuple:
        gw = gp = None
        if needs_grad(weight):
            gw = xp.zeros(wd.shape, dtype=g.dtype)
            if mode == "max":
                # Each feature's gradient goes to the first row that held the bag's maximum.
                positions = xp.arange(idx_k.size)[:, None]
                candidate = xp.where(rows == out[bag_k], positions, idx_k.size)
                first = xp.full(out.shape, idx_k.size, dtype=positions.dtype)
                _scatter_extreme(xp, "minimum", first, bag_k, candidate)
                bag_of, feature = xp.nonzero(first < idx_k.size)
                _scatter_add(xp, gw, (idx_k[first[bag_of, feature]], feature),
                             g[bag_of, feature])
            else:
                gr = g[bag_k]
                if mode == "mean":
                    gr = gr / xp.maximum(counts, 1)[bag_k][:, None]
                if psw is not None:
                    gr = gr * psw[keep][:, None]
                _scatter_add(xp, gw, idx_k, gr)
        if psw is not None and needs_grad(per_sample_weights):
            gp = xp.zeros(idx.shape, dtype=g.dtype)
            gp[keep] = (g[bag_k] * wd[idx_k]).sum(axis=1)
            gp = gp.reshape(val(per_sample_weights).shape)
        return None, gw, None, gp

    return result(out, "EmbeddingBagBackward", backward,
                  (input, weight, offsets, per_sample_weights))


def _bags(xp: Any, idx: Any, offsets: Any, include_last: bool) -> tuple:
    """Flat indices, the bag of each, and the number of bags."""
    idx = xp.asarray(idx)
    if idx.dtype.kind not in "iu":
        raise ShapeError(f"embedding_bag: indices must be integers, got dtype {idx.dtype}.")
    if idx.ndim == 2:
        if offsets is not None:
            raise ValueError("if input is 2D, then offsets has to be None, as input is treated "
                             "is a mini-batch of fixed length sequences.")
        bags, length = idx.shape
        return idx.reshape(-1), xp.repeat(xp.arange(bags), length), bags
    if idx.ndim != 1:
        raise ValueError(f"input has to be 1D or 2D Tensor, but got Tensor of dimension {idx.ndim}")
    if offsets is None:
        raise ValueError("offsets has to be a 1D Tensor but got None")
    starts = xp.asarray(val(offsets)).astype(xp.int64)
    if starts.ndim != 1:
        raise ValueError("offsets has to be a 1D Tensor")
    if include_last:
        starts = starts[:-1]
    bags = starts.size
    # bag of position p = number of starts <= p, minus one
    bag = xp.searchsorted(starts, xp.arange(idx.size), side="right") - 1
    return idx, bag, bags


def _scatter_extreme(xp: Any, op: str, target: Any, index: Any, values: Any) -> None:
    """target[index] = op(target[index], values), repeated indices included."""
    if xp.__name__ == "numpy":
        getattr(xp, op).at(target, index, values)
    else:
        import cupyx  # noqa: PLC0415 - cuda only

        getattr(cupyx, "scatter_max" if op == "maximum" else "scatter_min")(target, index, values)


__all__ = ["embedding_bag", "l1_loss", "smooth_l1_loss"]
