"""torch.profiler's step schedule: which steps are skipped, warmed up, recorded and saved."""

from __future__ import annotations

import enum
from typing import Callable

from shoal.core.errors import ShoalError


class ProfilerError(ShoalError, ValueError):
    """Bad profiler input: an unknown sort key, activity or schedule value."""


class ProfilerAction(enum.Enum):
    """What the profiler does during a step (torch's names)."""

    NONE = 0
    WARMUP = 1
    RECORD = 2
    RECORD_AND_SAVE = 3


def schedule(
    *, wait: int, warmup: int, active: int, repeat: int = 0, skip_first: int = 0,
    skip_first_wait: int = 0,
) -> Callable[[int], ProfilerAction]:
    """A step -> action function: skip `skip_first` steps, then cycles of wait/warmup/active.

    `repeat` bounds the number of cycles (0: cycle until the profiler stops). The last active
    step of each cycle is RECORD_AND_SAVE: its end hands the window to on_trace_ready. A
    non-zero `skip_first_wait` skips the first cycle's wait, as torch's.
    """
    for field, value, low in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1),
                              ("repeat", repeat, 0), ("skip_first", skip_first, 0),
                              ("skip_first_wait", skip_first_wait, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ProfilerError(
                f"schedule(): {field}={value!r} is not allowed; {field} must be an integer "
                f">= {low} (allowed: wait >= 0, warmup >= 0, active >= 1, repeat >= 0, "
                f"skip_first >= 0, skip_first_wait >= 0)."
            )
    cycle = wait + warmup + active

    def action(step: int) -> ProfilerAction:
        if step < skip_first:
            return ProfilerAction.NONE
        step -= skip_first
        if skip_first_wait:
            step += wait  # as torch's: the cycles shift left by one wait, so repeat counts it
        if repeat > 0 and step >= repeat * cycle:
            return ProfilerAction.NONE
        pos = step % cycle
        if pos < wait:
            return ProfilerAction.NONE
        if pos < wait + warmup:
            return ProfilerAction.WARMUP
        return ProfilerAction.RECORD_AND_SAVE if pos == cycle - 1 else ProfilerAction.RECORD

    return action


def _always_record(step: int) -> ProfilerAction:
    return ProfilerAction.RECORD
