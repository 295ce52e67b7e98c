"""What `shoal run --profile DIR` tells the user: where the traces go, and, when the job wrote
none, why.

The job profiler (core.profiler.job) counts a rank's steps by its shoal optimizers'
`step()` calls and writes a trace once SHOAL_PROFILE_SCHEDULE's window has run. A script that
never steps a shoal optimizer (an unchanged torch script, whose optimizer is torch's) never
completes a window and so writes nothing; without a word, an empty DIR looked like a bug.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

from shoal.core import settings as core_settings

logger = logging.getLogger("shoal.run")


def announce(profile_dir: Optional[str]) -> Optional[float]:
    """Say where the traces go; returns the time the job started (for `report_missing`)."""
    if not profile_dir:
        return None
    where = os.path.abspath(profile_dir)
    logger.info("--profile: each rank writes the trace of one step window (%s=%s) to %s; "
                "read them with `shoal trace summary %s`", core_settings.PROFILE_SCHEDULE.name,
                core_settings.PROFILE_SCHEDULE.get(), where, where)
    return time.time()


def written_since(profile_dir: str, since: float) -> list[str]:
    """The files of `profile_dir` written at or after `since` (seconds since the epoch)."""
    try:
        entries = list(os.scandir(profile_dir))
    except OSError:
        return []
    # One second of slack: some filesystems keep whole-second modification times.
    return sorted(e.name for e in entries if e.is_file() and e.stat().st_mtime >= since - 1.0)


def report_missing(profile_dir: Optional[str], since: Optional[float]) -> Optional[str]:
    """Once the job ended: the notice (also printed) when no rank wrote a trace, else None."""
    if not profile_dir or since is None or written_since(profile_dir, since):
        return None
    notice = (
        f"shoal run: --profile {profile_dir}: no rank wrote a trace. The job profiler counts "
        "steps by shoal optimizers (shoal.core.optim ... .step()) and writes once "
        f"{core_settings.PROFILE_SCHEDULE.name}'s window has run; this job stepped none, or "
        "fewer than the window needs. A torch script's optimizer is torch's: profile it with "
        "torch.profiler, or run it on shoal's optim.")
    logger.warning("%s", notice)
    return notice
