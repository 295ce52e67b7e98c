"""Softmax cross-entropy over the last axis of (N, C) logits, forward and backward.

The forward returns the per-row loss and the per-row log-sum-exp; the backward takes that
log-sum-exp back instead of recomputing the softmax's normaliser. Rows whose target equals
`ignore_index` get zero loss and zero gradient, as in torch. The caller applies the reduction
(mean over the kept rows, sum, or none) by choosing `grad_rows`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.core.errors import ShapeError, ShoalError
from shoal.core.kernels._cuda import ACC_PREAMBLE, cached_kernel, cupy, is_cuda_array


class TargetError(ShoalError, IndexError):
    """A class index outside [0, C) that is not the ignore_index."""


def _check_shapes(logits: Any, target: Any) -> None:
    if logits.ndim != 2 or target.shape != (logits.shape[0],):
        raise ShapeError(
            f"softmax_cross_entropy needs logits of shape (N, C) and target of shape (N,); got "
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)}."
        )


def cross_entropy_forward_reference(
    logits: np.ndarray, target: np.ndarray, ignore_index: int = -100
) -> tuple[np.ndarray, np.ndarray]:
    """Per-row loss `lse - logits[target]` and per-row log-sum-exp, on numpy arrays."""
    _check_shapes(logits, target)
    n, c = logits.shape
    ignored = target == ignore_index
    bad = ~ignored & ((target < 0) | (target >= c))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise TargetError(
            f"cross_entropy target {int(target[row])} at row {row} is out of range for "
            f"{c} classes (targets must lie in [0, {c}) or equal ignore_index={ignore_index})."
        )
    safe_target = np.where(ignored, 0, target) if ignored.any() else target
    row_max = logits.max(axis=1)
    shifted = logits - row_max[:, None]
    np.exp(shifted, out=shifted)
    lse = shifted.sum(axis=1)
    np.log(lse, out=lse)
    lse += row_max
    loss = lse - logits[np.arange(n), safe_target]
    if ignored.any():
        loss[ignored] = 0
    return loss, lse


def cross_entropy_backward_reference(
    logits: np.ndarray,
    target: np.ndarray,
    lse: np.ndarray,
    grad_rows: np.ndarray | float,
    ignore_index: int = -100,
) -> np.ndarray:
    """d(sum_i grad_rows[i] * loss_i)/d logits = (softmax - onehot) * grad_rows[:, None]."""
    _check_shapes(logits, target)
    n = logits.shape[0]
    grad = logits - lse[:, None]
    np.exp(grad, out=grad)
    ignored = target == ignore_index
    safe_target = np.where(ignored, 0, target) if ignored.any() else target
    grad[np.arange(n), safe_target] -= 1
    scale = np.broadcast_to(np.asarray(grad_rows, dtype=grad.dtype), (n,))
    if ignored.any():
        scale = np.where(ignored, 0, scale).astype(grad.dtype, copy=False)
    grad *= scale[:, None]
    return grad


# One warp per row: an online (max, sum) pass over the row's columns, then a butterfly merge of
# the 32 lanes' partial results. Out-of-range targets cannot raise inside a kernel, so their
# loss is NaN, which surfaces in the loss the caller reads.
_CE_FORWARD_SOURCE = ACC_PREAMBLE + r"""
// NVRTC compiles without <math.h>, so infinity and NaN come from their bit patterns.
#define SHOAL_INF __int_as_float(0x7f800000)
#define SHOAL_NAN __int_as_float(0x7fffffff)

