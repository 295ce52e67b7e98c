"""The job profiler `shoal run --profile DIR` starts in every worker (SHOAL_PROFILE_DIR, in a
process that has RANK).

Steps are counted by optimizer steps (a training script needs no change); a schedule from
SHOAL_PROFILE_SCHEDULE (default `skip_first=2,wait=0,warmup=1,active=3,repeat=1`) picks the
window, and each rank writes `DIR/rank<R>.<first step>.pt.trace.json`. Before writing, the rank
estimates its clock's offset from rank 0's by round trips through the store the default process
group lent to `clock` when it formed, so `shoal trace merge` can align the ranks.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
from typing import Any, Callable, Optional

from shoal.core import settings
from shoal.core.profiler import clock, instrument
from shoal.core.profiler.handlers import job_trace_handler
from shoal.core.profiler.profile import profile, rank_from_env
from shoal.core.profiler.schedule import ProfilerError, schedule

logger = logging.getLogger(__name__)

DEFAULT_SCHEDULE = settings.PROFILE_SCHEDULE.default
_FIELDS = ("wait", "warmup", "active", "repeat", "skip_first")


class JobProfile(profile):
    """The job profiler: a user's own `profile()` records while it does (state.py), and its
    windows get a copy of what the user's recorded."""

    background = True


_job: Optional[profile] = None


def parse_schedule(text: str) -> Callable:
    """`wait=1,active=3` -> schedule(...); unknown names or values raise naming the allowed."""
    kw: dict[str, int] = {"wait": 0, "warmup": 0, "active": 1, "repeat": 0, "skip_first": 0}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in _FIELDS or not value.strip().lstrip("-").isdigit():
            raise ProfilerError(
                f"SHOAL_PROFILE_SCHEDULE: {part!r} is not a setting; allowed: "
                f"{', '.join(f + '=N' for f in _FIELDS)}."
            )
        kw[name] = int(value)
    return schedule(**kw)


class _JobHandler:
    """Estimate the clock offset (once per window), then write the window's trace file."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, prof: profile) -> str:
        extra: dict[str, Any] = {"clock": {"offset_us": 0.0, "error_us": None,
                                           "reference_rank": 0, "method": "none"}}
        try:
            extra["clock"] = clock.window_offset(prof.window)
        except Exception as exc:  # noqa: BLE001 - a trace without an offset beats no trace
            logger.warning("Could not estimate this rank's clock offset: %s", exc)
            extra["clock"]["method"] = f"failed: {exc}"
        return job_trace_handler(self.directory, rank_from_env(), extra)(prof)


def _on_step(_optimizer: Any) -> None:
    if _job is not None:
        _job.step()


def _stop() -> None:
    global _job
    job, _job = _job, None
    if job is not None:
        job.stop()


def start_from_env(environ: Optional[dict] = None) -> Optional[profile]:
    """Start the job profiler in a rank of a job (RANK set) when SHOAL_PROFILE_DIR is set
    (called once, at core import)."""
    global _job
    env = os.environ if environ is None else environ
    directory = settings.PROFILE_DIR.get(env)
    if not directory or _job is not None:
        return _job
    if env.get("RANK") is None:
        # `shoal run` itself, given SHOAL_PROFILE_DIR instead of --profile, imports core too:
        # only its workers, which it gives RANK, profile (the agent's trace would be a stray
        # file that `shoal trace` takes for another run's).
        logger.debug("SHOAL_PROFILE_DIR is set but RANK is not: not a rank, not profiling.")
        return None
    if multiprocessing.parent_process() is not None:
        # A DataLoader worker or another child of the rank: it inherits the variables but
        # must not write (over) the rank's trace file.
        return None
    sched = parse_schedule(settings.PROFILE_SCHEDULE.get(env))
    _job = JobProfile(schedule=sched, on_trace_ready=_JobHandler(directory),
                      record_shapes=settings.PROFILE_SHAPES.get(env),
                      profile_memory=settings.PROFILE_MEMORY.get(env))
    instrument.watch_steps(_on_step)
    _job.start()
    atexit.register(_stop)
    return _job
