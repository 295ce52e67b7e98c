"""The global random state behind randn, rand and dropout (core.manual_seed resets it), and the
draws the random creators make from a given Generator (generator=)."""

from __future__ import annotations

from typing import Any

import numpy as np

_np_gen = np.random.default_rng()
_seed: int | None = None
_cupy_gens: dict[int, Any] = {}


def manual_seed(seed: int) -> None:
    """Seed the numpy generator (and, lazily, one cupy generator per device)."""
    global _np_gen, _seed
    seed = int(seed)
    _seed = seed
    _np_gen = np.random.default_rng(seed)
    _cupy_gens.clear()


def initial_seed() -> int | None:
    """The last seed given to manual_seed (None when never seeded)."""
    return _seed


def generator(xp: Any, device_index: int | None = None) -> Any:
    """The generator for an array module (numpy's global one, or the device's cupy one)."""
    if xp is np:
        return _np_gen
    gen = _cupy_gens.get(device_index)
    if gen is None:
        seed = _seed if _seed is not None else int(_np_gen.integers(2**31))
        gen = xp.random.default_rng(seed + (device_index or 0))
        _cupy_gens[device_index] = gen
    return gen


def get_state() -> dict:
    """The numpy generator's state (for checkpoints)."""
    return _np_gen.bit_generator.state


def set_state(state: dict) -> None:
    """Restore a state returned by get_state."""
    _np_gen.bit_generator.state = state


def get_rng_state() -> dict:
    """torch.get_rng_state's counterpart: the global generator's state (a dict core.save takes)."""
    return get_state()


def set_rng_state(state: dict) -> None:
    """torch.set_rng_state's counterpart: restore what get_rng_state returned."""
    set_state(state)


# -- draws from a given Generator (generator=): core.Generator or data.Generator, both torch's
# CPU Mersenne Twister (core/data/random.py). They read its 32-bit words as torch's CPU kernels
# do, so rand, randint and randperm give torch's values for the same seed, and randn gives them
# to float rounding for 16 or more elements (torch's normal_fill); fewer use torch's Box-Muller
# pairs without its cached second value, and bernoulli/multinomial only share the stream.

_LOW24 = np.uint64((1 << 24) - 1)


def check_generator(generator: Any, op: str) -> Any:
    """The generator, or torch's TypeError for anything that is not one."""
    if not hasattr(generator, "words"):
        raise TypeError(f"{op}(): argument 'generator' must be torch.Generator, not "
                        f"{type(generator).__name__}")
    return generator


def uniform_from(gen: Any, n: int, dtype: Any) -> np.ndarray:
    """n draws in [0, 1) as torch's uniform_ takes them: 24 bits of one word (float32 and
    narrower) or 53 bits of two (float64)."""
    if np.dtype(dtype) == np.float64:
        return gen.uniform(n)
    return ((gen.words(n) & _LOW24).astype(np.float64) * 2.0 ** -24).astype(np.float32)


def _box_muller16(u: np.ndarray) -> np.ndarray:
    """torch's normal_fill_16 on each block of 16 uniforms: 8 (cos, sin) pairs."""
    d = u.reshape(-1, 16).astype(np.float64)
    radius = np.sqrt(-2.0 * np.log(1.0 - d[:, :8]))
    theta = 2.0 * np.pi * d[:, 8:]
    return np.concatenate([radius * np.cos(theta), radius * np.sin(theta)], axis=1).reshape(-1)


def normal_from(gen: Any, n: int, dtype: Any) -> np.ndarray:
    """n standard normal draws (float64 values), in torch's order."""
    if n < 16:
        u = gen.uniform(2 * ((n + 1) // 2)).reshape(-1, 2)
        radius = np.sqrt(-2.0 * np.log1p(-u[:, 1]))
        theta = 2.0 * np.pi * u[:, 0]
        return np.stack([radius * np.cos(theta), radius * np.sin(theta)], axis=1).reshape(-1)[:n]
    # torch fills all n uniforms, transforms whole blocks of 16, then redraws the last 16
    # elements from fresh uniforms when n is not a multiple of 16.
    out = _box_muller16(uniform_from(gen, n, dtype)[: n - n % 16])
    if n % 16:
        out = np.concatenate([out[: n - 16], _box_muller16(uniform_from(gen, 16, dtype))])
    return out


def integers_from(gen: Any, low: int, high: int, n: int) -> np.ndarray:
    """n integers in [low, high): one word modulo the range, two for ranges from 2**32 up."""
    span = high - low
    if span <= 0:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={low} "
                           f">= to={high}")
    if span < 1 << 32:
        return (gen.words(n) % np.uint64(span)).astype(np.int64) + low
    pairs = gen.words(2 * n).reshape(n, 2)
    return (((pairs[:, 0] << np.uint64(32)) | pairs[:, 1]) % np.uint64(span)).astype(np.int64) + low