template <typename T>
__global__ void shoal_ce_forward(const T* logits, const long long* target, T* loss, T* lse,
                                 long long n, long long c, long long ignore_index) {
    typedef typename Acc<T>::type A;
    long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) return;
    const T* x = logits + row * c;
    A m = -SHOAL_INF, s = 0;
    for (long long j = lane; j < c; j += 32) {
        A v = (A)x[j];
        if (v > m) { s = s * exp(m - v) + (A)1; m = v; } else { s += exp(v - m); }
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        A m2 = __shfl_xor_sync(0xffffffffu, m, offset);
        A s2 = __shfl_xor_sync(0xffffffffu, s, offset);
        A mn = max(m, m2);
        A a = (m == -SHOAL_INF) ? (A)0 : s * exp(m - mn);
        A b = (m2 == -SHOAL_INF) ? (A)0 : s2 * exp(m2 - mn);
        s = a + b;
        m = mn;
    }
    if (lane == 0) {
        A l = m + log(s);
        lse[row] = (T)l;
        long long t = target[row];
        if (t == ignore_index) loss[row] = (T)0;
        else if (t < 0 || t >= c) loss[row] = (T)SHOAL_NAN;
        else loss[row] = (T)(l - (A)x[t]);
    }
}
"""

_CE_BACKWARD_OPERATION = r"""
typedef Acc<T>::type A;
long long r = i / c;
long long j = i - r * c;
long long t = target[r];
if (t == ignore_index) {
    grad = (T)0;
} else {
    A p = exp((A)logits[i] - (A)lse[r]);
    if (j == t) p -= (A)1;
    grad = (T)(p * (A)grad_rows[r]);
}
"""


@cached_kernel
def _ce_forward_module():
    return cupy().RawModule(
        code=_CE_FORWARD_SOURCE,
        options=("-std=c++14",),
        name_expressions=("shoal_ce_forward<float>", "shoal_ce_forward<double>"),
    )


@cached_kernel
def _ce_backward_kernel():
    return cupy().ElementwiseKernel(
        "raw T logits, raw T lse, raw int64 target, raw T grad_rows, int64 c, int64 ignore_index",
        "T grad",
        _CE_BACKWARD_OPERATION,
        "shoal_ce_backward",
        preamble=ACC_PREAMBLE,
    )


def _compute_dtype(cp, dtype):
    # Half precision is upcast to float32 for the reductions; float32 and float64 run as they are.
    return dtype if dtype in (cp.float32, cp.float64) else cp.dtype(cp.float32)


def cross_entropy_forward_cuda(logits: Any, target: Any, ignore_index: int = -100):
    """Per-row loss and log-sum-exp on cupy arrays, one warp per row."""
    cp = cupy()
    _check_shapes(logits, target)
    n, c = logits.shape
    dtype = _compute_dtype(cp, logits.dtype)
    x = cp.ascontiguousarray(logits, dtype=dtype)
    t = cp.ascontiguousarray(target, dtype=cp.int64)
    loss = cp.empty(n, dtype=dtype)
    lse = cp.empty(n, dtype=dtype)
    if n:
        name = "shoal_ce_forward<float>" if dtype == cp.float32 else "shoal_ce_forward<double>"
        kernel = _ce_forward_module().get_function(name)
        threads = 256
        blocks = (n * 32 + threads - 1) // threads
        kernel((blocks,), (threads,), (x, t, loss, lse, cp.int64(n), cp.int64(c),
                                        cp.int64(ignore_index)))
    return loss.astype(logits.dtype, copy=False), lse


def cross_entropy_backward_cuda(
    logits: Any, target: Any, lse: Any, grad_rows: Any, ignore_index: int = -100
):
    """(softmax - onehot) * grad_rows[:, None] on cupy arrays, one thread per element."""
    cp = cupy()
    _check_shapes(logits, target)
    n, c = logits.shape
    dtype = _compute_dtype(cp, logits.dtype)
    x = cp.ascontiguousarray(logits, dtype=dtype)
    t = cp.ascontiguousarray(target, dtype=cp.int64)
    rows = cp.ascontiguousarray(cp.broadcast_to(cp.asarray(grad_rows, dtype=dtype), (n,)))
    grad = cp.empty((n, c), dtype=dtype)
    _ce_backward_kernel()(x, cp.asarray(lse, dtype=dtype), t, rows, c, ignore_index, grad)
    return grad.astype(logits.dtype, copy=False)


def cross_entropy_forward(logits: Any, target: Any, ignore_index: int = -100):
    """Per-row loss and log-sum-exp: the CUDA kernel for cupy arrays, numpy otherwise."""
    if is_cuda_array(logits):
        return cross_entropy_forward_cuda(logits, target, ignore_index)
    return cross_entropy_forward_reference(logits, target, ignore_index)


def cross_entropy_backward(logits: Any, target: Any, lse: Any, grad_rows: Any,
                           ignore_index: int = -100):
    """Gradient of the weighted per-row losses: CUDA kernel for cupy arrays, numpy otherwise."""
    if is_cuda_array(logits):
        return cross_entropy_backward_cuda(logits, target, lse, grad_rows, ignore_index)
    return cross_entropy_backward_reference(logits, target, lse, grad_rows, ignore_index)
