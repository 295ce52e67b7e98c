"""ChainDataset, StackDataset, WeightedRandomSampler, DataLoader(shuffle=) over a DataPipe, the
fork/demux/mux pipes and FileLister, each against torch.utils.data as the oracle."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

from shoal.core import data
from shoal.core.data import datapipes as sdp

torch = pytest.importorskip("torch")
tud = torch.utils.data
tdp = torch.utils.data.datapipes.iter


def _outcome(fn):
    """fn()'s value as a list, or its error's type and text."""
    try:
        return list(fn())
    except Exception as exc:  # noqa: BLE001 - compared with torch's
        return type(exc).__name__, str(exc)


def _plain(batch):
    return batch.tolist() if hasattr(batch, "tolist") else batch


# -- datasets -------------------------------------------------------------------------------
def _stream(base, items):
    class Stream(base):
        def __iter__(self):
            yield from items

        def __len__(self):
            return len(items)

    return Stream()


def test_chain_dataset_is_torchs():
    ours = data.ChainDataset([_stream(data.IterableDataset, [1, 2]),
                              _stream(data.IterableDataset, [3])])
    theirs = tud.ChainDataset([_stream(tud.IterableDataset, [1, 2]),
                               _stream(tud.IterableDataset, [3])])
    assert list(ours) == list(theirs) == [1, 2, 3]
    assert len(ours) == len(theirs) == 3
    # A map-style member fails when reached, with torch's type and text.
    assert (_outcome(lambda: data.ChainDataset([range(2)]))
            == _outcome(lambda: tud.ChainDataset([range(2)])))
    assert (_outcome(lambda: iter(data.ChainDataset([data.TensorDataset(np.arange(2))])))
            == _outcome(lambda: iter(tud.ChainDataset([tud.TensorDataset(torch.arange(2))]))))
    with pytest.raises(AssertionError, match="ChainDataset only supports IterableDataset"):
        len(data.ChainDataset([range(2)]))


class _Batched:
    """A dataset that reads a batch at once (__getitems__) and counts how it was read."""

    def __init__(self):
        self.calls = []

    def __len__(self):
        return 5

    def __getitem__(self, i):
        self.calls.append("one")
        return i * 10

    def __getitems__(self, indices):
        self.calls.append("many")
        return [i * 10 for i in indices]


def test_stack_dataset_is_torchs():
    a, b = list(range(4)), list("wxyz")
    assert data.StackDataset(a, b)[2] == tud.StackDataset(a, b)[2] == (2, "y")
    assert data.StackDataset(x=a, y=b)[1] == tud.StackDataset(x=a, y=b)[1]
    assert len(data.StackDataset(a, b)) == 4
    five = list(range(5))
    ours, theirs = data.StackDataset(five, _Batched()), tud.StackDataset(five, _Batched())
    assert ours.__getitems__([3, 0]) == theirs.__getitems__([3, 0])
    for args, kwargs in [((a, b), {"c": a}), ((), {}), ((a, b[:2]), {}), ((), {"x": a, "y": []})]:
        assert (_outcome(lambda: [data.StackDataset(*args, **kwargs)])[0]
                == _outcome(lambda: [tud.StackDataset(*args, **kwargs)])[0] == "ValueError")


@pytest.mark.parametrize("workers", [0, 1])
def test_the_loader_reads_a_batch_through_getitems_as_torchs(workers):
    ours = data.DataLoader(_Batched(), batch_size=2, num_workers=workers)
    theirs = tud.DataLoader(_Batched(), batch_size=2, num_workers=workers)
    assert [_plain(b) for b in ours] == [_plain(b) for b in theirs] == [[0, 10], [20, 30], [40]]
    single = _Batched()
    list(data.DataLoader(single, batch_size=2))
    assert single.calls == ["many"] * 3  # one call per batch, never per sample


# -- WeightedRandomSampler --------------------------------------------------------------------
WEIGHTS = [0.1, 0.9, 0.4, 0.7, 3.0, 0.6]


@pytest.mark.parametrize("seed", [0, 5, 2**40 + 1])
@pytest.mark.parametrize("num_samples,replacement", [(50, True), (1, True), (6, False),
                                                     (3, False)])
def test_weighted_random_sampler_draws_torchs_indices(seed, num_samples, replacement):
    # Exact equality: the same twister words, and sums and divisions done in torch's order;
    # the order without replacement compares weights / Exp(1) draws, far from ties.
    weights = WEIGHTS + list(np.random.default_rng(seed).random(40))
    ours = data.WeightedRandomSampler(weights, num_samples, replacement,
                                      generator=data.Generator(seed))
    theirs = tud.WeightedRandomSampler(weights, num_samples, replacement,
                                       generator=torch.Generator().manual_seed(seed))
    assert list(ours) == list(theirs)
    assert list(ours) == list(theirs)  # a second pass continues both streams alike
    assert len(ours) == len(theirs) == num_samples


@pytest.mark.parametrize("weights,num_samples,replacement", [
    ([1, -1, 2], 3, True), ([1, -1, 2], 3, False), ([0, 0], 2, True), ([0, 0], 2, False),
    ([1, 2], 3, False), ([1, float("nan")], 2, True), ([1, float("inf")], 2, True),
    ([1, float("inf")], 1, True), ([0, 1, 0, 2], 2, False),
])
def test_weighted_random_sampler_fails_as_torchs(weights, num_samples, replacement):
    ours = _outcome(lambda: data.WeightedRandomSampler(weights, num_samples, replacement,
                                                       generator=data.Generator(3)))
    theirs = _outcome(lambda: tud.WeightedRandomSampler(
        weights, num_samples, replacement, generator=torch.Generator().manual_seed(3)))
    assert ours == theirs


@pytest.mark.parametrize("args,kwargs", [(([[1, 2]], 2), {}), (([1, 2], 0), {}),
                                         (([1, 2], 2.0), {}), (([1, 2], True), {}),
                                         (([1, 2], 2), {"replacement": 1})])
def test_weighted_random_sampler_checks_its_arguments_as_torch(args, kwargs):
    with pytest.raises(ValueError) as theirs:
        tud.WeightedRandomSampler(*args, **kwargs)
    with pytest.raises(ValueError, match=str(theirs.value).replace("(", r"\(").replace(")", r"\)")):
        data.WeightedRandomSampler(*args, **kwargs)


# -- DataLoader(shuffle=) over a DataPipe -------------------------------------------------------
def _loader_items(module, pipe, **kwargs):
    return [_plain(x) for x in module.DataLoader(pipe, batch_size=None, **kwargs)]


def test_shuffle_false_turns_the_pipes_shuffle_off_as_torchs():
    ours = _loader_items(data, sdp.IterableWrapper(range(10)).shuffle(), shuffle=False)
    theirs = _loader_items(tud, tdp.IterableWrapper(range(10)).shuffle(), shuffle=False)
    assert ours == theirs == list(range(10))


def test_shuffle_true_turns_a_disabled_shuffle_back_on_as_torchs():
    ours = _loader_items(data, sdp.IterableWrapper(range(30)).shuffle().set_shuffle(False),
                         shuffle=True)
    theirs = _loader_items(tud, tdp.IterableWrapper(range(30)).shuffle().set_shuffle(False),
                           shuffle=True)
    # Both a permutation that is not the identity (a 1 in 30! chance of failing by luck).
    assert sorted(ours) == sorted(theirs) == list(range(30))
    assert ours != list(range(30)) and theirs != list(range(30))


def test_shuffle_true_without_a_shuffler_warns_and_yields_in_order_as_torch_2_13():
    with pytest.warns(UserWarning, match="does not contain a `Shuffler`"):
        ours = _loader_items(data, sdp.IterableWrapper(range(10)), shuffle=True)
    with pytest.warns(UserWarning, match="does not contain a `Shuffler`"):
        theirs = _loader_items(tud, tdp.IterableWrapper(range(10)), shuffle=True)
    assert ours == theirs == list(range(10))


def test_apply_shuffle_settings_adds_a_shuffler_as_torchs():
    with pytest.warns(UserWarning, match="Adding one at the end"):
        pipe = sdp.apply_shuffle_settings(sdp.IterableWrapper(range(10)), shuffle=True)
    assert isinstance(pipe, sdp.Shuffler)
    assert sorted(pipe) == list(range(10))


# -- fork, demux, mux -------------------------------------------------------------------------
def _both(build):
    """build(module) run over shoal's pipes and torch's; each result as (kind, value)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about lambdas it cannot pickle
        return _outcome(lambda: build(sdp)), _outcome(lambda: build(tdp))


