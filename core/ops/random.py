"""The global random state behind randn, rand and dropout; core.manual_seed resets it."""

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
