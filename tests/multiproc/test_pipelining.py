"""collectives.pipelining over real processes: GPipe and 1F1B at 2 and 3 stages of uneven sizes,
and 2 stages x 2 data-parallel replicas at W=4, each ending with the parameters one process
reaches training the whole model on the same data.

Why the bound holds: the model is float64 and every step's gradient differs from the single
process's only in how sums are grouped (per micro-batch, then over micro-batches and replicas,
instead of over the whole batch at once) and in dividing by 3 then 4 instead of by 12. Each
such regrouping of at most 24 terms moves a sum by under 24 * 2**-53 of the sum of the terms'
magnitudes (about 3e-15 relative), and three SGD steps at lr 0.1 on this small model amplify
that by far less than 1e3, so 1e-11 is a wide margin on any IEEE-754 machine, while a schedule
that lost or doubled one micro-batch's gradient would miss it by about 1e-2.
"""

from __future__ import annotations

import numpy as np

from tests.support.ranks import agent_store, run_ranks

STEPS = 3
ROWS = 12  # per step and replica
MICRO = 4
WIDTHS = [6, 10, 7, 5, 3]
CUTS = {2: [0, 2, 8], 3: [0, 2, 6, 8]}  # module index where each stage starts: uneven stages
TOLERANCE = 1e-11


def _model():
    from shoal import core
    from shoal.core import nn

    core.manual_seed(0)
    layers = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:]):
        layers += [nn.Linear(a, b, dtype=core.float64), nn.Tanh()]
    return layers  # 8 modules: the last Tanh keeps the output bounded


def _batch(step, replica):
    from shoal.core.tensor import Tensor

    rng = np.random.default_rng([step, replica])
    return Tensor(rng.standard_normal((ROWS, WIDTHS[0]))), Tensor(
        rng.uniform(-0.5, 0.5, (ROWS, WIDTHS[-1])))


def _mse(out, target):
    diff = out - target
    return (diff * diff).mean()


def _reference(replicas):
    """One process, the whole model, the replicas' batches averaged: what DDP would compute."""
    from shoal import core
    from shoal.core import nn

    model = nn.Sequential(*_model())
    opt = core.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        for r in range(replicas):
            x, y = _batch(step, r)
            (_mse(model(x), y) * (1.0 / replicas)).backward()
        opt.step()
    return [p.array.copy() for p in model.parameters()]


def _train_stage(stage, schedule_cls, replica, lr=0.1):
    from shoal import core

    sched = schedule_cls(stage, MICRO, loss_fn=_mse)
    opt = core.optim.SGD(stage.submod.parameters(), lr=lr, momentum=0.9)
    seen = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _batch(step, replica)
        losses = []
        out = sched.step(x if stage.is_first else None, target=y if stage.is_last else None,
                         losses=losses)
        if stage.is_last:
            assert len(losses) == MICRO and tuple(out.shape) == (ROWS, WIDTHS[-1])
            seen.append(float(sum(loss.item() for loss in losses)) / MICRO)
        else:
            assert out is None and losses == []
        opt.step()
    return [p.array.copy() for p in stage.submod.parameters()], seen


def _pipeline_rank(rank, world, schedules):
    import shoal.collectives as c
    from shoal.collectives import pipelining
    from shoal.core import nn

    c.init_process_group("tcp", init_method="env://", timeout=30)
    try:
        results = {}
        for name in schedules:
            layers = _model()
            cut = CUTS[world]
            stage = pipelining.PipelineStage(nn.Sequential(*layers[cut[rank]:cut[rank + 1]]),
                                             rank, world, timeout=30)
            results[name] = _train_stage(stage, getattr(pipelining, name), replica=0)
        return results
    finally:
        c.destroy_process_group()


def _pipeline_dp_rank(rank, world):
    """2 stages x 2 replicas: pipelines {0, 1} and {2, 3}, data-parallel groups {0, 2}, {1, 3}."""
    import shoal.collectives as c
    from shoal.collectives import pipelining
    from shoal.core import nn

    c.init_process_group("tcp", init_method="env://", timeout=30)
    try:
        stages = 2
        pipes = [c.new_group([r * stages + s for s in range(stages)], timeout=30)
                 for r in range(world // stages)]
        dps = [c.new_group(list(range(s, world, stages)), timeout=30) for s in range(stages)]
        s_idx, replica = rank % stages, rank // stages
        cut = CUTS[stages]
        module = nn.Sequential(*_model()[cut[s_idx]:cut[s_idx + 1]])
        ddp = c.DistributedDataParallel(module, process_group=dps[s_idx])
        stage = pipelining.PipelineStage(ddp, s_idx, stages, group=pipes[replica], timeout=30)
        return _train_stage(stage, pipelining.Schedule1F1B, replica)
    finally:
        c.destroy_process_group()


def _run(target, world, args=()):
    store, env = agent_store()
    try:
        return run_ranks(target, world, args=args, timeout=120, env=env)
    finally:
        store.close()


def _assert_matches(stage_params, reference):
    got = [p for params in stage_params for p in params]
    assert len(got) == len(reference)
    for a, b in zip(got, reference):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE)


def test_gpipe_and_1f1b_at_two_and_three_uneven_stages_match_one_process():
    reference = _reference(1)
    for world in (2, 3):
        results = _run(_pipeline_rank, world, (("ScheduleGPipe", "Schedule1F1B"),))
        for name in ("ScheduleGPipe", "Schedule1F1B"):
            _assert_matches([results[r][name][0] for r in range(world)], reference)
            losses = results[world - 1][name][1]
            assert losses[-1] < losses[0]  # it trains


def test_pipeline_times_data_parallel_at_w4_matches_one_process():
    reference = _reference(2)
    results = _run(_pipeline_dp_rank, 4)
    for replica in range(2):
        _assert_matches([results[replica * 2 + s][0] for s in range(2)], reference)
