"""collectives.pipelining with stages as thread ranks on the tcp backend (a group forms in
milliseconds this way; tests/multiproc/test_pipelining.py runs real processes, with optimizer
steps and data parallelism): the schedules' gradients against one process, how many
micro-batches each stage holds at once, uneven micro-batches, inference, and misuse."""

import numpy as np
import pytest

from shoal import core
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.pipelining import (
    PipelineError,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    split_microbatches,
)
from shoal.core import nn
from shoal.core.tensor import Tensor
from tests.support.thread_world import ThreadWorld

WIDTHS = [5, 9, 4, 6, 3]


def _make_group(store, rank, size, *, name, global_ranks, timeout):
    return ProcessGroupTCP(store, rank, size, timeout=timeout, name=name, global_ranks=global_ranks)


class _InFlight(core.autograd.Function):
    """Identity that counts micro-batches between their forward and their backward."""

    @staticmethod
    def forward(ctx, counter, x):
        ctx.counter = counter
        counter["now"] += 1
        counter["max"] = max(counter["max"], counter["now"])
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        ctx.counter["now"] -= 1
        return None, g


class _Counted(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.counter = {"now": 0, "max": 0}

    def forward(self, x):
        return _InFlight.apply(self.counter, self.inner(x))  # after a layer: grad flows


def _layers():
    core.manual_seed(0)
    out = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:]):
        out += [nn.Linear(a, b, dtype=core.float64), nn.Tanh()]
    return out


def _mse(out, target):
    diff = out - target
    return (diff * diff).mean()


def _data(rows=12):
    rng = np.random.default_rng(3)
    return Tensor(rng.standard_normal((rows, WIDTHS[0]))), Tensor(rng.standard_normal((rows, 3)))


def _one_process():
    model = nn.Sequential(*_layers())
    x, y = _data()
    _mse(model(x), y).backward()
    return [p.grad.array.copy() for p in model.parameters()]


def _pipeline(world, cuts, schedule_cls, micro, rows=12):
    layers = _layers()
    x, y = _data(rows)
    modules = [_Counted(nn.Sequential(*layers[cuts[s]:cuts[s + 1]])) for s in range(world)]
    job = ThreadWorld(_make_group, world)

    def run(rank):
        stage = PipelineStage(modules[rank], rank, world, group=job.pgs[rank], timeout=10)
        sched = schedule_cls(stage, micro, loss_fn=_mse)
        losses = []
        out = sched.step(*([x] if stage.is_first else []), target=y if stage.is_last else None,
                         losses=losses)
        return out, losses

    try:
        results = job.run(run)
    finally:
        job.close()
    grads = [p.grad.array.copy() for m in modules for p in m.parameters()]
    return grads, [m.counter["max"] for m in modules], results


@pytest.mark.parametrize("schedule_cls", [ScheduleGPipe, Schedule1F1B])
@pytest.mark.parametrize("world,cuts", [(2, [0, 2, 8]), (3, [0, 2, 6, 8])])
def test_gradients_equal_one_process_and_micro_batches_in_flight_follow_the_schedule(
        schedule_cls, world, cuts):
    micro = 4
    grads, in_flight, results = _pipeline(world, cuts, schedule_cls, micro)
    for a, b in zip(grads, _one_process()):
        # float64, regrouped sums of 12 terms and a division by 3 then 4: a few ulps.
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-14)
    if schedule_cls is ScheduleGPipe:
        assert in_flight == [micro] * world
    else:
        assert in_flight == [min(world - s, micro) for s in range(world)]
    out, losses = results[-1]
    assert tuple(out.shape) == (12, 3) and len(losses) == micro
    assert all(r == (None, []) for r in results[:-1])


def test_uneven_micro_batches_split_as_tensor_split():
    x = Tensor(np.arange(10.0).reshape(10, 1))
    assert [tuple(p.shape) for p in split_microbatches(x, 4)] == [(3, 1), (3, 1), (2, 1), (2, 1)]
    grads, _, results = _pipeline(2, [0, 2, 8], Schedule1F1B, 4, rows=10)
    assert tuple(results[-1][0].shape) == (10, 3)
    assert all(np.all(np.isfinite(g)) for g in grads)
    with pytest.raises(PipelineError, match="cannot be split into 4"):
        split_microbatches(Tensor(np.zeros((3, 2))), 4)


class _Split(nn.Module):
    """Stage 0: two inputs in, a tuple out: a float skip tensor, a hidden state and an int mask."""

    def __init__(self):
        super().__init__()
        core.manual_seed(1)
        self.a = nn.Linear(4, 6, dtype=core.float64)
        self.b = nn.Linear(2, 6, dtype=core.float64)

    def forward(self, x, z):
        h = self.a(x).tanh()
        mask = Tensor((x.array[:, :1] > 0).astype(np.int64))
        return h, self.b(z), mask


class _Join(nn.Module):
    def __init__(self):
        super().__init__()
        core.manual_seed(2)
        self.c = nn.Linear(6, 3, dtype=core.float64)

    def forward(self, h, skip, mask):
        return self.c(h * skip) * Tensor(mask.array.astype(np.float64))


def test_stages_pass_tuples_with_a_non_float_member_and_take_several_inputs():
    rng = np.random.default_rng(5)
    x, z = Tensor(rng.standard_normal((8, 4))), Tensor(rng.standard_normal((8, 2)))
    y = Tensor(rng.standard_normal((8, 3)))
    first, last = _Split(), _Join()
    _mse(last(*first(x, z)), y).backward()
    want = [p.grad.array.copy() for p in (*first.parameters(), *last.parameters())]
    for p in (*first.parameters(), *last.parameters()):
        p.grad = None
    job = ThreadWorld(_make_group, 2)

    def run(rank):
        stage = PipelineStage([first, last][rank], rank, 2, group=job.pgs[rank], timeout=10)
        sched = Schedule1F1B(stage, 4, loss_fn=_mse)
        return sched.step(x, z) if rank == 0 else sched.step(target=y)

    try:
        results = job.run(run)
    finally:
        job.close()
    assert tuple(results[1].shape) == (8, 3)
    got = [p.grad.array for p in (*first.parameters(), *last.parameters())]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-14)  # float64, regrouped sums of 8


def test_misuse_is_refused_with_the_rule():
    job = ThreadWorld(_make_group, 2)
    try:
        def bad(rank):
            with pytest.raises(PipelineError, match="num_stages=3 but the group has 2"):
                PipelineStage(nn.Linear(2, 2), rank, 3, group=job.pgs[rank])
            with pytest.raises(PipelineError, match=f"must run on rank {1 - rank} of its group"):
                PipelineStage(nn.Linear(2, 2), 1 - rank, 2, group=job.pgs[rank])
            stage = PipelineStage(nn.Linear(2, 2), rank, 2, group=job.pgs[rank])
            if stage.is_last:
                with pytest.raises(PipelineError, match="needs target="):
                    ScheduleGPipe(stage, 2, loss_fn=_mse).step()
            else:
                with pytest.raises(PipelineError, match="takes the batch: one or more tensors"):
                    ScheduleGPipe(stage, 2, loss_fn=_mse).step()
            with pytest.raises(ValueError, match="n_microbatches must be at least 1"):
                Schedule1F1B(stage, 0)

        job.run(bad)
    finally:
        job.close()
