"""Batch normalisation as one graph node, with an optional cross-process reduction of its sums.

`batch_norm` normalises over every dim but the channel dim (1). In training it updates the
running statistics in place as torch does (the running variance takes the unbiased variance).
`reduce_sums` lets a caller outside core (collectives.SyncBatchNorm) sum the per-channel
statistics over a process group without core importing collectives: it is called with one
array and must return the elementwise sum over every participant.

Dtypes follow torch's mixed-precision rule (core/ops/_promote.py's norm_output_dtype): a
bfloat16 or float16 input with float32 parameters or running statistics gives the input's
dtype. A 16-bit input is normalised in float32 (torch's "opmath" for reduced types), and each
gradient comes back in its own input's dtype.
"""

from __future__ import annotations

from typing import Any, Callable

from shoal.core.errors import ShapeError
from shoal.core.ops._promote import as_dtype, is_reduced_float, norm_output_dtype
from shoal.core.ops._util import needs_grad, result, xp_of
from shoal.core.tensor import Tensor

Reducer = Callable[[Any], Any]


def batch_norm(
    input: Tensor,  # noqa: A002 - torch's name
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float | None = 0.1,
    eps: float = 1e-5,
    reduce_sums: Reducer | None = None,
) -> Tensor:
    """torch.nn.functional.batch_norm: normalise per channel, updating running stats in training.

    `reduce_sums`, when given, sums [count, sum, sum of squares] over participants in the
    forward pass and [sum of dy, sum of dy * xhat] in the backward pass.
    """
    xd = input.array
    c = _check_shapes(xd, running_mean, running_var, weight, bias)
    xp = xp_of(xd)
    # Work on a (rows, C) channels-last matrix: contiguous per-channel reductions, and free
    # when the input already lives channels-last (a conv's output does); the output keeps it.
    shape = tuple(xd.shape)
    out_dtype = norm_output_dtype(xd.dtype, running_mean, running_var, weight, bias)
    if xd.size == 0:
        return _empty_batch(input, weight, bias, out_dtype)
    moved = xp.moveaxis(xd, 1, -1)
    xd = moved.reshape(-1, c)
    if is_reduced_float(xd.dtype):
        xd = xd.astype(xp.float32)
    if training:
        mean, var, xc, count = _batch_statistics(xd, shape, reduce_sums)
        if running_mean is not None or running_var is not None:
            _update_running(running_mean, running_var, mean, var, count, momentum, xd.dtype)
    else:
        if running_mean is None or running_var is None:
            raise ValueError("batch_norm: evaluation needs running_mean and running_var.")
        mean, var = running_mean.array, running_var.array
        xc = xd - mean
    rstd = 1.0 / xp.sqrt(var + eps)
    wd = None if weight is None else weight.array
    # xhat = xc * rstd is never materialised: the output scales xc once by rstd * weight, and
    # the backward pass folds rstd into its per-channel coefficients (fewer full-size passes).
    scale = rstd if wd is None else rstd * wd
    out = xc * scale
    if bias is not None:
        out += bias.array
    out = as_dtype(xp.moveaxis(out.reshape(moved.shape), -1, 1), out_dtype)

    def backward(g: Any) -> tuple:
        g = xp.moveaxis(g, 1, -1).reshape(-1, c)
        if g.dtype != xd.dtype and is_reduced_float(g.dtype):
            g = g.astype(xd.dtype)  # the forward's float32 arithmetic, for a 16-bit input
        gx = gw = gb = None
        sum_g = column_sums(g)
        sum_gxhat = column_sums(g * xc) * rstd  # sum of dy * xhat per channel
        if needs_grad(weight):
            gw = sum_gxhat
        if needs_grad(bias):
            gb = sum_g
        if needs_grad(input):
            gx = g * scale
            if training:
                if reduce_sums is not None:
                    both = reduce_sums(xp.concatenate([sum_g, sum_gxhat]))
                    tot_g, tot_gxhat = both[:c], both[c:]
                else:
                    tot_g, tot_gxhat = sum_g, sum_gxhat
                # dx = scale * (dy - mean(dy) - xhat * mean(dy * xhat)), xhat = xc * rstd.
                gx -= xc * (scale * rstd * tot_gxhat / count)
                gx -= scale * tot_g / count
            gx = as_dtype(xp.moveaxis(gx.reshape(moved.shape), -1, 1), input.array.dtype)
        if gw is not None:
            gw = as_dtype(gw, weight.array.dtype)
        if gb is not None:
            gb = as_dtype(gb, bias.array.dtype)
        return gx, None, None, gw, gb

    return result(out, "NativeBatchNormBackward", backward,
                  (input, running_mean, running_var, weight, bias), exact_dtype=True)


