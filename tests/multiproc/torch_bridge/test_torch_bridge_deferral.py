"""torch DDP on "shoal" with its buckets' all_reduces parked until backward ends
(`defer_in_backward=True`, the default where a host has no core per rank to spare): the same
parameters as on gloo with several buckets, a comm hook that chains futures, no_sync and uneven
inputs under join; and a rank killed in the middle of backward is named to the others in seconds,
the error raised where DDP waits for the parked bucket."""

from __future__ import annotations

import re


def _train(torch, pg, rank, steps, hook):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = DDP(model, process_group=pg, bucket_cap_mb=0.002)  # 2 KB: several buckets
    if hook:
        ddp.register_comm_hook(pg, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g))
               for _ in range(steps)]
    with ddp.join():
        for i, (x, y) in enumerate(batches):
            if i % 3 == 1:
                with ddp.no_sync():
                    torch.nn.functional.mse_loss(ddp(x), y).backward()
                continue
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


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
            on_gloo = _train(torch, gloo, rank, steps, hook)
            before = pg.shoal_group.ledger.seq
            on_shoal = _train(torch, pg, rank, steps, hook)
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


def _killed_while_parked(rank, world):
    import datetime
    import os
    import signal
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import shoal.torch_bridge  # noqa: F401 - registers the "shoal" backend

    torch.set_num_threads(1)
    dist.init_process_group("shoal", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    dist.group.WORLD.defer_in_backward = True
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)),
              bucket_cap_mb=0.05)  # one bucket per layer
    x = torch.randn(16, 64)
    for _ in range(2):
        ddp(x).sum().backward()
    if rank == world - 1:
        # Dies in backward after parking the last layer's bucket: the others lose it while
        # running their parked buckets at the end of backward.
        ddp.module[0].weight.register_hook(lambda _: os.kill(os.getpid(), signal.SIGKILL))
    start = time.monotonic()
    try:
        for _ in range(1000):
            ddp(x).sum().backward()
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever was raised
        return str(exc), time.monotonic() - start
    return None, time.monotonic() - start


def test_a_rank_killed_while_buckets_are_parked_is_named(torch_env):
    from tests.support.ranks import Ranks

    with Ranks(_killed_while_parked, 3, (), torch_env) as ranks:
        results = ranks.results(timeout=90, ranks=[0, 1])
    for rank in (0, 1):
        status, (message, elapsed) = results[rank]
        assert status == "ok" and message is not None, (rank, results[rank])
        assert re.search(rf"Rank {rank} failed all_reduce #\d+ of group 'default': rank 2 was "
                         "lost", message), message
        # A dead peer's socket closes at once; 15 s leaves room for a loaded 2-core machine.
        assert elapsed < 15, (rank, elapsed, message)

