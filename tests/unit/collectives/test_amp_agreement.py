"""collectives.amp.agree_on_found_inf: ranks (threads over real tcp groups) skip the same steps."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

from shoal import core
from shoal.collectives import ProcessGroupTCP
from shoal.collectives.amp import agree_on_found_inf
from shoal.core.amp import GradScaler
from tests.support.thread_world import ThreadWorld

pytestmark = [
    pytest.mark.timeout(60),
    # numpy warns of the overflows these tests make on purpose.
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]
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
                model.weight.grad.array[0, 0] = np.inf
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
            with (model.no_sync() if not last else contextlib.nullcontext()):
                with core.autocast("cpu"):
                    loss = core.nn.CrossEntropyLoss()(model(x), y) / micro_batches
                scaler.scale(loss).backward()
        if step == 2 and rank == 0:  # an overflow on one rank after the all-reduce
            with core.no_grad():
                next(model.parameters()).grad.array[0, 0] = np.nan
        scaler.step(opt)
        scaler.update()
    return [p.detach().numpy().copy() for p in model.parameters()], scaler.get_scale()


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


# -- one rank overflows, nobody calls agree_on_found_inf ------------------------------------
# Rank 1 alone sees inf/NaN at these steps; every rank must skip exactly them.
_BAD_STEPS = (1, 4)
_HUGE = 1e38  # times the scale, past float32's and bfloat16's largest finite value


class _Net(core.nn.Module):
    """A body every rank uses and, with_extra, a branch only rank 1 uses at its bad steps."""

    def __init__(self, with_extra):
        super().__init__()
        self.body = core.nn.Sequential(core.nn.Linear(4, 8), core.nn.GELU(), core.nn.Linear(8, 2))
        if with_extra:
            self.extra = core.nn.Linear(4, 2)

    def forward(self, x, boost=None):
        out = self.body(x)
        if boost is not None:
            out = out + self.extra(x) * boost
        return out


def _overflow_run(pg, rank, case, agreement=None, steps=6):
    """DDP (no agree_on_found_inf) + bf16 autocast + GradScaler + two micro-batches (the first
    under no_sync); rank 1 alone overflows at _BAD_STEPS in the way `case` says. Returns each
    step's skip flag, the scales, DDP's parameters and the parameter outside DDP.

    agreement: None leaves DDP's parameters as DDP registers them; "local" registers a local
    verdict for them (what a GradScaler does with no agreement at all); "replicas" registers
    collectives.amp.agree_for_replicas over the group.
    """
    from shoal.collectives.amp import agree_for_replicas
    from shoal.collectives.ddp.ddp import DistributedDataParallel
    from shoal.core.amp.found_inf import register_found_inf_agreement

    with _INIT_LOCK:
        core.manual_seed(7)
        net = _Net(with_extra=case == "unused_branch")
    model = DistributedDataParallel(net, process_group=pg,
                                    find_unused_parameters=case == "unused_branch")
    handle = None
    if agreement == "local":
        handle = register_found_inf_agreement(model.parameters(), lambda local: local)
    elif agreement == "replicas":
        handle = agree_for_replicas(model.parameters(), pg, timeout=10)
    # Trained on every rank but not by DDP: equal everywhere as long as its gradients are.
    outside = core.nn.Parameter(core.ones(1))
    opt = core.optim.SGD(list(model.parameters()) + [outside], lr=0.05, momentum=0.9)
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    rng = np.random.default_rng(300 + rank)
    skipped, scales = [], []
    for step in range(steps):
        opt.zero_grad()
        bad = rank == 1 and step in _BAD_STEPS
        for micro in range(2):
            synced = micro == 1
            hit = bad and (case == "no_sync") != synced
            x = rng.standard_normal((6, 4)).astype(np.float32)
            y = core.tensor(rng.integers(0, 2, 6))
            if hit and case in ("synced", "no_sync") and step == _BAD_STEPS[0]:
                x[0, 0] = np.inf  # a bad sample: NaN loss and gradients on this rank
            with (contextlib.nullcontext() if synced else model.no_sync()):
                with core.autocast("cpu"):
                    boost = _HUGE if hit and case == "unused_branch" else None
                    loss = core.nn.CrossEntropyLoss()(model(core.tensor(x), boost), y) / 2
                if hit and case in ("synced", "no_sync") and step == _BAD_STEPS[1]:
                    loss = loss * _HUGE  # a loss spike: its scaled gradients overflow
                weight = _HUGE if hit and case == "outside_ddp" else 0.01
                loss = loss + (outside * weight).sum()
                scaler.scale(loss).backward()
        before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
        scaler.step(opt)
        skipped.append(all(core.equal(b, p.detach())
                           for b, p in zip(before, opt.param_groups[0]["params"], strict=True)))
        scaler.update()
        scales.append(scaler.get_scale())
    if handle is not None:
        handle.remove()
    return (skipped, scales, [p.detach().numpy().copy() for p in model.parameters()],
            outside.detach().numpy().copy())


def _assert_in_step(results):
    (skip0, scales0, params0, out0), (skip1, scales1, params1, out1) = results[0], results[1]
    assert skip0 == skip1 == [s in _BAD_STEPS for s in range(len(skip0))], (skip0, skip1)
    assert scales0 == scales1
    for a, b in zip(params0, params1, strict=True):
        assert a.tobytes() == b.tobytes()  # the replicas are bitwise identical
    assert out0.tobytes() == out1.tobytes()


@pytest.mark.parametrize("case", ["synced", "no_sync", "unused_branch"])
def test_one_rank_overflowing_in_what_ddp_reduces_skips_every_rank(case):
    """inf/NaN in a gradient DDP reduces (in the synced micro-batch, in a no_sync micro-batch
    it accumulates, or in a branch only that rank ran, with find_unused_parameters) reaches every
    rank through the reduction: all skip the same steps with no agreement call."""
    job = ThreadWorld(_make_group, W)
    try:
        results = job.run(lambda r: _overflow_run(job.pgs[r], r, case))
    finally:
        job.close()
    _assert_in_step(results)


def test_one_rank_overflowing_outside_ddp_skips_every_rank_once_replicas_agree():
    """A parameter DDP does not reduce overflows on rank 1 alone: without an agreement rank 1
    skips and rank 0 steps (DDP's replicas part); with agree_for_replicas (what DDP calls at
    construction) every GradScaler over DDP's parameters agrees by itself."""
    job = ThreadWorld(_make_group, W)
    try:
        apart = job.run(lambda r: _overflow_run(job.pgs[r], r, "outside_ddp", "local"))
        together = job.run(lambda r: _overflow_run(job.pgs[r], r, "outside_ddp", "replicas"))
    finally:
        job.close()
    assert apart[0][0] == [False] * 6 and apart[1][0] == [s in _BAD_STEPS for s in range(6)]
    assert apart[0][2][0].tobytes() != apart[1][2][0].tobytes()
    _assert_in_step(together)


