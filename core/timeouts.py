"""One way to spell a timeout everywhere: `datetime.timedelta` or seconds as a number."""

from __future__ import annotations

import datetime
import math
import time
from typing import Optional, Union

TimeoutLike = Union[datetime.timedelta, float, int, None]


def to_seconds(timeout: TimeoutLike, default: Optional[float] = None) -> Optional[float]:
    """Return `timeout` in seconds (None stays None unless a default is given).

    Raises:
        ValueError: a negative or NaN timeout, or one of an unsupported type.
    """
    if timeout is None:
        return default
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ValueError(
            f"timeout must be a datetime.timedelta or a number of seconds, got {timeout!r}"
        )
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"timeout must be zero or more seconds, got {seconds!r}")
    return seconds


class Deadline:
    """A point in monotonic time; `remaining()` is what a blocking call may still wait."""

    def __init__(self, timeout: TimeoutLike):
        seconds = to_seconds(timeout)
        self.timeout = seconds
        self._end = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> Optional[float]:
        """Seconds left (never negative), or None for no deadline."""
        if self._end is None:
            return None
        return max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        """True once the deadline has passed."""
        return self._end is not None and time.monotonic() >= self._end