@pytest.mark.parametrize("build", [
    lambda m: zip(*m.IterableWrapper(range(5)).fork(3)),
    lambda m: [list(c) for c in m.IterableWrapper(range(5)).fork(2, copy="deep")],
    lambda m: [m.IterableWrapper(range(3)).fork(1) is not None],
    lambda m: m.IterableWrapper(range(3)).fork(0),
    lambda m: m.IterableWrapper(range(3)).fork(2, copy="other"),
    lambda m: list(m.IterableWrapper(range(5)).fork(2, buffer_size=2)[0]),
    lambda m: [len(c) for c in m.IterableWrapper(range(5)).fork(2)],
    lambda m: [list(c) for c in m.IterableWrapper(range(9)).demux(3, lambda x: x % 3)],
    lambda m: zip(*m.IterableWrapper(range(7)).demux(2, lambda x: x % 2)),
    lambda m: [list(c) for c in m.IterableWrapper(range(6)).demux(
        2, lambda x: None if x == 3 else x % 2, drop_none=True)],
    lambda m: list(m.IterableWrapper(range(6)).demux(2, lambda x: x)[0]),
    lambda m: list(m.IterableWrapper(range(6)).demux(2, lambda x: x // 5, buffer_size=2)[1]),
    lambda m: m.IterableWrapper(range(6)).demux(0, lambda x: x),
    lambda m: m.IterableWrapper(range(3)).mux(m.IterableWrapper(range(10, 15)),
                                              m.IterableWrapper(range(20, 22))),
    lambda m: [len(m.IterableWrapper(range(3)).mux(m.IterableWrapper(range(10, 15))))],
    lambda m: m.Multiplexer(m.IterableWrapper([]), m.IterableWrapper([1])),
])
def test_fork_demux_and_mux_are_torchs(build):
    ours, theirs = _both(build)
    assert ours == theirs


def test_a_new_pass_over_a_fork_child_invalidates_the_old_iterators_as_torchs():
    def run(m):
        a, b = m.IterableWrapper(range(10)).fork(2)
        it1, it2 = iter(a), iter(b)
        out = [next(it1), next(it2), next(it1)]
        with pytest.warns(UserWarning, match="Some child DataPipes are not exhausted"):
            it3 = iter(a)  # a new pass: the buffer resets, it1 and it2 are invalid
        it4 = iter(b)  # b had not started since the reset: it joins the pass
        out += [next(it3), next(it4)]
        with pytest.raises(RuntimeError, match="This iterator has been invalidated"):
            next(it1)
        return out

    assert run(sdp) == run(tdp) == [0, 0, 1, 0, 0]


def test_fork_children_iterate_again_after_a_full_pass_as_torchs():
    def run(m):
        a, b = m.IterableWrapper(range(4)).fork(2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a finished pass restarts without a warning
            return [list(zip(a, b)), list(zip(a, b))]

    assert run(sdp) == run(tdp)


# -- FileLister ----------------------------------------------------------------------------
@pytest.fixture
def tree(tmp_path):
    for rel in ["b.txt", "a.txt", "c.csv", "sub/z.txt", "sub/y.csv", "sub/deeper/x.txt"]:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rel)
    return tmp_path


@pytest.mark.parametrize("kwargs", [
    {}, {"masks": "*.txt"}, {"masks": ["*.csv", "a*"]}, {"recursive": True},
    {"recursive": True, "masks": "*.txt"}, {"abspath": True, "recursive": True},
])
def test_file_lister_lists_what_torchs_lists(tree, kwargs):
    root = str(tree)
    assert (list(sdp.FileLister(root, **kwargs)) == list(tdp.FileLister(root, **kwargs)))


def test_file_lister_takes_files_pipes_and_a_length_as_torch(tree):
    files = [str(tree / "a.txt"), str(tree / "sub")]
    assert list(sdp.FileLister(files)) == list(tdp.FileLister(files))
    pipe_ours = sdp.IterableWrapper([str(tree / "sub")]).list_files(masks="*.csv")
    pipe_theirs = tdp.IterableWrapper([str(tree / "sub")]).list_files(masks="*.csv")
    assert list(pipe_ours) == list(pipe_theirs) == [os.path.join(str(tree / "sub"), "y.csv")]
    assert len(sdp.FileLister(str(tree), length=3)) == len(tdp.FileLister(str(tree), length=3))
    with pytest.raises(TypeError, match="doesn't have valid length"):
        len(sdp.FileLister(str(tree)))
