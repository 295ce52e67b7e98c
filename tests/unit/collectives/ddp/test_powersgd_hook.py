"""The PowerSGD hook's algorithm with thread ranks on the tcp backend (fast; the comparison with
torch's own hook on gloo is tests/multiproc/test_powersgd.py): the warm-up, what is compressed
and what is averaged exactly, the rank of the result, error feedback's bookkeeping, and torch's
checks on the state."""

import pickle

import numpy as np
import pytest

from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.ddp import PowerSGDState, powerSGD_hook
from shoal.collectives.ddp.buckets import Bucket, GradBucket
from shoal.core.tensor import Tensor
from tests.support.thread_world import ThreadWorld

SHAPES = [(30, 20), (20,), (12, 4, 5)]


def _make_group(store, rank, size, *, name, global_ranks, timeout):
    return ProcessGroupTCP(store, rank, size, timeout=timeout, name=name, global_ranks=global_ranks)


def _bucket(grads):
    params = [Tensor(np.zeros(g.shape, np.float64)) for g in grads]
    bucket = Bucket(0, list(range(len(grads))), params)
    bucket.buffer[...] = np.concatenate([g.ravel() for g in grads])
    return GradBucket(bucket, is_last=True)


def _grads(step, rank):
    rng = np.random.default_rng([step, rank])
    return [rng.standard_normal(s) for s in SHAPES]


def _split(flat):
    out, at = [], 0
    for s in SHAPES:
        n = int(np.prod(s))
        out.append(flat[at:at + n].reshape(s))
        at += n
    return out


def _run(world, steps, **kw):
    job = ThreadWorld(_make_group, world)

    def body(rank):
        state = PowerSGDState(job.pgs[rank], start_powerSGD_iter=2, **kw)
        outs = []
        for step in range(steps):
            outs.append(powerSGD_hook(state, _bucket(_grads(step, rank))).wait().array.copy())
        return outs, state

    try:
        return job.run(body)
    finally:
        job.close()


def test_warm_up_averages_exactly_then_matrices_are_low_rank_and_vectors_exact():
    (outs0, state), (outs1, _) = _run(2, 4, matrix_approximation_rank=2)
    for step in range(4):
        mean = (np.concatenate([g.ravel() for g in _grads(step, 0)])
                + np.concatenate([g.ravel() for g in _grads(step, 1)])) / 2
        if step < 2:  # start_powerSGD_iter=2: plain all_reduce, divided by the world size
            np.testing.assert_allclose(outs0[step], mean, rtol=0, atol=1e-15)
            continue
        np.testing.assert_allclose(outs0[step], outs1[step], rtol=0, atol=1e-12)
        matrix, vector, weight = _split(outs0[step])
        assert np.linalg.matrix_rank(matrix, tol=1e-9) == 2
        assert np.linalg.matrix_rank(weight.reshape(12, 20), tol=1e-9) == 2
        # The vector is all-reduced as it is, but error feedback adds last step's remainder
        # on each rank first: exact only on the first compressed step.
        if step == 2:
            np.testing.assert_allclose(vector, _split(mean)[1], rtol=0, atol=1e-15)
    # torch's accounting: 600 + 240 elements become (30 + 20) x 2 + (12 + 20) x 2; 20 stay.
    assert state.compression_stats()[1:] == (2 * (600 + 20 + 240), 2 * (100 + 20 + 64))


def test_error_feedback_keeps_what_compression_left_out():
    # One rank: each output is the approximation of (gradient + carried error), and the new
    # error is the difference, so outputs and the final error add up to the gradients' sum.
    (outs, state), = _run(1, 6, matrix_approximation_rank=1)
    total = sum(np.concatenate([g.ravel() for g in _grads(s, 0)]) for s in range(6))
    carried = sum(outs) + state.error_dict[0]
    np.testing.assert_allclose(carried, total, rtol=0, atol=1e-12)
    assert np.abs(state.error_dict[0]).max() > 0.1  # rank 1 does leave something out


def test_the_state_checks_and_pickles_as_torch_does():
    with pytest.raises(ValueError, match="Expect `start_powerSGD_iter` > 1"):
        PowerSGDState(None, start_powerSGD_iter=1)
    PowerSGDState(None, start_powerSGD_iter=1, use_error_feedback=False, warm_start=False)
    state = PowerSGDState(None, matrix_approximation_rank=3, start_powerSGD_iter=10)
    back = pickle.loads(pickle.dumps(state))
    assert back.process_group is None and back.matrix_approximation_rank == 3
    assert back.rng.randint(1000) == state.rng.randint(1000)


def test_bfloat16_is_orthogonalised_as_torch_does_it():
    """torch orthogonalises float16 and bfloat16 by Gram-Schmidt at any rank (QR would differ
    from it by the columns' signs); the two agree to bfloat16's rounding: 8 significant bits,
    a few roundings per element over 8 rows, far under 0.05 on entries at most 1."""
    torch = pytest.importorskip("torch")
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    from shoal.collectives.ddp.powersgd_hook import _orthogonalize
    from shoal.core import dtypes

    values = np.random.default_rng(0).uniform(0.5, 1.5, (2, 8, 3)).astype(np.float32)
    ours = values.astype(dtypes.bfloat16.np)
    _orthogonalize(ours)
    theirs = torch.from_numpy(values).to(torch.bfloat16)
    torch_psgd._orthogonalize(theirs)
    np.testing.assert_allclose(ours.astype(np.float32), theirs.float().numpy(), atol=0.05)
