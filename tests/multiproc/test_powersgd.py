"""The PowerSGD comm hook at W=2 over real processes: its output equals torch's powerSGD_hook on
gloo for the same gradients, step after step (vanilla warm-up, then compression with warm start
and error feedback, at ranks 1, 2 and 4, batched and not), and DDP trains with it.

Each rank runs both hooks: torch's over a gloo group, shoal's over a tcp group, on the same
per-rank gradients. torch's hook reads a bucket only through buffer(), gradients(), index() and
is_last(); the test hands it those over a torch flat tensor (torch offers no public GradBucket
constructor), and shoal's hook a real GradBucket.
"""

from __future__ import annotations

import numpy as np

from tests.support.ranks import agent_store, run_ranks

# Gradient shapes of one bucket: matrices worth compressing, a vector and a small matrix that
# are not, a 3-d weight (viewed as 16 x 24), and two matrices of one shape (batched together).
SHAPES = [(32, 24), (24,), (16, 8, 3), (40, 20), (3, 2), (40, 20), (20,)]
STEPS = 6
START = 2
VARIANTS = {
    "rank1": dict(matrix_approximation_rank=1),
    "rank2_batched_cold": dict(matrix_approximation_rank=2, batch_tensors_with_same_shape=True,
                               warm_start=False, orthogonalization_epsilon=1e-8),
    "rank4_qr": dict(matrix_approximation_rank=4),
    "rank4_no_feedback": dict(matrix_approximation_rank=4, use_error_feedback=False),
}


def _grads(step, rank):
    rng = np.random.default_rng([step, rank, 7])
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


class _TorchBucket:
    """The four methods torch's powerSGD_hook calls on a GradBucket, over one flat tensor."""

    def __init__(self, torch, grads):
        self._flat = torch.from_numpy(np.concatenate([g.ravel() for g in grads]).copy())
        self._views, at = [], 0
        for g in grads:
            self._views.append(self._flat[at:at + g.size].view(g.shape))
            at += g.size

    def buffer(self):
        return self._flat

    def gradients(self):
        return self._views

    def index(self):
        return 0

    def is_last(self):
        return True


def _shoal_bucket(grads):
    from shoal.collectives.ddp.buckets import Bucket, GradBucket
    from shoal.core.tensor import Tensor

    params = [Tensor(np.zeros(g.shape, np.float32)) for g in grads]
    bucket = Bucket(0, list(range(len(params))), params)
    bucket.buffer[...] = np.concatenate([g.ravel() for g in grads])
    return GradBucket(bucket, is_last=True)


# torch's hook chains futures whose callbacks hold the gloo group; the callbacks run, and are
# released, on gloo's worker threads. Were the last reference to go there, the group's
# destructor would join the thread it runs on and abort the process ("Resource deadlock
# avoided", seen once in CI). The rank keeps the group here so the main thread frees it at exit.
_TORCH_GROUPS_KEPT = []


def _compare_rank(rank, world, init_file):
    import torch
    import torch.distributed as tdist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    import shoal.collectives as c
    from shoal.collectives.ddp import PowerSGDState, powerSGD_hook

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                             world_size=world)
    c.init_process_group("tcp", init_method="env://", timeout=30)
    try:
        out = {}
        for name, kw in VARIANTS.items():
            ours = PowerSGDState(None, start_powerSGD_iter=START, **kw)
            theirs = torch_psgd.PowerSGDState(None, start_powerSGD_iter=START, **kw)
            steps = []
            for step in range(STEPS):
                grads = _grads(step, rank)
                mine = powerSGD_hook(ours, _shoal_bucket(grads)).wait().array.copy()
                ref = torch_psgd.powerSGD_hook(theirs, _TorchBucket(torch, grads)).wait()
                steps.append((mine, ref.numpy().copy()))
            assert ours.compression_stats() == theirs.compression_stats()
            out[name] = steps
        return out
    finally:
        c.destroy_process_group()
        _TORCH_GROUPS_KEPT.append(tdist.group.WORLD)
        tdist.destroy_process_group()


def test_the_hook_equals_torchs_powersgd_hook_at_w2(tmp_path):
    store, env = agent_store()
    try:
        results = run_ranks(_compare_rank, 2, args=(str(tmp_path / "gloo"),), timeout=120,
                            env=env)
    finally:
        store.close()
    for name in VARIANTS:
        for step in range(STEPS):
            mine, ref = results[0][name][step]
            scale = float(np.abs(ref).max())
            if step < START:
                # Plain averaging of two float32 numbers: one rounding, bit-for-bit the same.
                assert np.array_equal(mine, ref), (name, step)
                continue
            # float32 throughout; the two differ only in BLAS summation order (products of
            # length <= 40), Q's first draw (core.randn equals torch.randn to float rounding)
            # and LAPACK's QR, each a few ulps relative, carried through at most 4 compressed
            # steps of a well-conditioned (Gaussian) problem: 1e-4 of the largest element is
            # a wide margin, while a wrong step (no error feedback, a missed average, another
            # seed) moves elements by tenths of it.
            np.testing.assert_allclose(mine, ref, rtol=0, atol=1e-4 * scale,
                                       err_msg=f"{name} step {step}")
            # Both ranks hold the same averaged gradient in the compressed parts.
            assert np.allclose(results[1][name][step][0], mine, rtol=0, atol=1e-6 * scale)


def _train_rank(rank, world):
    from shoal import core
    import shoal.collectives as c
    from shoal.collectives.ddp import PowerSGDState, powerSGD_hook
    from shoal.core import nn

    c.init_process_group("tcp", init_method="env://", timeout=30)
    try:
        finals = {}
        for use_hook in (False, True):
            core.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
            ddp = c.DistributedDataParallel(model)
            if use_hook:
                ddp.register_comm_hook(PowerSGDState(None, matrix_approximation_rank=2,
                                                     start_powerSGD_iter=3), powerSGD_hook)
            opt = core.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
            rng = np.random.default_rng(rank)
            teacher = np.random.default_rng(99).standard_normal((16, 4)).astype(np.float32)
            losses = []
            for _ in range(60):
                x = rng.standard_normal((32, 16)).astype(np.float32)
                y = core.tensor(np.tanh(x @ teacher))
                opt.zero_grad()
                diff = ddp(core.tensor(x)) - y
                loss = (diff * diff).mean()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            finals[use_hook] = (losses, [p.array.copy() for p in model.parameters()])
        return finals
    finally:
        c.destroy_process_group()


def test_ddp_with_the_powersgd_hook_trains_and_keeps_replicas_equal():
    store, env = agent_store()
    try:
        results = run_ranks(_train_rank, 2, timeout=120, env=env)
    finally:
        store.close()
    plain, compressed = results[0][False][0], results[0][True][0]
    first, last = np.mean(compressed[:5]), np.mean(compressed[-5:])
    assert last < 0.5 * first  # it learns
    # Rank-2 compression with error feedback trails exact averaging a little, not by much.
    assert last < 2.0 * np.mean(plain[-5:]) + 0.01
    for a, b in zip(results[0][True][1], results[1][True][1]):
        np.testing.assert_array_equal(a, b)  # every rank applied the same update
