"""Resuming across epoch boundaries: load_state_dict then set_epoch behaves as in torch (the
saved epoch continues mid-epoch, another epoch starts from its beginning, none is skipped),
a state taken between epochs names the right epoch, and len(loader) after load_state_dict
counts the batches the next iteration yields."""

from __future__ import annotations

import pytest

from shoal.collectives.data import DistributedSampler
from shoal.core import data
from shoal.core.data import datapipes as dp

torch = pytest.importorskip("torch")

N, WORLD, RANK, BATCH, SEED = 23, 2, 1, 3, 5


def loader_and_sampler():
    sampler = DistributedSampler(range(N), WORLD, RANK, seed=SEED)
    return data.DataLoader(range(N), batch_size=BATCH, sampler=sampler), sampler


def torch_epoch(epoch: int) -> list[list[int]]:
    sampler = torch.utils.data.DistributedSampler(range(N), WORLD, RANK, seed=SEED)
    sampler.set_epoch(epoch)
    indices = list(sampler)
    return [indices[k:k + BATCH] for k in range(0, len(indices), BATCH)]


def epoch_of(loader) -> list[list[int]]:
    return [b.array.tolist() for b in loader]


def test_an_end_of_epoch_state_then_set_epoch_reads_the_next_epochs_whole():
    loader, sampler = loader_and_sampler()
    sampler.set_epoch(0)
    assert epoch_of(loader) == torch_epoch(0)
    state = loader.state_dict()  # after the epoch's last batch
    assert state["sampler"]["epoch"] == 0 and state["sampler"]["start"] == N
    again, resumed = loader_and_sampler()
    again.load_state_dict(state)
    for epoch in (1, 2):  # neither empty nor skipped
        resumed.set_epoch(epoch)
        assert epoch_of(again) == torch_epoch(epoch)


def test_set_epoch_to_the_saved_epoch_continues_it_and_another_starts_afresh():
    loader, sampler = loader_and_sampler()
    sampler.set_epoch(3)
    it = iter(loader)
    head = [next(it).array.tolist() for _ in range(2)]
    state = loader.state_dict()
    same, same_sampler = loader_and_sampler()
    same.load_state_dict(state)
    same_sampler.set_epoch(3)
    assert head + epoch_of(same) == torch_epoch(3)
    other, other_sampler = loader_and_sampler()
    other.load_state_dict(state)
    other_sampler.set_epoch(4)
    assert epoch_of(other) == torch_epoch(4)


def test_a_state_taken_between_set_epoch_and_iter_names_the_new_epochs_start():
    loader, sampler = loader_and_sampler()
    sampler.set_epoch(0)
    epoch_of(loader)
    sampler.set_epoch(1)  # the loop moved on; the finished iterator counts no longer
    state = loader.state_dict()
    assert (state["sampler"]["epoch"], state["sampler"]["start"]) == (1, 0)
    again, _ = loader_and_sampler()
    again.load_state_dict(state)
    assert epoch_of(again) == torch_epoch(1)


@pytest.mark.parametrize("kind", ["distributed", "sequential", "random"])
def test_len_after_load_state_dict_counts_what_the_next_iteration_yields(kind):
    def build():
        if kind == "distributed":
            return loader_and_sampler()[0]
        if kind == "sequential":
            return data.DataLoader(range(N), batch_size=BATCH)
        return data.DataLoader(range(N), batch_size=BATCH, shuffle=True,
                               generator=data.Generator(2))

    loader = build()
    full = len(loader)
    assert full == len(epoch_of(build()))
    it = iter(loader)
    for _ in range(3):
        next(it)
    again = build()
    again.load_state_dict(loader.state_dict())
    left = len(again)
    assert left == full - 3 and len(epoch_of(again)) == left
    assert len(again) == full  # the next iteration is a whole epoch again


def test_set_epoch_to_another_epoch_after_load_restores_the_whole_length():
    loader, sampler = loader_and_sampler()
    it = iter(loader)
    next(it)
    again, resumed = loader_and_sampler()
    again.load_state_dict(loader.state_dict())
    assert len(again) == len(loader) - 1
    resumed.set_epoch(0)
    assert len(again) == len(loader) - 1
    resumed.set_epoch(1)
    assert len(again) == len(loader)


def test_an_iterable_loaders_len_is_its_whole_streams_as_in_torch():
    def build():
        return data.DataLoader(dp.IterableWrapper(range(20)), batch_size=3)

    loader = build()
    it = iter(loader)
    next(it), next(it)
    again = build()
    again.load_state_dict(loader.state_dict())
    assert len(again) == len(loader) == 7
    assert len(epoch_of(again)) == 5
