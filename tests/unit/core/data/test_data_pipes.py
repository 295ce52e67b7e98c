"""DataPipes: the functional forms against torch's own (legacy) datapipes, the file readers,
sharding over (rank, worker) covering every item exactly once, and resumable pipe state."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.core import data
from shoal.core.data import datapipes as dp
from shoal.core.data.datapipes import sharding

torch = pytest.importorskip("torch")
tdp = torch.utils.data.datapipes


def tolist(pipe):
    return [x.tolist() if hasattr(x, "tolist") else x
            for x in pipe]


def triple(x):
    return x * 3


def negate(x):
    return -x


def multiple_of_3(x):
    return x % 3 == 0


def below_3(x):
    return x < 3


CASES = {
    "map": lambda w: w().map(triple),
    "filter": lambda w: w().filter(multiple_of_3),
    "batch": lambda w: w().batch(6),
    "batch drop_last": lambda w: w().batch(6, drop_last=True),
    "unbatch": lambda w: w().batch(4).batch(2).unbatch(),
    "unbatch 2": lambda w: w().batch(4).batch(2).unbatch(unbatch_level=2),
    "unbatch all": lambda w: w().batch(4).batch(2).unbatch(unbatch_level=-1),
    "zip": lambda w: w().zip(w().map(negate)),
    "concat": lambda w: w().concat(w().filter(below_3)),
    "collate": lambda w: w().batch(5).collate(),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_functional_forms_match_torchs_datapipes(name):
    build = CASES[name]
    ours = build(lambda: dp.IterableWrapper(range(20)))
    theirs = build(lambda: tdp.iter.IterableWrapper(range(20)))
    assert tolist(ours) == tolist(theirs)


def test_cycle_and_header_which_only_torchdata_has():
    source = dp.IterableWrapper(range(5))
    assert list(source.cycle(2)) == [0, 1, 2, 3, 4] * 2
    assert list(source.cycle().header(12)) == [0, 1, 2, 3, 4] * 2 + [0, 1]
    assert list(source.header(0)) == [] and list(source.cycle(0)) == []


def test_sharding_filter_matches_torchs():
    for k in range(3):
        ours = dp.apply_sharding(dp.IterableWrapper(range(10)).sharding_filter(), 3, k)
        theirs = tdp.iter.IterableWrapper(range(10)).sharding_filter()
        theirs.apply_sharding(3, k)
        assert list(ours) == list(theirs)
        assert len(ours) == len(list(ours))


def test_the_buffered_shuffle_is_a_seeded_permutation_that_changes_per_epoch():
    pipe = dp.IterableWrapper(range(50)).shuffle(buffer_size=8).set_seed(4)
    first, second = list(pipe), list(pipe)
    assert sorted(first) == sorted(second) == list(range(50))
    assert first != list(range(50)) and first != second
    assert list(dp.IterableWrapper(range(50)).shuffle(buffer_size=8).set_seed(4)) == first


@pytest.mark.parametrize("buffer_size", [1, 3, 8, 50, 1000])
@pytest.mark.parametrize("seed", [0, 4, 2**40 + 7])
def test_the_shuffle_is_torchs_stream_for_the_same_seed(buffer_size, seed):
    ours = dp.IterableWrapper(range(50)).shuffle(buffer_size=buffer_size).set_seed(seed)
    theirs = tdp.iter.IterableWrapper(range(50)).shuffle(buffer_size=buffer_size).set_seed(seed)
    assert list(ours) == list(theirs)


def test_shuffle_off_and_unbatch_level_as_torchs():
    ours = dp.IterableWrapper(range(12)).batch(3).shuffle(buffer_size=4, unbatch_level=1)
    theirs = tdp.iter.IterableWrapper(range(12)).batch(3).shuffle(buffer_size=4, unbatch_level=1)
    assert list(ours.set_seed(9)) == list(theirs.set_seed(9))
    assert list(ours.set_shuffle(False)) == list(theirs.set_shuffle(False)) == list(range(12))


def test_map_datapipes():
    m = dp.SequenceWrapper(list(range(7)))
    assert [m.map(lambda x: x + 1)[i] for i in range(7)] == list(range(1, 8))
    assert [m.batch(3)[i] for i in range(len(m.batch(3)))] == [[0, 1, 2], [3, 4, 5], [6]]
    both = m.concat(dp.SequenceWrapper([9]))
    assert [both[i] for i in range(len(both))] == list(range(7)) + [9]
    assert m.zip(m.map(str))[2] == (2, "2")
    order = list(m.shuffle(generator=data.Generator(3)))
    assert order == torch.randperm(7, generator=torch.Generator().manual_seed(3)).tolist()


def test_file_lister_opener_and_line_reader(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    (tmp_path / "b.csv").write_text("x\n")
    (tmp_path / "sub" / "c.txt").write_text("three\r\n")
    flat = dp.FileLister(str(tmp_path), "*.txt")
    assert list(flat) == [str(tmp_path / "a.txt")]
    deep = dp.FileLister(str(tmp_path), "*.txt", recursive=True)
    lines = list(deep.open_files().readlines())
    assert lines == [(str(tmp_path / "a.txt"), "one"), (str(tmp_path / "a.txt"), "two"),
                     (str(tmp_path / "sub" / "c.txt"), "three")]
    theirs = tdp.iter.FileLister(str(tmp_path), "*.txt", recursive=True)
    assert list(deep) == sorted(theirs)
    with pytest.raises(FileNotFoundError, match="neither a file nor a directory"):
        list(dp.FileLister(str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="opens files for reading"):
        dp.FileOpener(deep, mode="w")


def pipeline(n: int = 60):
    return (dp.IterableWrapper(range(n)).shuffle(buffer_size=16).sharding_filter()
            .map(lambda x: x * 10))


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_shards_over_ranks_and_workers_each_item_once(workers):
    seen = []
    try:
        for rank in range(3):  # three ranks' loaders, one after the other in this process
            sharding.set_distributed_info(rank, 3)
            loader = data.DataLoader(pipeline(), batch_size=4, num_workers=workers,
                                     generator=data.Generator(8))
            seen += [x for b in loader for x in b.array.tolist()]
    finally:
        sharding._info = None
    assert sorted(seen) == [10 * i for i in range(60)]


def test_distributed_info_reads_the_launcher_environment(monkeypatch):
    monkeypatch.setattr(sharding, "_info", None)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "5")
    assert dp.distributed_info() == (2, 5)
    with pytest.raises(ValueError, match="rank 5 is outside a world of 5"):
        dp.set_distributed_info(5, 5)


def test_pipe_state_resumes_mid_iteration():
    pipe = pipeline(30)
    pipe_seeded = pipe.source.source  # the shuffle
    pipe_seeded.set_seed(6)
    it = iter(pipe)
    head = [next(it) for _ in range(11)]
    state = pipe.state_dict()
    rest = list(it)
    again = pipeline(30)
    again.load_state_dict(state)
    assert list(again) == rest
    assert sorted(head + rest) == [10 * i for i in range(30)]


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_over_a_pipe_resumes_by_batches(workers):
    def loader():
        return data.DataLoader(pipeline(40), batch_size=3, num_workers=workers,
                               generator=data.Generator(2))

    whole = [b.array.tolist() for b in loader()]
    first = loader()
    it = iter(first)
    head = [next(it).array.tolist() for _ in range(4)]
    state = first.state_dict()
    again = loader()
    again.load_state_dict(state)
    assert head + [b.array.tolist() for b in again] == whole


def test_unbatch_deeper_than_the_batches_names_the_problem():
    with pytest.raises(IndexError, match="unbatch_level 2 exceeds the depth"):
        list(dp.IterableWrapper([[1, 2]]).unbatch(unbatch_level=2))
    assert np.array_equal(list(dp.IterableWrapper([[1, 2]]).unbatch()), [1, 2])


@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
def test_a_pipe_resumed_in_a_later_epoch_replays_that_epochs_order(workers, persistent):
    def loader():
        return data.DataLoader(pipeline(24), batch_size=4, num_workers=workers,
                               persistent_workers=persistent, generator=data.Generator(5))

    reference = loader()
    epochs = [[b.array.tolist() for b in reference] for _ in range(3)]
    assert epochs[0] != epochs[1] != epochs[2]  # each epoch its own shuffle
    first = loader()
    list(first)
    list(first)
    it = iter(first)  # the third epoch, interrupted after two batches
    head = [next(it).array.tolist() for _ in range(2)]
    state = first.state_dict()
    again = loader()
    again.load_state_dict(state)
    assert head + [b.array.tolist() for b in again] == epochs[2]
