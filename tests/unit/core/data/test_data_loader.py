"""The DataLoader: batches equal across worker counts and equal to torch's, worker seeding as
torch seeds its workers, iterable datasets split by get_worker_info, resumable state."""

from __future__ import annotations

import functools
import math
import mmap
import os
import random

import numpy as np
import pytest

from shoal import core
from shoal.collectives.data import DistributedSampler
from shoal.core import data
from shoal.core.data import handover

torch = pytest.importorskip("torch")
tud = torch.utils.data


class Squares(data.Dataset):
    """Sample i: (i, an array of i**2 of 3 floats)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return i, np.full(3, i * i, np.float32)


class SeedProbe(data.Dataset):
    """What a worker's seeding produced: its info seed and one draw from each generator."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i):
        info = data.get_worker_info()
        return np.array([info.id, info.seed, np.random.randint(1 << 30),
                         random.randrange(1 << 30)], dtype=np.int64)


class TorchSeedProbe(tud.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i):
        info = tud.get_worker_info()
        return np.array([info.id, info.seed, np.random.randint(1 << 30),
                         random.randrange(1 << 30)], dtype=np.int64)


def flat(loader):
    return [b[0].array.tolist() for b in loader]


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_batches_are_the_same_at_every_worker_count(workers):
    loader = data.DataLoader(Squares(23), batch_size=4, shuffle=True, num_workers=workers,
                             generator=data.Generator(1))
    expected = tud.DataLoader(tud.TensorDataset(torch.arange(23)), batch_size=4, shuffle=True,
                              generator=torch.Generator().manual_seed(1))
    batches = list(loader)
    assert [b[0].array.tolist() for b in batches] == [b[0].tolist() for b in expected]
    for idx, sq in batches:
        assert isinstance(sq, core.Tensor) and sq.array.dtype == np.float32
        np.testing.assert_array_equal(sq.array[:, 0], idx.array.astype(np.float32) ** 2)


def test_workers_are_seeded_as_torch_seeds_them():
    ours = data.DataLoader(SeedProbe(), batch_size=1, num_workers=2, generator=data.Generator(7))
    theirs = tud.DataLoader(TorchSeedProbe(), batch_size=1, num_workers=2,
                            generator=torch.Generator().manual_seed(7))
    got = [b.array.tolist() for b in ours]
    want = [b.numpy().tolist() for b in theirs]
    assert got == want
    assert {row[0][0] for row in got} == {0, 1}  # both workers served


class Stream(data.IterableDataset):
    """0..n-1, each worker taking its contiguous share as torch's docs show."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = data.get_worker_info()
        if info is None:
            return iter(range(self.n))
        per = math.ceil(self.n / info.num_workers)
        return iter(range(info.id * per, min(self.n, (info.id + 1) * per)))

    def __len__(self) -> int:
        return self.n


class TorchStream(tud.IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = tud.get_worker_info()
        if info is None:
            return iter(range(self.n))
        per = math.ceil(self.n / info.num_workers)
        return iter(range(info.id * per, min(self.n, (info.id + 1) * per)))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_datasets_interleave_workers_as_torch_does(workers, drop_last):
    ours = data.DataLoader(Stream(20), batch_size=3, num_workers=workers, drop_last=drop_last)
    theirs = tud.DataLoader(TorchStream(20), batch_size=3, num_workers=workers,
                            drop_last=drop_last)
    assert [b.array.tolist() for b in ours] == [b.tolist() for b in theirs]


@pytest.mark.parametrize("workers", [0, 2])
def test_state_dict_resumes_mid_epoch_without_repeating_or_skipping(workers):
    def loader():
        return data.DataLoader(Squares(30), batch_size=4, shuffle=True, num_workers=workers,
                               generator=data.Generator(5))

    whole = flat(loader())
    first = loader()
    it = iter(first)
    head = [next(it)[0].array.tolist() for _ in range(3)]
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + flat(resumed) == whole


def test_a_resumed_distributed_loader_at_another_world_size_reads_the_rest_once():
    n, batch = 48, 2
    seen = []
    loaders = [data.DataLoader(range(n), batch_size=batch,
                               sampler=DistributedSampler(range(n), 4, r, seed=3))
               for r in range(4)]
    iters = [iter(ld) for ld in loaders]
    for _ in range(3):  # three lockstep steps at world size 4
        for it in iters:
            seen += next(it).array.tolist()
    state = loaders[0].state_dict()
    for r in range(3):  # the rest of the epoch at world size 3
        ld = data.DataLoader(range(n), batch_size=batch,
                             sampler=DistributedSampler(range(n), 3, r, seed=3))
        ld.load_state_dict(state)
        seen += [i for b in ld for i in b.array.tolist()]
    assert sorted(seen) == list(range(n))


class Tagged:
    """Sample i: [i, the tag worker_init_fn gave this worker's copy of the dataset]."""

    tag = -1

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i):
        return np.array([i, self.tag], np.int64)