def test_ddp_agrees_by_itself_when_a_parameter_outside_it_overflows_on_one_rank():
    job = ThreadWorld(_make_group, W)
    try:
        results = job.run(lambda r: _overflow_run(job.pgs[r], r, "outside_ddp"))
    finally:
        job.close()
    _assert_in_step(results)


def test_a_paused_replica_agreement_keeps_the_verdict_local():
    """Under DDP's Join a rank that ran out of data does not step: the agreement must not wait
    for it. Only rank 0 steps here; paused, its verdict is its own, without a collective."""
    from shoal.collectives.amp import agree_for_replicas

    def run(pg, rank):
        model = core.nn.Linear(2, 1)
        handle = agree_for_replicas(model.parameters(), pg, timeout=5, paused=lambda: True)
        try:
            if rank == 1:
                return None
            opt = core.optim.SGD(model.parameters(), lr=0.1)
            scaler = GradScaler("cpu", init_scale=4.0)
            scaler.scale(model(core.ones(1, 2)).sum()).backward()
            return scaler.step(opt) is None and scaler.update() is None and scaler.get_scale()
        finally:
            handle.remove()

    job = ThreadWorld(_make_group, W)
    try:
        results = job.run(lambda r: run(job.pgs[r], r))
    finally:
        job.close()
    assert results[0] == 4.0 and results[1] is None


def test_a_dropped_ddp_leaves_nothing_registered_and_a_destroyed_group_lets_the_scaler_step():
    """The registry holds no strong reference to DDP: a wrapper that is dropped is freed with
    its agreement; and after the group is destroyed, a scaler over the same parameters decides
    alone (and steps) instead of raising GroupDestroyed."""
    import gc
    import weakref

    from shoal.collectives.ddp.ddp import DistributedDataParallel
    from shoal.core.amp import found_inf

    job = ThreadWorld(_make_group, 1)
    try:
        model = core.nn.Linear(3, 2)
        ddp = DistributedDataParallel(model, process_group=job.pgs[0])
        freed = weakref.ref(ddp)
        assert len(found_inf.agreements_for(model.parameters())) == 1
        del ddp
        gc.collect()
        assert freed() is None
        assert found_inf.agreements_for(model.parameters()) == []
        kept = DistributedDataParallel(model, process_group=job.pgs[0])
        assert len(found_inf.agreements_for(model.parameters())) == 1
    finally:
        job.close()  # destroys the group under the wrapper that still exists
    opt = core.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.array.copy()
    scaler = GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(core.ones(1, 3)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert not np.array_equal(model.weight.array, before)  # stepped: no GroupDestroyed, no skip
    assert scaler.get_scale() == 4.0
    del kept
