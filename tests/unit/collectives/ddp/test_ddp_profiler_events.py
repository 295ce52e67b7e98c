"""DDP's bucket all-reduces appear in the profiler's trace: one event per bucket and step,
with the bucket's index, bytes, and how long its first gradient waited for its last."""

from __future__ import annotations

import time

import numpy as np

from shoal import core
from shoal.collectives import DistributedDataParallel
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.store.hash import HashStore
from shoal.core import nn, profiler


def test_each_bucket_all_reduce_is_an_event_with_its_index_bytes_and_wait():
    pg = ProcessGroupTCP(HashStore(), 0, 1, timeout=10)
    try:
        core.manual_seed(0)
        model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(),
                                                      nn.Linear(256, 8)),
                                        process_group=pg, bucket_cap_mb=0.05)
        x = core.tensor(np.ones((4, 64), np.float32))
        with profiler.profile() as prof:
            for _ in range(2):
                model(x).sum().backward()
        events = [fe.ev for fe in prof.events() if fe.ev.cat == "ddp"]
    finally:
        pg.shutdown()
    sizes = sorted({(e.args["bucket"], e.args["bytes"]) for e in events})
    total = sum(p.array.nbytes for p in model.parameters())
    assert len(events) == 2 * len(sizes) and len(sizes) >= 2  # several buckets, every step
    assert sum(b for _, b in sizes) == total
    assert all(e.name == f"DDP bucket {e.args['bucket']} all_reduce" for e in events)
    assert all(e.args["waited_for_last_gradient_us"] >= 0 and e.dur >= 0 for e in events)


def test_the_wait_for_the_last_gradient_is_the_delay_of_a_late_gradient():
    pg = ProcessGroupTCP(HashStore(), 0, 1, timeout=10)
    try:
        core.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
        # the first layer's weight gets its gradient last in backward, and 20 ms late: the
        # bucket (one here) holds the last layer's gradients, which arrived first, that long
        net[0].weight.register_hook(lambda g: time.sleep(0.02))
        model = DistributedDataParallel(net, process_group=pg)
        x = core.tensor(np.ones((4, 64), np.float32))
        with profiler.profile() as prof:
            # the first round reduces after backward, in the layout rebuilt from the arrival
            # order; the others as gradients arrive
            for _ in range(3):
                model(x).sum().backward()
        events = [fe.ev for fe in prof.events() if fe.ev.cat == "ddp"]
    finally:
        pg.shutdown()
    assert [e.args["bucket"] for e in events] == [0, 0, 0]
    waits = [e.args["waited_for_last_gradient_us"] for e in events]
    assert all(w >= 20_000 for w in waits), waits
