"""Mixed precision under data parallelism: every rank skips the same GradScaler steps.

A GradScaler decides from its own rank's gradients whether to skip a step. DDP averages the
gradients first, so an overflow on one rank in a reduced gradient reaches all; but a rank can
also see inf/NaN that DDP never reduced (a parameter outside the wrapped module, in the same
optimizer) or that appeared after the reduction, and then the replicas step differently and
drift apart with no error. Both helpers here make the verdict collective: one small
all_reduce(MAX) per unscale_, so a step is skipped everywhere or nowhere.

- `agree_for_replicas(params, group)`: what DistributedDataParallel calls at construction. Any
  GradScaler whose optimizer holds one of `params` then agrees over `group` by itself (through
  core.amp.found_inf's registry: core never imports collectives).
- `agree_on_found_inf(scaler, group)`: one scaler agrees over `group` whatever it steps (for
  data parallelism without DDP, or to choose the group and timeout).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import numpy as np

from shoal.collectives import distributed
from shoal.collectives.api import ProcessGroup
from shoal.collectives.types import GroupDestroyed, ReduceOp
from shoal.core.amp import found_inf
from shoal.core.amp.grad_scaler import GradScaler


def _group_verdict(
    group: Optional[ProcessGroup], timeout: Any, paused: Optional[Callable[[], bool]] = None
) -> Callable[[bool], bool]:
    gone = []  # set once the group is destroyed: there are no replicas left to agree with

    def agree(local_found_inf: bool) -> bool:
        if gone or (paused is not None and paused()):
            return local_found_inf
        flag = np.array([1.0 if local_found_inf else 0.0], dtype=np.float32)
        try:
            distributed.all_reduce(flag, ReduceOp.MAX, group=group, timeout=timeout)
        except GroupDestroyed:
            # The job left the group (destroy_process_group) and trains on alone, or the
            # wrapper outlived it: its verdict is its own from now on.
            gone.append(True)
            return local_found_inf
        return bool(flag[0] > 0.0)

    return agree


def agree_on_found_inf(
    scaler: GradScaler, group: Optional[ProcessGroup] = None, timeout: Any = None
) -> GradScaler:
    """Make `scaler` skip a step on every rank of `group` when any rank saw inf/NaN; returns it.

    Every rank of the group must call this for its scaler (the agreement is a collective, run
    once per unscale_), with the same group. `timeout` bounds that all_reduce. It replaces the
    agreements DDP registered for the scaler's parameters.
    """
    if not isinstance(scaler, GradScaler):
        raise TypeError(
            f"agree_on_found_inf: expected a core.amp.GradScaler, got {type(scaler).__name__}."
        )
    scaler.found_inf_agreement = _group_verdict(group, timeout)
    return scaler


def agree_for_replicas(
    params: Iterable[Any], group: Optional[ProcessGroup] = None, timeout: Any = None,
    paused: Optional[Callable[[], bool]] = None,
) -> found_inf.AgreementHandle:
    """Any GradScaler stepping one of `params` agrees its inf/NaN verdict over `group`.

    For a wrapper that keeps `params` replicated on every rank of `group` (DDP calls it with
    its parameters). While `paused()` is true the verdict stays local. DDP pauses it for the
    whole of a `Join` block, on every rank (a rank that ran out of data no longer steps, so a
    collective in the step would wait for it): there the gradients DDP reduces still agree, but
    an overflow in a parameter outside DDP is seen by its own rank only. Once the group is
    destroyed the verdict is local for good. Returns a handle whose remove() undoes it.
    """
    return found_inf.register_found_inf_agreement(params, _group_verdict(group, timeout, paused))
