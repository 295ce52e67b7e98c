"""A loader over a sharded DataPipe resumed at another world size or worker count re-deals the
rest of the epoch: over the epoch every sample is read exactly once. Ranks are simulated in
this process one after the other (each loader reads the rank set for it at iter()); under
DDP they hand out batches in lockstep, which `lockstep` reproduces. Datasets that cannot be
re-dealt raise an error naming both shapes instead of returning wrong data."""

from __future__ import annotations

import collections
import contextlib
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.core import data
from shoal.core.data import datapipes as dp
from shoal.core.data.datapipes import sharding
from shoal.core.data.stream_state import remaining_layout

N = 101  # not a multiple of any shape's shard count: shards differ in length


@contextlib.contextmanager
def as_rank(rank: int, world: int):
    sharding.set_distributed_info(rank, world)
    try:
        yield
    finally:
        sharding._info = None


def plain(n: int = N):
    return dp.IterableWrapper(range(n)).shuffle(buffer_size=16).sharding_filter().map(int)


def flatten(batch) -> list[int]:
    return batch.tolist() if hasattr(batch, "tolist") else [int(x) for x in batch]


def make(pipe_fn, workers: int, batch: int = 3, **kwargs):
    return lambda: data.DataLoader(pipe_fn(), batch_size=batch, num_workers=workers,
                                   generator=data.Generator(7), **kwargs)


def start(world: int, new_loader) -> tuple[list, list]:
    loaders, iters = [], []
    for rank in range(world):
        with as_rank(rank, world):
            loader = new_loader()
            loaders.append(loader)
            iters.append(iter(loader))
    return loaders, iters


def lockstep(iters, steps: int) -> list[int]:
    seen = []
    for _ in range(steps):
        for it in iters:
            seen += flatten(next(it))
    return seen


def finish(world: int, new_loader, state: dict) -> list[int]:
    seen = []
    for rank in range(world):
        with as_rank(rank, world):
            loader = new_loader()
            loader.load_state_dict(state)
            seen += [x for b in loader for x in flatten(b)]
    return seen


def batches_per_rank(world: int, new_loader) -> list[int]:
    out = []
    for rank in range(world):
        with as_rank(rank, world):
            out.append(sum(1 for _ in new_loader()))
    return out


def close(loaders) -> None:
    for loader in loaders:
        if loader._iterator is not None:
            loader._iterator.close()


@pytest.mark.parametrize("workers_before, workers_after", [(0, 0), (2, 2), (2, 0), (0, 2)])
@pytest.mark.parametrize("before, after", [(4, 3), (3, 4)])
def test_a_resize_mid_epoch_reads_every_sample_exactly_once(before, after, workers_before,
                                                            workers_after):
    first = make(plain, workers_before)
    steps = min(batches_per_rank(before, first)) // 2
    loaders, iters = start(before, first)
    seen = lockstep(iters, steps)
    state = loaders[0].state_dict()  # rank 0's, as elastic.State saves and syncs it
    close(loaders)
    assert state["world_size"] == before and state["num_workers"] == workers_before
    seen += finish(after, make(plain, workers_after), state)
    assert sorted(seen) == list(range(N))


@pytest.mark.parametrize("saved_rank", [1, 3])
def test_any_ranks_lockstep_state_resumes_exactly(saved_rank):
    first = make(plain, 2)
    steps = min(batches_per_rank(4, first))  # to the last lockstep step: shorter shards ran out
    loaders, iters = start(4, first)
    seen = lockstep(iters, steps)
    state = loaders[saved_rank].state_dict()
    close(loaders)
    seen += finish(3, make(plain, 2), state)
    assert sorted(seen) == list(range(N))


def test_a_resumed_epoch_can_be_resized_again():
    loaders, iters = start(4, make(plain, 2))
    seen = lockstep(iters, 3)
    state = loaders[0].state_dict()
    close(loaders)
    loaders, iters = start(3, lambda: resumed(make(plain, 0), state))
    seen += lockstep(iters, 2)
    again = loaders[2].state_dict()
    close(loaders)
    assert again["shards"]["start"] > 0 and again["shards"]["skip"]  # a re-dealt layout
    seen += finish(2, make(plain, 2), again)
    assert sorted(seen) == list(range(N))


