"""Sharded checkpoints of fully_shard jobs: a restarted job resumes bitwise, and a checkpoint
saved at W=4 trains on at W=2 and then W=3 as one uninterrupted process does.

Every step trains on one global batch of 12 rows, split evenly across the ranks (12 divides by
4, 2 and 3), so the averaged gradient is the global batch's at every world size; what differs
between world sizes is only the order of the sums in the reduce_scatter, a few ulps of float64,
and Adam's per-step update is bounded by lr, so the parameters agree far within 1e-9.
"""

from __future__ import annotations

import numpy as np

from tests.multiproc.test_sharding import LR, full_state, make_model, mse, sharded
from tests.support.ranks import run_ranks

ROWS = 12
RTOL, ATOL = 1e-9, 1e-10  # see the module docstring


def global_batch(step):
    from shoal.core.tensor import Tensor

    rng = np.random.default_rng([99, step])
    return Tensor(rng.standard_normal((ROWS, 7))), Tensor(rng.standard_normal((ROWS, 3)))


def _group(rank, world, port):
    from shoal.collectives.backends.tcp.group import ProcessGroupTCP
    from shoal.collectives.store.tcp import TCPStore

    return ProcessGroupTCP(TCPStore("127.0.0.1", port, timeout=30), rank, world, timeout=30)


def _run(rank, world, port, jobs):
    """Each job (start, stop, load_from, save_to) on a fresh model; their final parameters."""
    group = _group(rank, world, port)
    try:
        return [_job(group, *job) for job in jobs]
    finally:
        group.shutdown()


def _job(group, start, stop, load_from, save_to):
    from shoal import core
    from shoal.collectives import checkpoint as dcp
    from shoal.collectives.checkpoint.state_dict import get_state_dict, set_state_dict

    rank, world = group.rank(), group.size()
    model = sharded(make_model(), group)
    opt = core.optim.Adam(model.parameters(), lr=LR)
    if load_from:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=load_from, process_group=group)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    rows = ROWS // world
    for step in range(start, stop):
        opt.zero_grad()
        x, y = global_batch(step)
        mse(model(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows]
            ).backward()
        opt.step()
    if save_to:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=save_to, process_group=group)
    return full_state(model)


def _launch(world, *jobs):
    from shoal.collectives.store.tcp import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size=world, is_master=True, timeout=30,
                     wait_for_workers=False)
    try:
        return run_ranks(_run, world, args=(store.port, jobs), timeout=90)[0]
    finally:
        store.close()


def test_a_restarted_job_resumes_bitwise_from_its_sharded_checkpoint(tmp_path):
    whole, _ = _launch(2, (0, 4, None, None), (0, 2, None, str(tmp_path / "step2")))
    # Each rank wrote its own file; no rank wrote another's shards.
    assert sorted(p.name for p in (tmp_path / "step2").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]
    (resumed,) = _launch(2, (2, 4, str(tmp_path / "step2"), None))
    for name, value in whole.items():
        assert np.array_equal(resumed[name], value), name


def test_a_checkpoint_reshards_from_four_ranks_to_two_to_three(tmp_path):
    from shoal import core

    _launch(4, (0, 2, None, str(tmp_path / "w4")))
    _launch(2, (2, 4, str(tmp_path / "w4"), str(tmp_path / "w2")))
    (final,) = _launch(3, (4, 6, str(tmp_path / "w2"), None))
    model = make_model()
    opt = core.optim.Adam(model.parameters(), lr=LR)
    for step in range(6):
        opt.zero_grad()
        x, y = global_batch(step)
        mse(model(x), y).backward()
        opt.step()
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(final[name], value.numpy(), rtol=RTOL, atol=ATOL,
                                   err_msg=name)
