"""A loader restarted from its state goes on with the seeds an uninterrupted one draws.

Each iteration draws its base seed (worker seeds, a DataPipe's shuffles) from the loader's
generator. A job restarted mid-epoch builds its loader with a freshly seeded generator; unless
the state carries the generator's place, the epochs after the resumed one repeat the first
epochs' seeds (a shuffled DataPipe replays epoch 1's order). The reference is the same job run
without interruption, itself checked against torch's DataLoader where torch defines the
stream (shuffle=True and DistributedSampler with a seeded generator).
"""

from __future__ import annotations

import functools
import gc
import pickle

import numpy as np
import pytest

import shoal.collectives as collectives
from shoal.collectives.data import DistributedSampler
from shoal.core import data
from shoal.core.data import datapipes as dp
from shoal.core.data.datapipes import sharding

torch = pytest.importorskip("torch")
tud = torch.utils.data

EPOCHS, N, BATCH, SEED = 3, 22, 4, 7
WORLD, RANK, SAMPLER_SEED = 2, 1, 3


def worker_seed(info) -> int:
    return info.seed if info is not None else -1


class Probe(data.Dataset):
    """Sample i: [i, the seed of the worker that read it (-1: the main process)]."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        return np.array([i, worker_seed(data.get_worker_info())], np.int64)


class TorchProbe(tud.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        return np.array([i, worker_seed(tud.get_worker_info())], np.int64)


def tag(x):
    return np.array([x, worker_seed(data.get_worker_info())], np.int64)


def build(kind: str, workers: int) -> data.DataLoader:
    """The job's loader, as a freshly started process builds it."""
    generator = data.Generator(SEED)
    if kind == "pipe":
        pipe = dp.IterableWrapper(range(N)).shuffle(buffer_size=8).sharding_filter().map(tag)
        return data.DataLoader(pipe, batch_size=BATCH, num_workers=workers, generator=generator)
    if kind == "shuffle":  # the RandomSampler draws from the loader's generator
        return data.DataLoader(Probe(), batch_size=BATCH, shuffle=True, num_workers=workers,
                               generator=generator)
    if kind == "own-generator":  # a RandomSampler with a generator of its own
        sampler = data.RandomSampler(Probe(), generator=data.Generator(SEED + 1))
        return data.DataLoader(Probe(), batch_size=BATCH, sampler=sampler, num_workers=workers,
                               generator=generator)
    sampler = DistributedSampler(Probe(), WORLD, RANK, seed=SAMPLER_SEED)
    return data.DataLoader(Probe(), batch_size=BATCH, sampler=sampler, num_workers=workers,
                           generator=generator)


def set_epoch(loader, epoch: int) -> None:
    if isinstance(loader.sampler, DistributedSampler):
        loader.sampler.set_epoch(epoch)


def restart(kind: str, workers: int, loader, epoch: int) -> data.DataLoader:
    """Checkpoint the loader's state, drop the loader, and resume in a new one."""
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    del loader
    gc.collect()  # the abandoned iteration's workers go now, not at some later collection
    resumed = build(kind, workers)
    resumed.load_state_dict(state)
    set_epoch(resumed, epoch)
    return resumed


def run(kind: str, workers: int, stop=None) -> list[list[list[int]]]:
    """Each epoch's batches as [index, worker seed] rows. `stop` = (epoch, batches): the job is
    restarted after that many batches of that epoch (None: after set_epoch, before iter)."""
    loader, epochs = build(kind, workers), []
    for epoch in range(EPOCHS):
        set_epoch(loader, epoch)
        if stop == (epoch, None):
            loader = restart(kind, workers, loader, epoch)
        it = iter(loader)
        head = []
        if stop is not None and stop[0] == epoch and stop[1] is not None:
            head = [next(it).array.tolist() for _ in range(stop[1])]
            del it
            loader = restart(kind, workers, loader, epoch)
            it = iter(loader)
        epochs.append(head + [b.array.tolist() for b in it])
    return epochs


@functools.lru_cache(maxsize=None)
def reference(kind: str, workers: int) -> list[list[list[int]]]:
    return run(kind, workers)


