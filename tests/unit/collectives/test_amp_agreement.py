"""collectives.amp.agree_on_found_inf: ranks (threads over real tcp groups) skip the same steps."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from shoal import core
from shoal.collectives import ProcessGroupTCP
from shoal.collectives.amp import agree_on_found_inf
from shoal.core.amp import GradScaler
from tests.support.thread_world import ThreadWorld

pytestmark = pytest.mark.timeout(60)
W = 2


def _make_group(store, rank, size, *, name, global_ranks, timeout):
    return ProcessGroupTCP(store, rank, size, timeout=timeout, name=name, global_ranks=global_ranks)


def _train(pg, rank, agree):
    """Three steps; rank 1 alone overflows at step 1. Returns (scales, skipped) for this rank."""
    model = core.nn.Linear(2, 1)
    opt = core.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=1)
    if agree:
        agree_on_found_inf(scaler, group=pg, timeout=10)
    scales, skipped = [], []
    for step in range(3):
        opt.zero_grad()
        scaler.scale(model(core.ones(1, 2)).sum()).backward()
        if step == 1 and rank == 1:
            with core.no_grad():
                model.weight.grad.data[0, 0] = np.inf
        before = model.weight.detach().clone()
        scaler.step(opt)
        skipped.append(bool(core.equal(before, model.weight.detach())))
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, skipped


def test_every_rank_skips_the_step_one_rank_overflowed():
    job = ThreadWorld(_make_group, W)
    try:
        apart = job.run(lambda r: _train(job.pgs[r], r, agree=False))
        together = job.run(lambda r: _train(job.pgs[r], r, agree=True))
    finally:
        job.close()
    # Without agreement the ranks disagree (what the helper exists to prevent) ...
    assert apart[0] == ([16.0, 32.0, 64.0], [False, False, False])
    assert apart[1] == ([16.0, 8.0, 16.0], [False, True, False])
    # ... with it, rank 1's overflow skips rank 0's step too, and the scales stay equal.
    assert together[0] == together[1] == ([16.0, 8.0, 16.0], [False, True, False])


def test_refuses_what_is_not_a_grad_scaler():
    with pytest.raises(TypeError, match=r"agree_on_found_inf: expected a core.amp.GradScaler, "
                                        r"got dict\."):
        agree_on_found_inf({})


_INIT_LOCK = threading.Lock()


def _ddp_amp_run(pg, rank, micro_batches=2, steps=4, hook=None):
    """DDP + bf16 autocast + GradScaler (agreed) + accumulation over micro-batches with no_sync."""
    from shoal.collectives.ddp.ddp import DistributedDataParallel

    # The ranks are threads sharing core's global generator: seed and draw under a lock, or
    # the two threads' draws interleave and rank 0's initial weights (which DDP broadcasts)
    # differ from run to run.
    with _INIT_LOCK:
        core.manual_seed(5)
        net = core.nn.Sequential(core.nn.Linear(4, 8), core.nn.GELU(), core.nn.Linear(8, 2))
    model = DistributedDataParallel(net, process_group=pg)
    if hook is not None:
        model.register_comm_hook(pg, hook)
    opt = core.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = agree_on_found_inf(GradScaler("cpu", init_scale=64.0, growth_interval=2), group=pg,
                                timeout=10)
    rng = np.random.default_rng(100 + rank)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(micro_batches):
            x = core.tensor(rng.standard_normal((6, 4)).astype(np.float32))
            y = core.tensor(rng.integers(0, 2, 6))
            last = micro == micro_batches - 1
            with (model.no_sync() if not last else _null()):
                with core.autocast("cpu"):
                    loss = core.nn.CrossEntropyLoss()(model(x), y) / micro_batches
                scaler.scale(loss).backward()
        if step == 2 and rank == 0:  # an overflow on one rank after the all-reduce
            with core.no_grad():
                next(model.parameters()).grad.data[0, 0] = np.nan
        scaler.step(opt)
        scaler.update()
    return [p.detach().numpy().copy() for p in model.parameters()], scaler.get_scale()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_ddp_with_autocast_scaler_and_accumulation_is_bitwise_repeatable_and_in_step():
    job = ThreadWorld(_make_group, W)
    try:
        first = job.run(lambda r: _ddp_amp_run(job.pgs[r], r))
        second = job.run(lambda r: _ddp_amp_run(job.pgs[r], r))
    finally:
        job.close()
    for run in (first, second):
        (p0, s0), (p1, s1) = run[0], run[1]
        assert s0 == s1 == 64.0  # grown after 2 clean steps, halved at the agreed skip: 64, 128, 64
        for a, b in zip(p0, p1, strict=True):
            assert a.tobytes() == b.tobytes()  # the replicas stayed identical
    for a, b in zip(first[0][0], second[0][0], strict=True):
        assert a.tobytes() == b.tobytes()  # and the run repeats bit for bit


@pytest.mark.parametrize("hook_name", ["fp16_compress_hook", "bf16_compress_hook"])
def test_compression_hooks_work_under_autocast_and_the_scaler(hook_name):
    """float32 weights, bf16 compute, gradients sent as fp16/bf16: still in step, and close to
    the uncompressed run (the hooks round only the averaged gradients)."""
    from shoal.collectives.ddp import comm_hooks

    hook = getattr(comm_hooks, hook_name)
    job = ThreadWorld(_make_group, W)
    try:
        plain = job.run(lambda r: _ddp_amp_run(job.pgs[r], r))
        packed = job.run(lambda r: _ddp_amp_run(job.pgs[r], r, hook=hook))
    finally:
        job.close()
    for a, b in zip(packed[0][0], packed[1][0], strict=True):
        assert a.tobytes() == b.tobytes()
    assert all(p.dtype == np.float32 for p in packed[0][0])
    for a, b in zip(packed[0][0], plain[0][0], strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2)
