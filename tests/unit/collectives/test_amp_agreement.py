"""collectives.amp.agree_on_found_inf: ranks (threads over real tcp groups) skip the same steps."""

from __future__ import annotations

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
