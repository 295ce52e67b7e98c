"""torch DDP on "shoal" with its buckets' all_reduces parked until backward ends
(`defer_in_backward=True`, the default where a host has no core per rank to spare): the same
parameters as on gloo with several buckets, a comm hook that chains futures, no_sync and uneven
inputs under join; and a rank killed in the middle of backward is named to the others in seconds,
the error raised where DDP waits for the parked bucket."""

from __future__ import annotations

from tests.support.torch_ddp import assert_lost_rank_named, killed_in_backward, train_ddp


def _parked_vs_gloo(rank, world):
    import datetime

    import torch
    import torch.distributed as dist

    import shoal.torch_bridge  # noqa: F401 - registers the "shoal" backend

    torch.set_num_threads(1)
    dist.init_process_group("shoal", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        gloo = dist.new_group(backend="gloo")
        pg = dist.group.WORLD
        pg.defer_in_backward = True
        steps = 6 + rank  # uneven inputs
        worst = {}
        for hook in (False, True):
            on_gloo = train_ddp(torch, gloo, rank, steps, hook)
            before = pg.shoal_group.ledger.seq
            on_shoal = train_ddp(torch, pg, rank, steps, hook)
            worst[hook] = max(float((a - b).abs().max()) for a, b in zip(on_shoal, on_gloo))
            ran = pg.shoal_group.ledger.seq - before
        return worst, ran, pg.deferral.has_pending
    finally:
        dist.destroy_process_group()


def test_parked_buckets_end_with_gloos_parameters(torch_env, run_torch_ranks):
    for rank, (worst, ran, pending) in enumerate(run_torch_ranks(_parked_vs_gloo, 2, timeout=120,
                                                                env=torch_env)):
        # At W=2 both backends add the same two values (one order either way): equal exactly.
        assert worst == {False: 0.0, True: 0.0}, (rank, worst)
        assert ran > 10 and not pending, (rank, ran, pending)


def test_a_rank_killed_while_buckets_are_parked_is_named(torch_env):
    from tests.support.ranks import Ranks

    # The last rank dies in backward after parking the last layer's bucket: the others lose it
    # while running their parked buckets at the end of backward.
    with Ranks(killed_in_backward, 3, ({"defer_in_backward": True},), torch_env) as ranks:
        results = ranks.results(timeout=90, ranks=[0, 1])
    assert_lost_rank_named({r: results[r] for r in (0, 1)})
