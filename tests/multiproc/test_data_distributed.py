"""DistributedSampler and DataPipe sharding in real process groups: defaults read the default
group, the ranks' shares are torch's and cover the dataset, and pipes shard by the group."""

from __future__ import annotations

import pytest

from tests.support.ranks import agent_store, run_ranks


def _shares(rank, world):
    import shoal.collectives as c
    from shoal.core import data

    with pytest.raises(c.CollectiveError, match="call collectives.init_process_group"):
        c.DistributedSampler(range(10))
    c.init_process_group("tcp", init_method="env://", timeout=20)
    try:
        sampler = c.DistributedSampler(range(29), seed=4)
        sampler.set_epoch(2)
        # num_workers=0: these spawned ranks are daemonic, and multiprocessing forbids a
        # daemonic process children (tests/integration/test_data_resume.py runs workers in ranks)
        loader = data.DataLoader(range(29), batch_size=3, sampler=sampler)
        mine = [i for b in loader for i in b.data.tolist()]
        gathered = [None] * world
        c.all_gather_object(gathered, mine)
        c.set_datapipe_sharding()
        pipe = (data.datapipes.IterableWrapper(range(40)).shuffle(buffer_size=8)
                .sharding_filter())
        piped = [i for b in data.DataLoader(pipe, batch_size=4, generator=data.Generator(1))
                 for i in b.data.tolist()]
        return sampler.rank, sampler.num_replicas, mine, gathered, piped
    finally:
        c.destroy_process_group()


def test_defaults_read_the_default_group_and_shares_cover_the_dataset():
    torch = pytest.importorskip("torch")
    store, env = agent_store()
    try:
        results = run_ranks(_shares, 3, timeout=90, env=env)
    finally:
        store.close()
    for rank, (r, world, mine, gathered, _) in enumerate(results):
        assert (r, world) == (rank, 3)
        theirs = torch.utils.data.DistributedSampler(range(29), 3, rank, seed=4)
        theirs.set_epoch(2)
        assert mine == list(theirs)
        assert gathered == [res[2] for res in results]
    assert {i for res in results for i in res[2]} == set(range(29))
    piped = sorted(i for res in results for i in res[4])
    assert piped == list(range(40))  # each rank its shard of one shared shuffle: each item once


def test_workers_in_a_daemonic_process_are_refused_with_a_reason():
    results = run_ranks(_daemonic, 1, timeout=60)
    assert "this process is daemonic" in results[0]


def _daemonic(rank, world):
    from shoal.core import data

    try:
        list(data.DataLoader(range(4), num_workers=1))
    except data.DataLoaderError as exc:
        return str(exc)
    return "no error"
