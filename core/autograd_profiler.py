"""torch.autograd.profiler's legacy names over shoal's profiler: `profile` (events read from
`function_events` once it exits), `record_function`, `EventList`, `FunctionEvent`.

It is meant to be reachable as `core.autograd.profiler`, as torch's is as
`torch.autograd.profiler`: core's package init binds it there (core.autograd is a module, and
this one imports the profiler, which imports autograd).
"""

from __future__ import annotations

from typing import Any, Optional

from shoal.core.profiler.analysis import EventList, FunctionEvent, FunctionEventAvg
from shoal.core.profiler.events import Recorder
from shoal.core.profiler.profile import (
    ProfilerActivity, kineto_available, profile as _profile, record_function,
)


class profile:  # noqa: N801 - torch's name
    """The legacy context manager: records while entered (when `enabled`); on exit the events
    are `function_events`, summarised by key_averages() and table()."""

    def __init__(self, enabled: bool = True, *, use_cuda: bool = False,
                 use_device: Optional[str] = None, record_shapes: bool = False,
                 with_flops: bool = False, profile_memory: bool = False,
                 with_stack: bool = False, with_modules: bool = False, use_kineto: bool = False,
                 use_cpu: bool = True, experimental_config: Any = None,
                 acc_events: bool = False, custom_trace_id_callback: Any = None) -> None:
        # with_flops, with_modules, use_cpu, experimental_config, acc_events and the trace id
        # callback are accepted for torch's scripts; shoal's profiler always records the CPU
        del with_flops, with_modules, use_cpu, experimental_config, acc_events
        del custom_trace_id_callback
        self.enabled = enabled
        self.use_cuda = use_cuda or (use_device or "").startswith("cuda")
        self.use_device = "cuda" if self.use_cuda else use_device
        self.record_shapes = record_shapes
        self.profile_memory = profile_memory
        self.with_stack = with_stack
        self.use_kineto = use_kineto
        self.entered = False
        self.function_events: EventList = EventList(Recorder())
        self._prof: Optional[_profile] = None

    def __enter__(self) -> Optional["profile"]:
        if not self.enabled:
            return None  # as torch's: `with profile(enabled=False) as p` binds None
        if self.entered:
            raise RuntimeError("Profiler context manager is not reentrant")
        self.entered = True
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.use_cuda else [])
        self._prof = _profile(activities=activities, record_shapes=self.record_shapes,
                              profile_memory=self.profile_memory, with_stack=self.with_stack)
        self._prof.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled or self._prof is None:
            return
        self._prof.stop()
        self.function_events = EventList(self._prof.events().recorder)
        self._prof = None
        self.entered = False

    def key_averages(self, group_by_input_shape: bool = False, group_by_stack_n: int = 0,
                     group_by_overload_name: bool = False) -> Any:
        """The events grouped by name (and input shapes, and top stack frames)."""
        del group_by_overload_name  # shoal's ops have no overloads
        return self.function_events.key_averages(group_by_input_shape, group_by_stack_n)

    def table(self, **kwargs: Any) -> str:
        """The grouped events as torch's table (sort_by, row_limit, time_unit, ...)."""
        return self.function_events.table(**kwargs)

    def export_chrome_trace(self, path: str) -> None:
        """Write the events as a Chrome/Perfetto trace-event JSON file."""
        self.function_events.export_chrome_trace(path)

    def total_average(self) -> FunctionEventAvg:
        """Every event folded into one average keyed "Total"."""
        return self.function_events.total_average()

    @property
    def self_cpu_time_total(self) -> float:
        """The sum of the events' self CPU times (us)."""
        return self.function_events.self_cpu_time_total

    def __str__(self) -> str:
        return self.table()


__all__ = ["EventList", "FunctionEvent", "FunctionEventAvg", "kineto_available", "profile",
           "record_function"]
