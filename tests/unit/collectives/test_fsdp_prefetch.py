"""Where fully_shard issues its gathers (one rank: a world of one tcp group, whose gathers still
run on the group's worker thread, so "issued" and "finished" are apart as with more ranks)."""

import pytest

from shoal import core
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.fsdp import fully_shard
from shoal.collectives.fsdp.sharded_module import _STATES
from shoal.collectives.store.hash import HashStore


@pytest.fixture(scope="module")
def group():
    pg = ProcessGroupTCP(HashStore(), 0, 1, timeout=5)
    yield pg
    pg.shutdown()


class _Net(core.nn.Module):
    """Two sharded layers and a head that only the root holds (GPT's shape in small)."""

    def __init__(self):
        super().__init__()
        self.layers = core.nn.ModuleList([core.nn.Linear(3, 4), core.nn.Linear(4, 4)])
        self.head = core.nn.Linear(4, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _gather_issued(module) -> bool:
    group = _STATES[module].group
    return group.unsharded or group._gather is not None


def test_the_roots_backward_issues_the_last_layers_gather_before_the_head_runs(group):
    # torch FSDP2 prefetches in backward by the order forwards *ended*, where the root comes
    # last, so its pre-backward issues the last layer's gather; by the order forwards began
    # the root is first and has nothing before it, and the gather waited for the layer itself.
    core.manual_seed(0)
    net = _Net()
    for layer in net.layers:
        fully_shard(layer, mesh=group)
    fully_shard(net, mesh=group)
    last = net.layers[1]
    seen = []

    def watch_head_input(module, args):
        if args[0].requires_grad:  # the head's input gradient exists: the head ran backward
            args[0].register_hook(lambda grad: seen.append(_gather_issued(last)))

    net.head.register_forward_pre_hook(watch_head_input)
    for _ in range(2):  # the first step learns the order; the second uses it
        net(core.randn(5, 3)).sum().backward()
    assert seen == [True, True]
    assert not _gather_issued(last)  # the step's end reshards and leaves nothing in flight
