"""torch DDP scenarios shared by the torch bridge's multi-process tests (each ddp test file
picks how the "shoal" group runs DDP's buckets: handed to its worker thread, inline in
backward, or parked until backward ends).

`train_ddp` is called inside a rank; `killed_in_backward` is a rank target (module-level, so
`tests.support.ranks` can spawn it) and `assert_lost_rank_named` checks what the survivors saw.
"""

from __future__ import annotations

import re


def train_ddp(torch, pg, rank: int, steps: int, hook: bool = True) -> list:
    """Train a small MLP under DDP on `pg` for `steps` batches of this rank's own data (several
    2 KB buckets, the fp16 compression hook if `hook`, no_sync every third step, uneven inputs
    under join); the parameters after it."""
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


def killed_in_backward(rank: int, world: int, settings: dict):
    """A rank target: DDP on the "shoal" world with `settings` set on its group (say
    {"defer_in_backward": True}); the last rank SIGKILLs itself inside backward. Returns what a
    survivor's loop raised (None if nothing) and how long after the loop began."""
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
    for name, value in settings.items():
        setattr(dist.group.WORLD, name, value)
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)),
              bucket_cap_mb=0.05)  # one bucket per layer (66 KB each)
    x = torch.randn(16, 64)
    for _ in range(2):  # the second iteration rebuilds the buckets (a broadcast in forward)
        ddp(x).sum().backward()
    if rank == world - 1:
        # Die in backward, after the last layer's bucket was issued (reduced, or parked) and
        # before the first layer's is launched: the others lose it inside that all_reduce.
        ddp.module[0].weight.register_hook(lambda _: os.kill(os.getpid(), signal.SIGKILL))
    start = time.monotonic()
    try:
        for _ in range(1000):
            ddp(x).sum().backward()
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever was raised
        return str(exc), time.monotonic() - start
    return None, time.monotonic() - start


def assert_lost_rank_named(results: dict, lost: int = 2) -> None:
    """Every survivor in `results` (rank -> (status, killed_in_backward's value)) raised an
    error naming rank `lost`, soon after it died."""
    for rank, (status, value) in results.items():
        assert status == "ok" and value[0] is not None, (rank, status, value)
        message, elapsed = value
        # DDP re-raises the bucket's error at the end of backward; it keeps shoal's sentence.
        assert re.search(rf"Rank {rank} failed all_reduce #\d+ of group 'default': rank {lost} "
                         "was lost", message), message
        # A dead peer's socket closes at once; 15 s leaves room for a loaded 2-core machine.
        assert elapsed < 15, (rank, elapsed, message)
