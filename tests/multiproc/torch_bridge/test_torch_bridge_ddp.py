"""torch DDP on the "shoal" backend ends with the same parameters as on gloo: the same model,
data and optimizer trained once on each, in the same processes (the world on "shoal", a gloo
group of the same ranks beside it): small buckets, a comm hook that chains futures (float16
compression), no_sync accumulation, and uneven inputs under join. On "shoal" both ways a bucket
can be reduced: handed to the group's worker thread (the default), and inline in backward's
thread (`inline_in_backward`); and a rank killed in the middle of DDP's backward is named to the
others in seconds, either way (it used to crash them: see `torch_bridge.work`)."""

from __future__ import annotations

import re

import pytest



def _train(torch, dist, pg, rank, steps, hook=True):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                torch.nn.Tanh(), torch.nn.Linear(32, 4))
    # 2 KB buckets: the 1.3k parameters travel in several buckets, issued while backward runs.
    ddp = DDP(model, process_group=pg, bucket_cap_mb=0.002)
    if hook:
        ddp.register_comm_hook(pg, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g))
               for _ in range(steps)]
    with ddp.join():
        for i, (x, y) in enumerate(batches):
            if i % 3 == 1:
                with ddp.no_sync():  # accumulate locally; the next step reduces both
                    torch.nn.functional.mse_loss(ddp(x), y).backward()
                continue
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


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
            on_gloo = _train(torch, dist, gloo, rank, steps, hook)
            for inline in (False, True):
                dist.group.WORLD.inline_in_backward = inline
                on_shoal = _train(torch, dist, dist.group.WORLD, rank, steps, hook)
                worst[hook, inline] = max(float((a - b).abs().max())
                                          for a, b in zip(on_shoal, on_gloo))
        moved = min(float((a - b).abs().max()) for a, b in zip(
            on_shoal, _train(torch, dist, None, rank, 0)))
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


def _killed_in_backward(rank, world, inline):
    import datetime
    import os
    import signal
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import shoal.torch_bridge  # noqa: F401 - registers the "shoal" backend

    torch.set_num_threads(1)
    # The group's timeout is far beyond the bound below: the error must come from the lost link.
    dist.init_process_group("shoal", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    dist.group.WORLD.inline_in_backward = inline
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)),
              bucket_cap_mb=0.05)  # one bucket per layer (66 KB each)
    x = torch.randn(16, 64)
    for _ in range(2):  # the second iteration rebuilds the buckets (a broadcast in forward)
        ddp(x).sum().backward()
    if rank == world - 1:
        # Die in backward, after the last layer's bucket was reduced with the others and before
        # the first layer's is launched: they lose it inside the all_reduce of that bucket.
        ddp.module[0].weight.register_hook(lambda _: os.kill(os.getpid(), signal.SIGKILL))
    start = time.monotonic()
    try:
        for _ in range(1000):
            ddp(x).sum().backward()
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever was raised
        return str(exc), time.monotonic() - start
    return None, time.monotonic() - start


@pytest.mark.parametrize("inline", [False, True])
def test_a_rank_killed_during_ddp_backward_is_named(torch_env, inline):
    from tests.support.ranks import Ranks

    with Ranks(_killed_in_backward, 3, (inline,), torch_env) as ranks:
        results = ranks.results(timeout=90, ranks=[0, 1])
    for rank in (0, 1):
        status, (message, elapsed) = results[rank]
        assert status == "ok" and message is not None, (rank, results[rank])
        # DDP re-raises the bucket's error at the end of backward; it keeps shoal's sentence.
        assert re.search(rf"Rank {rank} failed all_reduce #\d+ of group 'default': rank 2 was "
                         "lost", message), message
        # A dead peer's socket closes at once; 15 s leaves room for a loaded 2-core machine.
        assert elapsed < 15, (rank, elapsed, message)