class OurTagged(Tagged, data.Dataset):
    pass


class TorchTagged(Tagged, tud.Dataset):
    pass


def tag_worker(log: str, get_info, worker_id: int) -> None:
    info = get_info()
    info.dataset.tag = 100 + worker_id
    with open(log, "a") as f:
        f.write(f"{worker_id} {info.id} {os.getpid()}\n")


def test_worker_init_fn_runs_once_per_worker_and_its_effects_reach_the_batches(tmp_path):
    ours_log, theirs_log = str(tmp_path / "ours"), str(tmp_path / "theirs")
    loader = data.DataLoader(OurTagged(), batch_size=2, num_workers=2, persistent_workers=True,
                             worker_init_fn=functools.partial(tag_worker, ours_log,
                                                              data.get_worker_info))
    epochs = [[b.array.tolist() for b in loader] for _ in range(2)]
    pids = loader._pool.pids()
    loader._pool.shutdown()
    theirs = tud.DataLoader(TorchTagged(), batch_size=2, num_workers=2, persistent_workers=True,
                            worker_init_fn=functools.partial(tag_worker, theirs_log,
                                                             tud.get_worker_info))
    expected = [[b.tolist() for b in theirs] for _ in range(2)]
    assert epochs == expected
    # batch k comes from worker k % 2, whose copy of the dataset its init function tagged
    assert [[row[1] for row in b] for b in epochs[0]] == [[100, 100], [101, 101]] * 2
    with open(ours_log) as f:
        calls = [line.split() for line in f]
    assert sorted((int(w), int(i)) for w, i, _ in calls) == [(0, 0), (1, 1)]  # id = info.id
    assert sorted(int(pid) for _, _, pid in calls) == sorted(pids)  # once each, two epochs


def test_persistent_workers_keep_their_pids_across_epochs():
    loader = data.DataLoader(Squares(8), batch_size=2, num_workers=2, persistent_workers=True)
    assert flat(loader) == flat(loader)
    pool = loader._pool
    assert pool is not None and not pool.closed
    before = pool.pids()
    list(loader)
    assert loader._pool.pids() == before
    pool.shutdown()


def test_an_abandoned_epoch_with_persistent_workers_does_not_leak_into_the_next():
    loader = data.DataLoader(Squares(40), batch_size=2, num_workers=2, persistent_workers=True)
    next(iter(loader))
    assert flat(loader) == [[2 * k, 2 * k + 1] for k in range(20)]
    loader._pool.shutdown()


def backing(array: np.ndarray):
    """The object that owns an array's memory (following views and buffers)."""
    owner = array
    while True:
        nxt = owner.obj if isinstance(owner, memoryview) else getattr(owner, "base", None)
        if nxt is None:
            return owner
        owner = nxt