def torch_run(kind: str, workers: int) -> list[list[list[int]]]:
    generator = torch.Generator().manual_seed(SEED)
    sampler = (tud.DistributedSampler(TorchProbe(), WORLD, RANK, seed=SAMPLER_SEED)
               if kind == "distributed" else None)
    loader = tud.DataLoader(TorchProbe(), batch_size=BATCH, shuffle=sampler is None,
                            sampler=sampler, num_workers=workers, generator=generator)
    epochs = []
    for epoch in range(EPOCHS):
        if sampler is not None:
            sampler.set_epoch(epoch)
        epochs.append([b.tolist() for b in loader])
    return epochs


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["shuffle", "distributed"])
def test_the_uninterrupted_reference_is_torchs_stream(kind, workers):
    assert reference(kind, workers) == torch_run(kind, workers)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["pipe", "shuffle", "own-generator", "distributed"])
def test_the_reference_draws_new_seeds_every_epoch(kind, workers):
    """What makes the resume tests able to fail: a repeated epoch would differ from them."""
    epochs = reference(kind, workers)
    if kind != "distributed":  # the DistributedSampler's order comes from set_epoch
        assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    if workers:
        seeds = [{row[1] for batch in epoch for row in batch} for epoch in epochs]
        assert all(len(s) == 2 for s in seeds)  # base seed + worker id, for 2 workers
        assert seeds[0] != seeds[1] != seeds[2] != seeds[0]


@pytest.mark.parametrize("stop", [(0, 2), (1, 2)], ids=["mid-epoch-1", "mid-epoch-2"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["pipe", "shuffle", "own-generator", "distributed"])
def test_a_job_restarted_mid_epoch_goes_on_as_the_uninterrupted_one(kind, workers, stop):
    assert run(kind, workers, stop) == reference(kind, workers)


@pytest.mark.parametrize("where", ["end-of-epoch-1", "before-epoch-1", "before-epoch-2"])
@pytest.mark.parametrize("kind", ["pipe", "shuffle", "own-generator", "distributed"])
def test_a_job_restarted_between_epochs_goes_on_as_the_uninterrupted_one(kind, where):
    """A state taken after an epoch's last batch, before the first iteration, or (for the
    DistributedSampler) after set_epoch moved on: the next epoch draws its own seed."""
    whole = reference(kind, 2)
    stop = {"end-of-epoch-1": (0, len(whole[0])), "before-epoch-1": (0, None),
            "before-epoch-2": (1, None)}[where]
    assert run(kind, 2, stop) == whole


@pytest.mark.parametrize("kind", ["shuffle", "distributed"])
def test_len_after_loading_an_ended_iterations_state_is_a_whole_epoch(kind):
    loader = build(kind, 0)
    whole = list(loader)  # the loop saw StopIteration
    again = build(kind, 0)
    again.load_state_dict(loader.state_dict())
    assert len(again) == len(whole) == len(list(again))


def test_the_state_carries_the_generator_after_the_iterations_draw():
    loader = build("distributed", 0)
    fresh = loader.state_dict()  # nothing drawn yet: the next iteration draws its own seed
    assert fresh["base_seed"] is None
    assert np.array_equal(fresh["generator"], data.Generator(SEED).get_state())
    it = iter(loader)
    next(it)
    after = data.Generator(SEED)
    seed = after.random_int64()
    state = loader.state_dict()
    assert state["base_seed"] == seed
    assert np.array_equal(state["generator"], after.get_state())
    loader.sampler.set_epoch(1)  # moved on: the next iteration is another epoch's
    assert loader.state_dict()["base_seed"] is None


def test_a_malformed_generator_state_is_refused_before_anything_changes():
    loader = build("distributed", 0)
    iter(loader)
    state = loader.state_dict()
    other = build("distributed", 0)
    with pytest.raises(ValueError, match=r"a Generator state has 625 uint32 words, got shape "
                                         r"\(3,\)"):
        other.load_state_dict(dict(state, generator=np.zeros(3, np.uint32)))
    assert other.state_dict()["base_seed"] is None  # still a fresh loader


def test_merging_refuses_states_whose_generators_differ(monkeypatch):
    states = []
    for rank in range(2):
        monkeypatch.setattr(sharding, "_info", (rank, 2))
        loader = build("pipe", 0)
        if rank:
            loader.generator.words(1)  # one word further on
        iter(loader)
        states.append(loader.state_dict())
    states[1]["base_seed"] = states[0]["base_seed"]  # only the generators differ
    with pytest.raises(ValueError, match="disagree on the loader generator's state: rank 0 "
                                         "and rank 1"):
        data.merge_loader_states(states)


def test_gather_loader_state_has_its_short_public_name():
    from shoal.collectives import data as collectives_data

    assert "gather_loader_state" in dir(collectives)
    assert collectives.gather_loader_state is collectives_data.gather_loader_state
