"""Property: a DistributedSampler-driven loader stopped after any number of lockstep steps at
one world size and resumed at another reads every sample of the epoch at least once, exactly
once when neither world size needs padding, and otherwise repeats only padding."""

from __future__ import annotations

import collections
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.collectives.data import DistributedSampler
from shoal.core import data


def loaders(n: int, world: int, batch: int, seed: int) -> list[data.DataLoader]:
    return [data.DataLoader(range(n), batch_size=batch,
                            sampler=DistributedSampler(range(n), world, r, seed=seed))
            for r in range(world)]


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 120), w1=st.integers(1, 6), w2=st.integers(1, 6),
       batch=st.integers(1, 5), seed=st.integers(0, 2**31), fraction=st.floats(0, 1))
def test_a_resize_mid_epoch_reads_each_sample_once_up_to_padding(n, w1, w2, batch, seed,
                                                                  fraction):
    steps = math.ceil(math.ceil(n / w1) / batch)
    k = round(fraction * steps)
    seen = []
    first = loaders(n, w1, batch, seed)
    iters = [iter(ld) for ld in first]
    for _ in range(k):
        for it in iters:
            seen += next(it).array.tolist()
    state = first[0].state_dict()
    # every rank saves the same position (base seeds differ: each loader drew its own)
    assert all(ld.state_dict()["sampler"] == state["sampler"] for ld in first)
    for ld in loaders(n, w2, batch, seed):
        ld.load_state_dict(state)
        seen += [i for b in ld for i in b.array.tolist()]
    counts = collections.Counter(seen)
    assert set(counts) == set(range(n))
    position = min(k * batch * w1, n)
    padded = (position == n and n % w1) or (n - position) % w2
    if not padded:
        assert set(counts.values()) == {1}
    else:
        assert len(seen) - n <= (w1 - 1) + (w2 - 1)


def test_a_sampler_read_directly_saves_its_own_position():
    n, seen = 30, []
    first = [DistributedSampler(range(n), 3, r, seed=1) for r in range(3)]
    iters = [iter(s) for s in first]
    for _ in range(4):  # four indices on each of 3 ranks
        for it in iters:
            seen.append(next(it))
    state = first[1].state_dict()
    assert state["start"] == 12 and all(s.state_dict() == state for s in first)
    for r in range(2):  # the rest at 2 ranks
        sampler = DistributedSampler(range(n), 2, r, seed=1)
        sampler.load_state_dict(state)
        seen += list(sampler)
    assert sorted(seen) == list(range(n))
    seq = data.SequentialSampler(range(5))
    it = iter(seq)
    next(it), next(it)
    resumed = data.SequentialSampler(range(5))
    resumed.load_state_dict(seq.state_dict())
    assert list(resumed) == [2, 3, 4]
    rnd = data.RandomSampler(range(9), generator=data.Generator(2))
    order = list(data.RandomSampler(range(9), generator=data.Generator(2)))
    it = iter(rnd)
    head = [next(it) for _ in range(4)]
    again = data.RandomSampler(range(9))
    again.load_state_dict(rnd.state_dict())
    assert head + list(again) == order
