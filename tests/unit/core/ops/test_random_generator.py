"""core.Generator and generator= on the random creators, against torch.Generator: the same seed
gives torch's values (rand, randint, randperm exactly; randn to float rounding), a generator's
stream is apart from the global one, and its state round-trips."""

import numpy as np
import pytest
import torch

from shoal import core


def _pair(seed):
    return core.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)


def test_generator_surface_matches_torch():
    g, tg = core.Generator(), torch.Generator()
    assert g.initial_seed() == tg.initial_seed() == 67280421310721  # torch's default seed
    assert str(g.device) == str(tg.device) == "cpu"
    assert g.manual_seed(5) is g
    s = g.seed()
    assert g.initial_seed() == s and 0 <= s < 1 << 64


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(7,), (3, 5)])
def test_rand_equals_torch_for_the_same_seed(dtype, shape):
    g, tg = _pair(11)
    a = core.rand(*shape, generator=g, dtype=getattr(core, dtype))
    b = torch.rand(*shape, generator=tg, dtype=getattr(torch, dtype))
    np.testing.assert_array_equal(a.numpy(), b.numpy())  # the same words, the same arithmetic
    assert a.dtype == getattr(core, dtype)


@pytest.mark.parametrize("n", [16, 37, 64])
def test_randn_equals_torch_to_rounding_from_16_elements(n):
    g, tg = _pair(3)
    a = core.randn(n, generator=g)
    b = torch.randn(n, generator=tg)
    # torch computes log/cos/sin in float32 (vectorized), core in float64 then rounds: a few
    # float32 ulps of values below 6 in magnitude.
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=2e-6)
    # The generators consumed the same number of words: the next draws agree exactly.
    np.testing.assert_array_equal(core.rand(4, generator=g).numpy(),
                                  torch.rand(4, generator=tg).numpy())


@pytest.mark.parametrize("low, high", [(0, 10), (-5, 3), (0, 1 << 40)])
def test_randint_and_randperm_equal_torch(low, high):
    g, tg = _pair(21)
    np.testing.assert_array_equal(core.randint(low, high, (4, 3), generator=g).numpy(),
                                  torch.randint(low, high, (4, 3), generator=tg).numpy())
    np.testing.assert_array_equal(core.randperm(30, generator=g).numpy(),
                                  torch.randperm(30, generator=tg).numpy())


def test_a_generator_is_independent_of_the_global_seed_and_reproducible():
    g = core.Generator().manual_seed(7)
    core.manual_seed(1)
    a = core.randn(20, generator=g)
    core.manual_seed(2)
    core.randn(5)  # draws from the global generator do not move g
    b = core.randn(20, generator=g.manual_seed(7))
    np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_state_round_trip_as_torch():
    for lib in (core, torch):
        g = lib.Generator().manual_seed(9)
        lib.rand(3, generator=g)
        state = g.get_state()
        first = lib.rand(5, generator=g)
        g.set_state(state)
        np.testing.assert_array_equal(lib.rand(5, generator=g).numpy(), first.numpy())


def test_a_data_generator_works_as_generator_too():
    g = core.data.Generator(seed=4)
    np.testing.assert_array_equal(core.randperm(8, generator=g).numpy(),
                                  torch.randperm(8, generator=torch.Generator().manual_seed(4)))


def test_a_non_generator_is_refused_with_torchs_type_error():
    for lib in (core, torch):
        with pytest.raises(TypeError, match="generator"):
            lib.rand(3, generator=3)