def stream_order(seen: list[int], world: int) -> list[int]:
    """The order the sharding_filter dealt, from every rank's items (rank 0's first)."""
    order, k = [0] * len(seen), 0
    for rank in range(world):
        size = len(range(rank, len(seen), world))
        order[rank::world] = seen[k:k + size]
        k += size
    return order


def resumed(new_loader, state):
    loader = new_loader()
    loader.load_state_dict(state)
    return loader


def test_an_end_of_epoch_state_resumes_to_an_empty_epoch_at_another_size():
    new_loader = make(plain, 0)
    loaders, iters = start(4, new_loader)
    assert batches_per_rank(4, new_loader) == [9] * 4
    seen = lockstep(iters, 9)  # every batch handed out, the loop not yet told the epoch ended
    assert sorted(seen) == list(range(N))
    assert finish(3, new_loader, loaders[0].state_dict()) == []


def test_a_state_taken_after_the_epoch_ended_resumes_with_the_next_epoch_at_another_size():
    new_loader = make(plain, 0)
    loaders, iters = start(4, new_loader)
    first = [x for it in iters for b in it for x in flatten(b)]  # each loop saw StopIteration
    state = loaders[0].state_dict()
    following = []  # the uninterrupted loaders' next epoch
    for rank, loader in enumerate(loaders):
        with as_rank(rank, 4):
            following += [x for b in loader for x in flatten(b)]
    resumed = finish(3, new_loader, state)
    assert sorted(resumed) == list(range(N))  # a whole epoch, not an empty rest
    # ...with the next epoch's shuffle, as the uninterrupted loaders drew it (the rank split
    # differs at 3 ranks, the order of the stream before the sharding_filter does not)
    assert following != first and stream_order(resumed, 3) == stream_order(following, 4)


def not_multiple_of_5(x):
    return x % 5 != 0


def filtered():
    return (dp.IterableWrapper(range(N)).shuffle(buffer_size=16).sharding_filter()
            .filter(not_multiple_of_5))


def test_merged_states_resume_ranks_that_were_not_in_lockstep():
    loaders, iters = start(3, make(filtered, 2))
    seen = []
    for rank, it in enumerate(iters):  # rank r handed out r + 1 batches
        for _ in range(rank + 1):
            seen += flatten(next(it))
    states = [ld.state_dict() for ld in loaders]
    close(loaders)
    merged = data.merge_loader_states(states[::-1])
    seen += finish(4, make(filtered, 0), merged)
    assert sorted(seen) == [x for x in range(N) if not_multiple_of_5(x)]


def test_a_filter_after_the_sharding_filter_needs_every_ranks_state():
    loaders, iters = start(3, make(filtered, 0))
    lockstep(iters, 2)
    state = loaders[0].state_dict()
    with as_rank(0, 2):
        loader = make(filtered, 0)()
        loader.load_state_dict(state)
        with pytest.raises(data.DataLoaderError,
                           match=r"saved at world size 3 with 0 workers per rank cannot resume "
                                 r"at world size 2 with 0 workers per rank: a filter after the "
                                 r"sharding_filter .*merge the states of all ranks "
                                 r"\(shoal\.collectives\.gather_loader_state\)"):
            iter(loader)


def test_merging_refuses_states_that_do_not_belong_together():
    loaders, _ = start(2, make(plain, 0))
    a, b = (ld.state_dict() for ld in loaders)
    with pytest.raises(ValueError, match=r"one state from each of the 2 ranks, got ranks \[0, 0\]"):
        data.merge_loader_states([a, a])
    with pytest.raises(ValueError, match="disagree on base_seed"):
        data.merge_loader_states([a, dict(b, base_seed=b["base_seed"] + 1)])


