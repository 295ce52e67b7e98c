"""Mixed precision under data parallelism: every rank skips the same GradScaler steps.

A GradScaler decides from its own rank's gradients whether to skip a step. DDP averages the
gradients first, so an overflow on one rank usually reaches all; but a rank can also overflow
after the all-reduce (in its own unscale, or with gradients DDP does not own), and then the
replicas step differently and drift apart with no error. `agree_on_found_inf` makes the verdict
collective: one small all_reduce(MAX) per unscale, so a step is skipped everywhere or nowhere.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from shoal.collectives import distributed
from shoal.collectives.api import ProcessGroup
from shoal.collectives.types import ReduceOp
from shoal.core.amp.grad_scaler import GradScaler


def agree_on_found_inf(
    scaler: GradScaler, group: Optional[ProcessGroup] = None, timeout: Any = None
) -> GradScaler:
    """Make `scaler` skip a step on every rank of `group` when any rank saw inf/NaN; returns it.

    Every rank of the group must call this for its scaler (the agreement is a collective, run
    once per unscale_), with the same group. `timeout` bounds that all_reduce.
    """
    if not isinstance(scaler, GradScaler):
        raise TypeError(
            f"agree_on_found_inf: expected a core.amp.GradScaler, got {type(scaler).__name__}."
        )

    def agree(local_found_inf: bool) -> bool:
        flag = np.array([1.0 if local_found_inf else 0.0], dtype=np.float32)
        distributed.all_reduce(flag, ReduceOp.MAX, group=group, timeout=timeout)
        return bool(flag[0] > 0.0)

    scaler.found_inf_agreement = agree
    return scaler
