"""PowerSGD gradient compression for DDP (torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook).

Each gradient matrix M (n x m, a parameter's gradient viewed as rows by the rest) is replaced
by a rank-r approximation P Q^T that the ranks agree on: P = M Q is all-reduced and
orthonormalised, Q = M^T P is all-reduced and averaged, and M becomes P Q^T. Only (n + m) r
numbers per matrix cross the wire instead of n m. With error feedback, what the approximation
left out of a rank's gradient is added to its next gradient; with warm start, the last step's Q
seeds the next, so one power iteration per step tracks the gradients' leading subspace.

Vectors (biases, norms' weights) and matrices too small to gain `min_compression_rate` are
all-reduced as they are, in one flat all_reduce per bucket, as are whole buckets before
`start_powerSGD_iter` iterations (plain DDP's warm-up). The arithmetic follows torch's hook
step for step: the same order of matrices (grouped by shape), the same seeds for the first Q
(numpy's RandomState(random_seed) picks each step's seed for the MT19937 that core.randn shares
with torch), Gram-Schmidt up to rank 2 and QR (numpy's LAPACK) above, and error feedback taken
over the whole bucket, so the uncompressed parts' local-minus-average differences are fed back
too, as torch does.

The hook's three all_reduces run in turn in the backward thread (a collective is never started
from a completion callback), so PowerSGD's communication does not overlap the rest of backward
as plain DDP's bucket all_reduce does; what it saves is bytes.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np

from shoal.collectives.ddp import comm
from shoal.collectives.ddp.buckets import GradBucket
from shoal.collectives.ddp.comm_hooks import allreduce_hook
from shoal.collectives.ddp.future import Future, completed_future
from shoal.collectives.types import ReduceOp
from shoal.core import dtypes
from shoal.core.generator import Generator
from shoal.core.ops.creation import randn

__all__ = ["PowerSGDState", "powerSGD_hook"]

logger = logging.getLogger(__name__)


class PowerSGDState:
    """PowerSGD's settings and what it carries between steps: error feedback, warm-start
    P and Q memories per bucket, and the iteration count (torch's PowerSGDState)."""

    def __init__(self, process_group: Optional[Any], matrix_approximation_rank: int = 1,
                 start_powerSGD_iter: int = 1_000, min_compression_rate: float = 2,
                 use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0, random_seed: int = 0,
                 compression_stats_logging_frequency: int = 10_000,
                 batch_tensors_with_same_shape: bool = False) -> None:
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(
                "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is "
                "enabled, because PowerSGD can only be applied after the first two iterations "
                "in DDP.")
        if matrix_approximation_rank < 1:
            raise ValueError(f"matrix_approximation_rank must be at least 1, got "
                             f"{matrix_approximation_rank}.")
        self.process_group = process_group
        self.matrix_approximation_rank = int(matrix_approximation_rank)
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.rng = np.random.RandomState(random_seed)
        self.error_dict: dict[int, np.ndarray] = {}
        self.p_memory_dict: dict[int, np.ndarray] = {}
        self.q_memory_dict: dict[int, np.ndarray] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.compression_stats_logging_frequency = max(1, compression_stats_logging_frequency)
        self.next_stats_report = 0
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Count an iteration at its last bucket."""
        if bucket.is_last():
            self.iter += 1
        if self.iter == self.start_powerSGD_iter:
            logger.info("Start to apply PowerSGD after %s iterations.", self.iter)

    def compression_stats(self) -> tuple:
        """(compression rate, elements before compression, elements after) since the start."""
        before, after = self.total_numel_before_compression, self.total_numel_after_compression
        return (before / after if after > 0 else 0, before, after)

    def __getstate__(self) -> dict:
        # A process group does not pickle; torch leaves it out of a saved state the same way.
        return {k: v for k, v in self.__dict__.items() if k != "process_group"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.process_group = None  # the default group, until the caller sets another


def _should_compress(rows: int, cols: int, rank: int, min_rate: float) -> tuple:
    """(worth compressing, elements uncompressed, elements compressed), torch's rule."""
    uncompressed, compressed = rows * cols, (rows + cols) * rank
    return compressed * min_rate < uncompressed, uncompressed, compressed


def _orthogonalize(matrices: np.ndarray, epsilon: float = 0) -> None:
    """Orthonormalise the columns of each matrix of a (batch, n, r) stack in place:
    Gram-Schmidt up to rank 2 (or in float16 or bfloat16, as torch), QR above."""
    if matrices.shape[2] <= 2 or matrices.dtype in (np.float16, dtypes.bfloat16.np):
        _gram_schmidt(matrices, epsilon)
        return
    q, _ = np.linalg.qr(matrices)
    matrices[...] = q


def _gram_schmidt(matrices: np.ndarray, epsilon: float) -> None:
    cols = matrices.shape[2]
    for i in range(cols):
        col = matrices[:, :, i:i + 1]
        norm = np.sqrt(np.sum(col * col, axis=1, keepdims=True))
        with np.errstate(divide="ignore", invalid="ignore"):
            col /= norm + epsilon if epsilon else norm
        if epsilon == 0 and not np.all(np.isfinite(col)):
            logger.error("The matrices to be orthogonalized has at least a column of all 0s. "
                         "Please set a small value such as 1e-8 as `orthogonalization_epsilon` "
                         "in PowerSGD state.")
            col[...] = 0.0
        if i + 1 < cols:
            rest = matrices[:, :, i + 1:]
            rest -= np.sum(col * rest, axis=1, keepdims=True) * col


def _split(state: PowerSGDState, grads: list) -> tuple[list, list]:
    """The bucket's gradients as matrices worth compressing, and the rest (as arrays)."""
    compress, plain = [], []
    for g in grads:
        matrix = g.reshape(g.shape[0], -1) if g.ndim else g.reshape(1, 1)
        n, m = matrix.shape
        rank = min(n, m, state.matrix_approximation_rank)
        worth, before, after = _should_compress(n, m, rank, state.min_compression_rate)
        state.total_numel_before_compression += before
        if worth:
            compress.append(matrix)
            state.total_numel_after_compression += after
        else:
            plain.append(g)
            state.total_numel_after_compression += before
    return compress, plain


def _batches(state: PowerSGDState, matrices: list) -> list[tuple[np.ndarray, list]]:
    """(a (batch, n, m) stack, the matrices it came from) per group, grouped by shape in
    order of first appearance, as torch orders them."""
    by_shape: dict[tuple, list] = {}
    for mat in matrices:
        by_shape.setdefault(mat.shape, []).append(mat)
    out = []
    for group in by_shape.values():
        if state.batch_tensors_with_same_shape and len(group) > 1:
            out.append((np.stack(group), group))
        else:
            out.extend((mat[None], [mat]) for mat in group)
    return out


def _low_rank_views(state: PowerSGDState, index: int, batches: list, dtype: Any,
                    reuse: bool) -> tuple[list, list]:
    """P and Q of every batch, as views into the bucket's flat P and Q memories."""
    shapes = []
    for stack, _ in batches:
        b, n, m = stack.shape
        shapes.append((b, n, m, min(n, m, state.matrix_approximation_rank)))
    if not reuse:
        state.p_memory_dict[index] = np.empty(sum(b * n * r for b, n, _, r in shapes), dtype)
        state.q_memory_dict[index] = np.empty(sum(b * m * r for b, _, m, r in shapes), dtype)
    ps, qs, p_at, q_at = [], [], 0, 0
    for b, n, m, r in shapes:
        ps.append(state.p_memory_dict[index][p_at:p_at + b * n * r].reshape(b, n, r))
        qs.append(state.q_memory_dict[index][q_at:q_at + b * m * r].reshape(b, m, r))
        p_at, q_at = p_at + b * n * r, q_at + b * m * r
    return ps, qs


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> Future:  # noqa: N802 - torch's
    """Average the bucket's gradients through rank-r approximations (torch's powerSGD_hook)."""
    group = comm.resolve(state.process_group)
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_hook(group, bucket)
    world = comm.size(group)
    buffer = bucket.buffer()
    flat = buffer.array
    if not isinstance(flat, np.ndarray):
        raise NotImplementedError("powerSGD_hook runs on CPU (numpy) gradient buckets.")
    index = bucket.index()
    before = None
    if state.use_error_feedback:
        if index in state.error_dict:
            flat += state.error_dict[index]
        else:
            state.error_dict[index] = np.zeros_like(flat)
        before = flat.copy()
    matrices, plain = _split(state, [g.array for g in bucket.gradients()])
    reuse = state.warm_start and index in state.p_memory_dict
    batches = _batches(state, matrices)
    ps, qs = _low_rank_views(state, index, batches, flat.dtype, reuse)
    if reuse:
        for q in qs:
            _orthogonalize(q, state.orthogonalization_epsilon)
    else:
        # One seed per step, the same on every rank (the same RandomState sequence).
        gen = Generator()
        gen.manual_seed(int(state.rng.randint(1_000_000_000)))
        for q in qs:
            q[...] = randn(*q.shape, generator=gen, dtype=dtypes.from_np(flat.dtype)).array
            _orthogonalize(q, state.orthogonalization_epsilon)
    for (stack, _), q, p in zip(batches, qs, ps):
        np.matmul(stack, q, out=p)
    _reduce_plain(group, plain, world)
    comm.all_reduce(group, state.p_memory_dict[index], ReduceOp.SUM)
    for p in ps:
        _orthogonalize(p, state.orthogonalization_epsilon)
    for (stack, _), p, q in zip(batches, ps, qs):
        np.matmul(stack.transpose(0, 2, 1), p, out=q)
    comm.all_reduce(group, state.q_memory_dict[index], ReduceOp.SUM)
    state.q_memory_dict[index] /= world
    for (stack, originals), p, q in zip(batches, ps, qs):
        if len(originals) == 1:
            np.matmul(p, q.transpose(0, 2, 1), out=originals[0][None])
        else:
            approx = np.matmul(p, q.transpose(0, 2, 1))
            for i, mat in enumerate(originals):
                mat[...] = approx[i]
    if before is not None:
        state.error_dict[index] = before - flat
    if not state.warm_start:
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
    state.maybe_increase_iter(bucket)
    return completed_future(buffer)


def _reduce_plain(group: Any, plain: list, world: int) -> None:
    """All-reduce the uncompressed gradients as one flat array and average them in place."""
    if not plain:
        return
    joined = np.concatenate([g.ravel() for g in plain])
    comm.all_reduce(group, joined, ReduceOp.SUM)
    joined /= world
    at = 0
    for g in plain:
        g[...] = joined[at:at + g.size].reshape(g.shape)
        at += g.size