class Stream(data.IterableDataset):
    """0..n-1 split by rank and worker by the dataset itself."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        rank, world = sharding.distributed_info()
        info = data.get_worker_info()
        workers, wid = (info.num_workers, info.id) if info is not None else (1, 0)
        return iter(range(rank * workers + wid, self.n, world * workers))


@pytest.mark.parametrize("dataset, reason", [
    (lambda: Stream(40), "Stream is an IterableDataset that splits itself across ranks and "
                         "workers"),
    (lambda: dp.IterableWrapper(range(40)).map(int), "the pipe has no sharding_filter"),
    (lambda: dp.IterableWrapper(range(40)).sharding_filter().shuffle(buffer_size=4),
     "Shuffler sits between the sharding_filter and the loader"),
    (lambda: dp.IterableWrapper(range(40)).sharding_filter().concat(
        dp.IterableWrapper(range(3)).sharding_filter()), "the pipe has 2 sharding_filters"),
])
@pytest.mark.parametrize("workers_after", [0, 2])
def test_what_cannot_be_redealt_is_refused_naming_both_shapes(dataset, reason, workers_after):
    with as_rank(0, 4):
        first = data.DataLoader(dataset(), batch_size=2, num_workers=2)
        it = iter(first)
        next(it)
        state = first.state_dict()
        it.close()
    with as_rank(0, 4 if workers_after == 0 else 3):
        again = data.DataLoader(dataset(), batch_size=2, num_workers=workers_after)
        again.load_state_dict(state)
        after = 4 if workers_after == 0 else 3
        for _ in range(2):  # the state is kept: a second try fails alike, never starts afresh
            with pytest.raises(data.DataLoaderError,
                               match=rf"saved at world size 4 with 2 workers per rank cannot "
                                     rf"resume at world size {after} with {workers_after} "
                                     rf"workers per rank: {reason}"):
                iter(again)


def test_the_same_shape_replays_the_saved_batches_of_a_self_splitting_stream():
    def loader():
        return data.DataLoader(Stream(40), batch_size=3, num_workers=2)

    with as_rank(1, 2):
        whole = [flatten(b) for b in loader()]
        first = loader()
        it = iter(first)
        head = [flatten(next(it)) for _ in range(3)]
        state = first.state_dict()
        it.close()
        assert head + [flatten(b) for b in resumed(loader, state)] == whole


def test_remaining_layout_passes_over_exactly_the_consumed_positions():
    # 3 instances over positions 10.. minus {12, 20}; instance counts 2, 4, 1
    start, skip = remaining_layout((10, (12, 20)), 3, [2, 4, 1])
    dealt = [p for p in range(10, 40) if p not in (12, 20)]
    consumed = {dealt[i + 3 * t] for i, c in enumerate([2, 4, 1]) for t in range(c)}
    rest = [p for p in range(start, 40) if p not in set(skip)]
    assert sorted(consumed | set(rest) | {12, 20} | set(range(10))) == list(range(40))
    assert not consumed & set(rest) and start == min(set(dealt) - consumed)


def batched_pipe(n: int, per: int):
    pipe = dp.IterableWrapper(range(n)).shuffle(buffer_size=8).sharding_filter()
    return pipe.batch(per) if per > 1 else pipe


def items(batch) -> list[int]:
    out = []
    for x in batch:
        out += list(x) if isinstance(x, list) else [x]
    return out


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 90), w1=st.integers(1, 5), w2=st.integers(1, 5),
       k1=st.sampled_from([0, 1, 2]), k2=st.sampled_from([0, 1, 3]), batch=st.integers(1, 4),
       per=st.integers(1, 3), fraction=st.floats(0, 1), saved=st.integers(0, 4))
def test_lockstep_resize_property(n, w1, w2, k1, k2, batch, per, fraction, saved):
    def new_loader(workers):
        return lambda: data.DataLoader(batched_pipe(n, per), batch_size=batch,
                                       num_workers=workers, collate_fn=items,
                                       generator=data.Generator(3))

    totals = batches_per_rank(w1, new_loader(k1))
    steps = math.floor(fraction * min(totals))
    loaders, iters = start(w1, new_loader(k1))
    seen = []
    for _ in range(steps):
        for it in iters:
            seen += next(it)
    state = loaders[saved % w1].state_dict()
    close(loaders)
    for rank in range(w2):
        with as_rank(rank, w2):
            seen += [x for b in resumed(new_loader(k2), state) for x in b]
    assert collections.Counter(seen) == collections.Counter(range(n))