def test_large_batches_cross_through_shared_memory_and_leave_nothing_behind():
    class Big(data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return np.full(1 << 17, i, np.float32)  # 512 KiB per sample, 2 MiB per batch

    before = set(os.listdir("/dev/shm"))
    loader = data.DataLoader(Big(), batch_size=4, num_workers=2)
    batches = list(loader)
    assert [b.array[:, 0].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                        [8, 9, 10, 11]]
    assert all(b.array.flags.writeable for b in batches)
    # the arrays are views of the slot's mapping, not copies that came through the pipe
    assert all(isinstance(backing(b.array), mmap.mmap) for b in batches)
    assert handover.INLINE_BYTES < batches[0].array.nbytes
    assert not {f for f in set(os.listdir("/dev/shm")) - before if f.startswith("shoal-data")}


def test_small_batches_come_inline_through_the_pipe():
    batches = list(data.DataLoader(range(8), batch_size=2, num_workers=1))
    assert [b.array.tolist() for b in batches] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert not any(isinstance(backing(b.array), mmap.mmap) for b in batches)


def test_batch_size_none_and_custom_collate_and_batch_sampler():
    assert [t.array.tolist() for t in data.DataLoader(np.arange(3), batch_size=None)] == [0, 1, 2]
    loader = data.DataLoader(range(6), batch_size=4, collate_fn=lambda b: sum(b), num_workers=1)
    assert list(loader) == [6, 9]
    bs = data.BatchSampler(data.SequentialSampler(range(5)), 2, drop_last=True)
    assert [b.array.tolist() for b in data.DataLoader(range(5), batch_sampler=bs)] == [[0, 1],
                                                                                     [2, 3]]
    assert len(data.DataLoader(range(5), batch_size=2)) == 3


@pytest.mark.parametrize("kwargs, message", [
    ({"num_workers": -1}, "num_workers option should be non-negative"),
    ({"timeout": -1}, "timeout option should be non-negative"),
    ({"prefetch_factor": 2}, "prefetch_factor option could only be specified in multiprocessing"),
    ({"persistent_workers": True}, "persistent_workers option needs num_workers > 0"),
    ({"shuffle": True, "sampler": data.SequentialSampler(range(3))},
     "sampler option is mutually exclusive with shuffle"),
    ({"batch_size": 2, "batch_sampler": [[0]]}, "batch_sampler option is mutually exclusive"),
    ({"batch_size": None, "drop_last": True}, "batch_size=None option disables auto-batching"),
])
def test_bad_arguments_get_torchs_messages(kwargs, message):
    with pytest.raises(ValueError, match=message):
        data.DataLoader(range(3), **kwargs)
    with pytest.raises(ValueError, match=message):
        tud.DataLoader(range(3), **kwargs)


def test_iterable_datasets_refuse_a_shuffle():
    with pytest.raises(ValueError, match="expected unspecified shuffle option, but got shuffle=True"):
        data.DataLoader(Stream(3), shuffle=True)


def test_pin_memory_without_a_gpu_warns_and_keeps_the_batch(recwarn):
    from shoal.core.data import pin

    if pin.available():
        pytest.skip("this machine has a CUDA device (tests/gpu covers pinning)")
    batches = list(data.DataLoader(range(4), batch_size=2, pin_memory=True))
    assert [b.array.tolist() for b in batches] == [[0, 1], [2, 3]]


def test_a_batch_kept_by_the_loop_is_never_overwritten_and_freed_slots_are_reused():
    class Big(data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return np.full(1 << 16, i, np.float32)  # 256 KiB: through shared memory

    loader = data.DataLoader(Big(), batch_size=2, num_workers=1)
    it = iter(loader)
    kept = next(it)
    for k in range(1, 20):  # not enumerate(it): its cached tuple would keep the last batch
        batch = next(it)
        assert batch.array[:, -1].tolist() == [2 * k, 2 * k + 1]
        del batch  # freed: its slot goes back to the worker
    assert kept.array[:, 0].tolist() == [0, 1] and kept.array[:, -1].tolist() == [0, 1]
    # the kept batch pins one slot; the others cycle through prefetch_factor more, plus the one
    # being handed out while the next task is sent
    assert it.pool.slots_opened() <= 1 + loader.prefetch_factor + 1


def test_spawned_workers_give_the_same_batches_as_forked_ones():
    # spawn/forkserver suit processes whose threads make fork unsafe (a gRPC agent): the
    # dataset travels pickled and the worker imports shoal afresh
    forked = flat(data.DataLoader(Squares(10), batch_size=3, num_workers=1))
    spawned = flat(data.DataLoader(Squares(10), batch_size=3, num_workers=1,
                                   multiprocessing_context="spawn"))
    assert spawned == forked == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