def _empty_batch(input: Tensor, weight: Tensor | None, bias: Tensor | None, dt: Any) -> Tensor:  # noqa: A002
    """An empty input gives an empty output and leaves the running statistics alone (torch)."""
    xd = input.array
    xp = xp_of(xd)

    def backward(g: Any) -> tuple:
        gw = None if weight is None else xp.zeros_like(weight.array)
        gb = None if bias is None else xp.zeros_like(bias.array)
        return xp.zeros_like(xd), gw, gb

    return result(xp.empty(xd.shape, dt), "NativeBatchNormBackward", backward,
                  (input, weight, bias), exact_dtype=True)


def _check_shapes(xd: Any, *params: Tensor | None) -> int:
    """The channel count of input `xd`, once it has one and every parameter (running_mean,
    running_var, weight, bias) holds one value per channel."""
    if xd.ndim < 2:
        raise ShapeError(f"batch_norm: expected at least 2 dims (N, C, ...), got {tuple(xd.shape)}.")
    c = xd.shape[1]
    for name, t in zip(("running_mean", "running_var", "weight", "bias"), params):
        if t is not None and tuple(t.shape) != (c,):
            raise ShapeError(
                f"batch_norm: {name} of shape {tuple(t.shape)} does not match {c} channels of "
                f"input {tuple(xd.shape)}."
            )
    return c


def _batch_statistics(xd: Any, shape: tuple, reduce_sums: Reducer | None) -> tuple:
    """Training's per-channel (mean, biased variance, centred input, count) of the (rows, C)
    matrix `xd`, over every participant when `reduce_sums` is given."""
    xp = xp_of(xd)
    c = xd.shape[1]
    count_local = xd.size // c
    if reduce_sums is None:
        if count_local <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size "
                f"{shape}"
            )
        mean = column_sums(xd) / count_local
        xc = xd - mean
        var = column_sums(xc * xc) / count_local
        return mean, var, xc, count_local
    # One reduction carries the count too: ranks may hold different batch sizes.
    stats = xp.concatenate([
        xp.full((1,), count_local, dtype=xd.dtype), column_sums(xd),
        column_sums(xd * xd),
    ])
    stats = reduce_sums(stats)
    count = int(round(float(stats[0])))
    if count <= 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got {count} in all."
        )
    mean = stats[1 : c + 1] / count
    var = xp.maximum(stats[c + 1 :] / count - mean * mean, 0)
    return mean, var, xd - mean, count


def column_sums(a: Any) -> Any:
    """Per-column sums of a (rows, C) matrix.

    For float32/float64 a ones-vector product (BLAS gemv) is ~10x faster than a reduction over
    axis 0, which numpy runs as one short row add at a time. Half-precision types accumulate
    in float32 (as numpy's mean does for float16), then come back to their own dtype.
    """
    xp = xp_of(a)
    if a.dtype.char in "fd":
        return xp.ones(a.shape[0], dtype=a.dtype) @ a
    return a.sum(axis=0, dtype=xp.float32).astype(a.dtype, copy=False)


def _update_running(
    running_mean: Tensor | None, running_var: Tensor | None, mean: Any, var: Any, count: int,
    momentum: float | None, dtype: Any,
) -> None:
    # The layers turn momentum=None into 1/num_batches_tracked (a cumulative average) first.
    factor = 0.0 if momentum is None else momentum
    unbiased = var * (count / (count - 1))
    if running_mean is not None:
        rm = running_mean.array
        rm *= 1.0 - factor
        rm += factor * mean.astype(rm.dtype, copy=False)
    if running_var is not None:
        rv = running_var.array
        rv *= 1.0 - factor
        rv += factor * unbiased.astype(rv.dtype, copy=False)
