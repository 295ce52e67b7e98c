"""fully_shard, ZeroRedundancyOptimizer and its DDP hook refuse misuse with errors that say
what to do (one rank: a world of one tcp group)."""

import pytest

from shoal import core
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.fsdp import FSDPError, FSDPModule, fully_shard
from shoal.collectives.optim import ZeroRedundancyOptimizer
from shoal.collectives.store.hash import HashStore


@pytest.fixture(scope="module")
def group():
    pg = ProcessGroupTCP(HashStore(), 0, 1, timeout=5)
    yield pg
    pg.shutdown()


def _net():
    return core.nn.Sequential(core.nn.Linear(3, 4), core.nn.Linear(4, 2))


def test_sharding_twice_or_a_parent_first_is_refused(group):
    net = _net()
    fully_shard(net[0], mesh=group)
    assert isinstance(net[0], FSDPModule) and type(net[0]).__name__ == "FSDPLinear"
    with pytest.raises(FSDPError, match="already applied"):
        fully_shard(net[0], mesh=group)
    parent_first = _net()
    fully_shard(parent_first, mesh=group)
    with pytest.raises(FSDPError, match="apply fully_shard to the layers first"):
        fully_shard(parent_first[0], mesh=group)
    with pytest.raises(FSDPError, match="shard_placement_fn"):
        fully_shard(_net(), mesh=group, shard_placement_fn=lambda p: None)


def test_one_rank_is_a_plain_model_and_the_shards_are_whole(group):
    core.manual_seed(1)
    plain = _net()
    core.manual_seed(1)
    net = fully_shard(_net(), mesh=group)
    x = core.randn(5, 3)
    assert core.allclose(net(x), plain(x))
    weight = net[0].weight
    assert weight.shape == (12,) and weight.global_shape == (4, 3)
    assert core.equal(weight.full_tensor(), plain[0].weight.detach())


def test_the_overlap_hook_needs_an_overlapping_zero_which_step_does_not_drive(group, caplog):
    from shoal.collectives.ddp.comm_hooks import allreduce_hook
    from shoal.collectives.ddp.ddp import DistributedDataParallel
    from shoal.collectives.optim import hook_with_zero_step

    ddp = DistributedDataParallel(_net(), process_group=group)
    plain = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=core.optim.SGD,
                                    process_group=group, lr=0.1)
    with pytest.raises(ValueError, match="overlap_with_ddp=True"):
        hook_with_zero_step(allreduce_hook, ddp, plain)
    overlapping = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=core.optim.SGD,
                                          process_group=group, overlap_with_ddp=True, lr=0.1)
    assert overlapping.step() is None
    assert "should not be called with overlap_with_ddp=True" in caplog.text
    unused = DistributedDataParallel(_net(), process_group=group, find_unused_parameters=True)
    with pytest.raises(ValueError, match="find_unused_parameters"):
        hook_with_zero_step(allreduce_hook, unused, overlapping)


def test_zero_steps_alone_at_one_rank(group):
    net = _net()
    zero = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=core.optim.SGD,
                                   process_group=group, lr=0.1)
    before = net[0].weight.detach().numpy().copy()
    net(core.randn(2, 3)).sum().backward()
    zero.step()
    assert not (net[0].weight.detach().numpy() == before).all()
    zero.add_param_group({"params": [core.nn.Parameter(core.ones(3))], "lr": 0.5})
    assert [g["lr"] for g in zero.optim.param_groups] == [0.1, 0.5]
