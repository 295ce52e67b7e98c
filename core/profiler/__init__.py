"""torch.profiler's names over shoal: profile, schedule, record_function, trace handlers."""

from shoal.core.profiler.schedule import ProfilerAction, ProfilerError, schedule
from shoal.core.profiler.profile import (
    ProfilerActivity, kineto_available, profile, record_function, supported_activities,
)
from shoal.core.profiler.handlers import tensorboard_trace_handler
from shoal.core.profiler import job as _job

_job.start_from_env()  # `shoal run --profile DIR`: every worker profiles a step window

__all__ = [
    "ProfilerAction",
    "ProfilerActivity",
    "ProfilerError",
    "kineto_available",
    "profile",
    "record_function",
    "schedule",
    "supported_activities",
    "tensorboard_trace_handler",
]
