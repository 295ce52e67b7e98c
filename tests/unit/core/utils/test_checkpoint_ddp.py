"""core.utils.checkpoint under DistributedDataParallel (two thread ranks on the tcp backend): a
block used twice through two non-reentrant checkpoints gets its gradient once per backward, as
without checkpointing, so DDP needs no static_graph, and training ends with the same parameters
bit for bit as the same DDP job without checkpointing. (No dropout here: thread ranks share
core's one random stream; dropout's replay is tested in test_checkpoint.py.)"""

import numpy as np

from shoal import core
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.ddp.ddp import DistributedDataParallel
from shoal.core import nn
from shoal.core.utils.checkpoint import checkpoint
from tests.support.thread_world import ThreadWorld


def _make_group(store, rank, size, *, name, global_ranks, timeout):
    return ProcessGroupTCP(store, rank, size, timeout=timeout, name=name, global_ranks=global_ranks)


class _Twice(nn.Module):
    """One block applied twice, each time inside its own checkpoint (or not)."""

    def __init__(self, ckpt: bool) -> None:
        super().__init__()
        core.manual_seed(0)
        self.inp = nn.Linear(6, 8, dtype=core.float64)
        self.block = nn.Linear(8, 8, dtype=core.float64)
        self.out = nn.Linear(8, 3, dtype=core.float64)
        self.ckpt = ckpt

    def _body(self, t):
        return self.block(t).tanh()

    def forward(self, x):
        h = self.inp(x).tanh()
        for _ in range(2):
            h = checkpoint(self._body, h) if self.ckpt else self._body(h)
        return self.out(h)


def _train(pg, model):
    ddp = DistributedDataParallel(model, process_group=pg)
    opt = core.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        rng = np.random.default_rng([step, pg.rank()])
        x = core.tensor(rng.standard_normal((4, 6)))
        y = core.tensor(rng.standard_normal((4, 3)))
        opt.zero_grad()
        diff = ddp(x) - y
        (diff * diff).mean().backward()
        opt.step()
    return [p.array.copy() for p in ddp.parameters()]


def test_checkpointed_block_used_twice_trains_under_ddp_like_no_checkpointing():
    job = ThreadWorld(_make_group, 2)
    try:
        # Built here, one after another: thread ranks share core's one random stream.
        models = {ck: [_Twice(ck) for _ in range(2)] for ck in (False, True)}
        plain = job.run(lambda r: _train(job.pgs[r], models[False][r]))
        ckpt = job.run(lambda r: _train(job.pgs[r], models[True][r]))
    finally:
        job.close()
    for rank in range(2):
        for a, b in zip(plain[rank], ckpt[rank]):
            assert np.array_equal(a, b)
    for a, b in zip(ckpt[0], ckpt[1]):
        assert np.array_equal(a, b)
