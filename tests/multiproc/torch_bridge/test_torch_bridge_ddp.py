"""torch DDP on the "shoal" backend ends with the same parameters as on gloo: the same model,
data and optimizer trained once on each, in the same processes (the world on "shoal", a gloo
group of the same ranks beside it): small buckets, a comm hook that chains futures (float16
compression), no_sync accumulation, and uneven inputs under join. On "shoal" both ways a bucket
can be reduced: the default (handed to the group's worker thread, or parked until backward
ends where the host has no core per rank to spare: test_torch_bridge_deferral.py parks always),
and inline in backward's thread (`inline_in_backward`); and a rank killed in the middle of
DDP's backward is named to the others in seconds, either way (it used to crash them: see
`torch_bridge.work`)."""

from __future__ import annotations

import pytest

from tests.support.torch_ddp import assert_lost_rank_named, killed_in_backward, train_ddp


def _ddp_vs_gloo(rank, world):
    import datetime

    import torch
    import torch.distributed as dist

    import shoal.torch_bridge  # noqa: F401 - registers the "shoal" backend

    torch.set_num_threads(1)
    dist.init_process_group("shoal", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        gloo = dist.new_group(backend="gloo")
        steps = 7 + rank  # uneven inputs: the ranks run out of data at different steps
        worst = {}
        for hook in (False, True):  # without a hook, DDP's C++ reducer calls allreduce itself
            on_gloo = train_ddp(torch, gloo, rank, steps, hook)
            for inline in (False, True):
                dist.group.WORLD.inline_in_backward = inline
                on_shoal = train_ddp(torch, dist.group.WORLD, rank, steps, hook)
                worst[hook, inline] = max(float((a - b).abs().max())
                                          for a, b in zip(on_shoal, on_gloo))
        moved = min(float((a - b).abs().max()) for a, b in zip(
            on_shoal, train_ddp(torch, None, rank, 0)))
        return worst, moved
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_on_shoal_ends_with_gloos_parameters(torch_env, run_torch_ranks, world):
    results = run_torch_ranks(_ddp_vs_gloo, world, timeout=150, env=torch_env)
    for rank, (worst, moved) in enumerate(results):
        assert moved > 1e-3, f"rank {rank}: training left a layer unchanged ({moved})"
        # Both backends reduce the same float16-compressed gradients; at W=3 they may add them
        # in another order, one float16 rounding (2**-11 relative) of gradients below 1, times
        # lr 0.1 over 7 steps: at most 7 * 0.1 * 2 * 2**-11 < 1e-3 apart. At W=2 the sum of two
        # values is the same in either order and the runs agree exactly.
        # Without the hook the gradients are float32 (2**-24 relative): far below 1e-5.
        for inline in (False, True):
            assert worst[True, inline] <= (0.0 if world == 2 else 1e-3), (rank, worst)
            assert worst[False, inline] <= (0.0 if world == 2 else 1e-5), (rank, worst)


@pytest.mark.parametrize("inline", [False, True])
def test_a_rank_killed_during_ddp_backward_is_named(torch_env, inline):
    from tests.support.ranks import Ranks

    with Ranks(killed_in_backward, 3, ({"inline_in_backward": inline},), torch_env) as ranks:
        results = ranks.results(timeout=90, ranks=[0, 1])
    assert_lost_rank_named({r: results[r] for r in (0, 1)})
