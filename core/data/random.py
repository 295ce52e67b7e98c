"""`Generator`: the Mersenne Twister torch's CPU generator is, so shuffles match torch's.

torch.Generator().manual_seed(s) seeds a 32-bit MT19937 (init_genrand with s mod 2**32) and
draws from it as 32-bit words; randperm(n) for n < 2**32/20 is a Fisher-Yates pass taking one
word per position (`word % (n - i)`), and an int64 `random_()` is `(hi << 32 | lo) mod 2**63`
from two words. numpy's MT19937 bit generator yields the same words through `random_raw`, so
only the seeding (a 624-step recurrence) and the shuffle loop are written here.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from shoal.core.ops import random as core_random

_MASK32 = 0xFFFFFFFF
_STATE_WORDS = 624


def _init_genrand(seed: int) -> np.ndarray:
    """MT19937's initial state for a 32-bit seed (Matsumoto and Nishimura's init_genrand)."""
    key = [0] * _STATE_WORDS
    key[0] = seed & _MASK32
    for j in range(1, _STATE_WORDS):
        prev = key[j - 1]
        key[j] = (1812433253 * (prev ^ (prev >> 30)) + j) & _MASK32
    return np.asarray(key, dtype=np.uint32)


class Generator:
    """A seeded random stream with torch.Generator's CPU semantics (manual_seed, randperm)."""

    def __init__(self, seed: Optional[int] = None) -> None:
        self._bits = np.random.MT19937()
        self._seed = 0
        self.manual_seed(67280421310721 if seed is None else seed)  # torch's default seed

    def manual_seed(self, seed: int) -> "Generator":
        """Reseed (torch keeps the low 32 bits for the twister); returns self, as torch does."""
        seed = int(seed)
        self._seed = seed
        self._bits.state = {"bit_generator": "MT19937",
                            "state": {"key": _init_genrand(seed), "pos": _STATE_WORDS}}
        return self

    def initial_seed(self) -> int:
        """The seed last given to manual_seed."""
        return self._seed

    def get_state(self) -> np.ndarray:
        """The twister's words and position as one uint32 array (a checkpoint-safe value)."""
        state = self._bits.state["state"]
        return np.append(state["key"].astype(np.uint32), np.uint32(state["pos"]))

    def set_state(self, state: np.ndarray) -> None:
        """Restore a state returned by get_state."""
        state = state_words(state)
        self._bits.state = {"bit_generator": "MT19937",
                            "state": {"key": state[:-1].astype(np.uint32), "pos": int(state[-1])}}

    def words(self, count: int) -> np.ndarray:
        """The next `count` 32-bit outputs, as uint64 values."""
        return self._bits.random_raw(count)

    def random_int64(self) -> int:
        """What `torch.empty((), dtype=torch.int64).random_(generator=g)` returns."""
        hi, lo = (int(w) for w in self.words(2))
        return ((hi << 32) | lo) % (1 << 63)

    def uniform(self, count: int) -> np.ndarray:
        """The next `count` doubles in [0, 1) as torch's uniform_real_distribution<double>
        draws them: the low 53 bits of (hi << 32 | lo) from two words, times 2**-53."""
        pairs = self.words(2 * count).reshape(count, 2)
        bits = ((pairs[:, 0] << np.uint64(32)) | pairs[:, 1]) & np.uint64((1 << 53) - 1)
        return bits.astype(np.float64) * 2.0 ** -53

    def randperm(self, n: int) -> np.ndarray:
        """`torch.randperm(n, generator=g)` (int64), drawing exactly the words torch draws."""
        if n < 0:
            raise ValueError(f"randperm needs n >= 0, got {n}")
        if n >= _MASK32 // 20:
            raise ValueError(
                f"randperm supports n < {_MASK32 // 20} (torch's 32-bit path), got {n}")
        perm = list(range(n))
        if n > 1:
            picks = (self.words(n - 1) % np.arange(n, 1, -1, dtype=np.uint64)).tolist()
            for i, z in enumerate(picks):
                j = i + z
                perm[i], perm[j] = perm[j], perm[i]
        return np.asarray(perm, dtype=np.int64)


def state_words(state: Any) -> np.ndarray:
    """`state` as a Generator state's uint32 words (a list from a JSON checkpoint too).

    Raises:
        ValueError: it is not one (names the shape it has).
    """
    words = np.asarray(state)
    if words.shape != (_STATE_WORDS + 1,):
        raise ValueError(
            f"a Generator state has {_STATE_WORDS + 1} uint32 words, got shape {words.shape}")
    return words.astype(np.uint32)


def default_seed() -> int:
    """A seed from core's global generator (core.manual_seed makes it repeatable).

    torch draws it from its default generator; shoal's default generator is numpy's PCG64, so
    streams match torch's only where the caller passes a seeded Generator.
    """
    return int(core_random.generator(np).integers(1 << 63))
