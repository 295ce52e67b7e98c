"""`core.Generator`: torch.Generator's surface over the data layer's Mersenne Twister.

core/data/random.py holds the one MT19937 implementation (torch's seeding, so randperm and the
samplers' shuffles equal torch's); this adds torch.Generator's `device` and `seed()`, and takes
a state as a tensor too. The random creators draw from any generator with that twister's
`words`/`uniform` (core/ops/random.py), so a data.Generator works there as well.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from shoal.core import backend
from shoal.core.data.random import Generator as _Twister

__all__ = ["Generator"]


class Generator(_Twister):
    """A seeded random stream, apart from the global one: pass it as generator= to the
    random creators (rand, randn, randint, randperm, normal_, uniform_, bernoulli, multinomial)."""

    def __init__(self, device: Any = "cpu") -> None:
        super().__init__()
        # Draws are made on the cpu and moved: the stream is the same on every device.
        self.device = backend.device(device)

    def seed(self) -> int:
        """Reseed from the operating system's entropy; returns the seed (torch's seed())."""
        seed = int.from_bytes(os.urandom(8), "little")
        self.manual_seed(seed)
        return seed

    def set_state(self, state: Any) -> None:
        """Restore a state get_state returned (a tensor of it too)."""
        super().set_state(np.asarray(state))

    def __repr__(self) -> str:
        return f"<core.Generator device={self.device} initial_seed={self.initial_seed()}>"
