"""core.data and collectives.DistributedSampler against torch.utils.data as the oracle:
random streams, samplers, random_split, default_collate and the loader's shuffle order."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from shoal import core
from shoal.collectives.data import DistributedSampler
from shoal.core import data

torch = pytest.importorskip("torch")
tud = torch.utils.data


def tgen(seed: int):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


@pytest.mark.parametrize("seed", [0, 1, 2024, 2**40 + 7])
@pytest.mark.parametrize("n", [0, 1, 2, 5, 97, 1000])
def test_randperm_is_torchs_for_the_same_seed(seed, n):
    g, ours = tgen(seed), data.Generator(seed)
    for _ in range(2):  # the second draw continues the same stream
        assert ours.randperm(n).tolist() == torch.randperm(n, generator=g).tolist()
    assert ours.random_int64() == torch.empty((), dtype=torch.int64).random_(generator=g).item()


def test_generator_state_round_trips():
    g = data.Generator(5)
    g.randperm(10)
    state = g.get_state()
    first = g.randperm(50).tolist()
    g.set_state(state)
    assert g.randperm(50).tolist() == first
    with pytest.raises(ValueError, match="625 uint32 words"):
        g.set_state(np.zeros(3, np.uint32))


@pytest.mark.parametrize("kwargs", [
    {}, {"replacement": True}, {"num_samples": 7}, {"num_samples": 45},
    {"replacement": True, "num_samples": 70},
])
def test_random_sampler_order_is_torchs(kwargs):
    ours = data.RandomSampler(range(20), generator=data.Generator(9), **kwargs)
    theirs = tud.RandomSampler(range(20), generator=tgen(9), **kwargs)
    assert list(ours) == list(theirs)
    assert list(ours) == list(theirs)  # second epoch: the generators moved on alike
    assert len(ours) == len(theirs)


def test_random_sampler_rejects_what_torch_rejects():
    with pytest.raises(ValueError, match="num_samples should be a positive integer value"):
        data.RandomSampler(range(3), num_samples=0)


def test_subset_random_sampler_and_batch_sampler_are_torchs():
    idx = [3, 9, 4, 12, 8]
    assert (list(data.SubsetRandomSampler(idx, generator=data.Generator(4)))
            == list(tud.SubsetRandomSampler(idx, generator=tgen(4))))
    for drop_last in (False, True):
        ours = data.BatchSampler(data.SequentialSampler(range(10)), 3, drop_last)
        theirs = tud.BatchSampler(tud.SequentialSampler(range(10)), 3, drop_last)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)
    with pytest.raises(ValueError, match="batch_size should be a positive integer value"):
        data.BatchSampler(range(3), 0, False)


@pytest.mark.parametrize("lengths", [[3, 7], [0.3, 0.7], [0.5, 0.25, 0.25], [1, 1, 8]])
def test_random_split_is_torchs(lengths):
    ours = data.random_split(range(10), lengths, generator=data.Generator(42))
    theirs = tud.random_split(range(10), lengths, generator=tgen(42))
    assert [list(s.indices) for s in ours] == [list(s.indices) for s in theirs]


def test_random_split_names_a_bad_sum():
    with pytest.raises(ValueError, match=r"the lengths \[3, 3\] sum to 6, not the dataset's 10"):
        data.random_split(range(10), [3, 3])


@pytest.mark.parametrize("size", [1, 5, 10, 33, 101])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_distributed_sampler_indices_are_torchs(size, world, drop_last, shuffle):
    for epoch in (0, 1, 5):
        for rank in range(world):
            ours = DistributedSampler(range(size), world, rank, shuffle=shuffle, seed=11,
                                      drop_last=drop_last)
            theirs = tud.DistributedSampler(range(size), world, rank, shuffle=shuffle, seed=11,
                                            drop_last=drop_last)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)
            assert (ours.num_samples, ours.total_size) == (theirs.num_samples, theirs.total_size)


def test_distributed_sampler_rejects_a_rank_outside_the_world():
    with pytest.raises(ValueError, match=r"Invalid rank 3, rank should be in the interval \[0, 2\]"):
        DistributedSampler(range(5), num_replicas=3, rank=3)


def as_numpy(value):
    """A collated batch (ours or torch's) as nested numpy/python values to compare."""
    if isinstance(value, core.Tensor):
        return ("tensor", value.array.dtype.name, value.array.tolist())
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.numpy().dtype), value.numpy().tolist())
    if isinstance(value, dict):
        return {k: as_numpy(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return (type(value).__name__, [as_numpy(v) for v in value])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [as_numpy(v) for v in value])
    return value


Point = collections.namedtuple("Point", "x y")
rng = np.random.default_rng(0)
BATCHES = {
    "float32 arrays": [rng.standard_normal((2, 3)).astype(np.float32) for _ in range(4)],
    "int64 arrays": [np.arange(3) + i for i in range(3)],
    "uint8 arrays": [np.full(5, i, np.uint8) for i in range(3)],
    "numpy scalars": [np.float32(1.5), np.float32(2.5)],
    "ints": [1, 2, 3],
    "floats": [1.0, 2.5],
    "bools": [True, False],
    "strings": ["a", "bc"],
    "dicts": [{"x": np.ones(2), "label": 1, "name": "a"}, {"x": np.zeros(2), "label": 0,
                                                           "name": "b"}],
    "tuples": [(np.ones(2, np.float32), 3), (np.zeros(2, np.float32), 4)],
    "lists": [[1, 2.0], [3, 4.0]],
    "named tuples": [Point(np.ones(1), 1), Point(np.zeros(1), 2)],
    "nested": [{"a": (1, [np.ones(2)]), "b": {"c": 2.0}}, {"a": (3, [np.zeros(2)]),
                                                           "b": {"c": 4.0}}],
}


def to_torch(sample):
    """The same sample with arrays as torch tensors (for the Tensor case)."""
    if isinstance(sample, np.ndarray):
        return torch.from_numpy(sample)
    return sample


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_default_collate_is_torchs(name):
    batch = BATCHES[name]
    assert as_numpy(data.default_collate(batch)) == as_numpy(tud.default_collate(batch))


def test_default_collate_stacks_tensors_as_torch_stacks_its_tensors():
    batch = BATCHES["float32 arrays"]
    ours = data.default_collate([core.Tensor(a) for a in batch])
    theirs = tud.default_collate([torch.from_numpy(a) for a in batch])
    assert as_numpy(ours) == as_numpy(theirs)


@pytest.mark.parametrize("name", ["float32 arrays", "dicts", "tuples", "named tuples", "ints"])
def test_default_convert_is_torchs(name):
    for sample in BATCHES[name]:
        assert as_numpy(data.default_convert(sample)) == as_numpy(tud.default_convert(sample))


def test_a_shape_mismatch_names_the_sample_the_shapes_and_the_field():
    batch = [{"x": np.zeros((2, 4))}, {"x": np.zeros((2, 4))}, {"x": np.zeros((2, 5))}]
    with pytest.raises(data.CollateError,
                       match=r"sample 2 has shape \(2, 5\) where sample 0 has \(2, 4\) at "
                             r"batch\['x'\]"):
        data.default_collate(batch)


def test_unequal_lengths_and_keys_and_types_are_named():
    with pytest.raises(data.CollateError, match="sample 1 has 3 elements where sample 0 has 2"):
        data.default_collate([[1, 2], [1, 2, 3]])
    with pytest.raises(data.CollateError, match=r"sample 1 has keys \['b'\] where sample 0 has"):
        data.default_collate([{"a": 1}, {"b": 1}])
    with pytest.raises(data.CollateError, match="batch must contain tensors, numpy arrays"):
        data.default_collate([object(), object()])


def test_the_loader_shuffles_as_torchs_for_the_same_generator_seed():
    ds = data.TensorDataset(np.arange(50))
    tds = tud.TensorDataset(torch.arange(50))
    ours = data.DataLoader(ds, batch_size=8, shuffle=True, generator=data.Generator(3))
    theirs = tud.DataLoader(tds, batch_size=8, shuffle=True, generator=tgen(3))
    for _ in range(2):  # two epochs: the base seed and the order are drawn from one stream
        assert [b[0].array.tolist() for b in ours] == [b[0].tolist() for b in theirs]


def test_dataset_helpers_behave_as_torchs():
    x, y = np.arange(12).reshape(6, 2), np.arange(6)
    ours, theirs = data.TensorDataset(x, y), tud.TensorDataset(torch.from_numpy(x),
                                                                torch.from_numpy(y))
    assert len(ours) == len(theirs)
    assert [v.tolist() for v in ours[4]] == [v.tolist() for v in theirs[4]]
    assert data.Subset(range(10), [7, 2])[1] == tud.Subset(range(10), [7, 2])[1]
    both = data.ConcatDataset([range(3), range(10, 12)])
    assert [both[i] for i in range(len(both))] == list(tud.ConcatDataset([range(3), range(10, 12)]))
    with pytest.raises(ValueError, match=r"one first dimension, got sizes \[6, 5\]"):
        data.TensorDataset(x, y[:5])
