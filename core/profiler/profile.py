"""`profile` and `record_function`: torch.profiler's context manager, steps and annotations."""

from __future__ import annotations

import enum
import functools
import json
import logging
import os
import threading
from typing import Any, Callable, Iterable, Optional

from shoal.core.profiler import cuda, instrument, state
from shoal.core.profiler.analysis import EventList
from shoal.core.profiler.chrome import export_chrome_trace
from shoal.core.profiler.events import Event, Recorder, now_ns
from shoal.core.profiler.schedule import ProfilerAction, ProfilerError, _always_record

logger = logging.getLogger(__name__)

_RECORDING = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)


class ProfilerActivity(enum.Enum):
    """What to profile: CPU (ops, autograd, collectives, RPC) and CUDA (kernel times)."""

    CPU = "cpu"
    CUDA = "cuda"


class record_function:  # noqa: N801 - torch's name
    """A named range in the trace, as a context manager or a decorator."""

    def __init__(self, name: str, args: Optional[str] = None) -> None:
        if not isinstance(name, str) or not name:
            raise ProfilerError(f"record_function(): name must be a non-empty string, got {name!r}.")
        self.name = name
        self.args = args
        self._t0: Optional[int] = None
        self._rec: Optional[Recorder] = None

    def __enter__(self) -> "record_function":
        rec = state.recorder if not state.local_users else state.current()
        if rec is not None:
            self._rec = rec
            self._t0 = now_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        rec = self._rec
        if rec is not None and self._t0 is not None:
            t1 = now_ns()
            args = {"args": self.args} if self.args is not None else None
            rec.add(Event(self.name, "user_annotation", self._t0, t1 - self._t0,
                          threading.get_ident(), args))
        self._rec = None
        self._t0 = None

    def __call__(self, fn: Callable) -> Callable:
        name = self.name

        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            with record_function(name):
                return fn(*a, **kw)

        return wrapper


def _check_activities(activities: Optional[Iterable[Any]]) -> set:
    if activities is None:
        return {ProfilerActivity.CPU}
    out = set()
    for a in activities:
        if not isinstance(a, ProfilerActivity):
            raise ProfilerError(
                f"profile(): unknown activity {a!r}; allowed: ProfilerActivity.CPU, "
                "ProfilerActivity.CUDA."
            )
        out.add(a)
    return out


class profile:  # noqa: N801 - torch's name
    """Record ops, backward, optimizer steps, collectives and RPCs of this process.

    Without a schedule everything between enter and exit is one window; with one, `step()`
    moves through it and each finished window goes to `on_trace_ready(prof)`.
    """

    # The job profiler's subclass sets it: a user's own profiler may record while this one
    # does, and this one's windows get a copy of what the user's recorded (state.py).
    background = False

    def __init__(
        self,
        *,
        activities: Optional[Iterable[Any]] = None,
        schedule: Optional[Callable[[int], ProfilerAction]] = None,
        on_trace_ready: Optional[Callable[["profile"], Any]] = None,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
    ) -> None:
        self.activities = _check_activities(activities)
        self.schedule = schedule or _always_record
        # torch marks steps (ProfilerStep#N ranges) only under a schedule
        self.record_steps = schedule is not None
        self.on_trace_ready = on_trace_ready
        self.record_shapes = record_shapes
        self.profile_memory = profile_memory
        self.with_stack = with_stack
        self.step_num = 0
        self.window_start_step = 0
        self.current_action = ProfilerAction.NONE
        self._rec: Optional[Recorder] = None
        self._finished: Optional[Recorder] = None
        self._step_t0: Optional[int] = None
        self._step_id = 0
        self._running = False
        self._metadata: dict[str, Any] = {}

    # ---- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "profile":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Begin at step 0 of the schedule."""
        self._running = True
        self.current_action = self._action(self.step_num)
        if self.current_action in _RECORDING:
            self._begin()

    def stop(self) -> None:
        """End the profile; a window still recording is finished and handed on."""
        if not self._running:
            return
        self._running = False
        if self._rec is not None:
            self._end(last_step=self.step_num)

    def step(self) -> None:
        """Mark the end of a training step: move to the schedule's next action."""
        prev = self.current_action
        self.step_num += 1
        cur = self._action(self.step_num)
        self.current_action = cur
        if self._rec is not None:
            self._close_step()
            if prev is ProfilerAction.RECORD_AND_SAVE or cur not in _RECORDING:
                self._end(last_step=self.step_num - 1)
        if cur in _RECORDING and self._rec is None and self._running:
            self._begin()
        elif self._rec is not None:
            self._open_step()

    def _action(self, step: int) -> ProfilerAction:
        action = self.schedule(step)
        if not isinstance(action, ProfilerAction):
            raise ProfilerError(
                f"profile(): the schedule returned {action!r} for step {step}; allowed: "
                + ", ".join(f"ProfilerAction.{a.name}" for a in ProfilerAction) + "."
            )
        return action

    def _begin(self) -> None:
        rec = Recorder(self.record_shapes, self.profile_memory, self.with_stack,
                       cuda=ProfilerActivity.CUDA in self.activities)
        state.begin(rec, self.background)  # first: it refuses a second user profiler
        if rec.cuda and not cuda.available():
            logger.warning("ProfilerActivity.CUDA: no CUDA device through cupy here; profiling "
                           "the CPU only.")
            rec.cuda = False
        if rec.cuda:
            cuda.begin_window(rec)
        self._rec = rec
        rec.metadata.update(self._metadata)
        self.window_start_step = self.step_num
        instrument.install()
        if rec.profile_memory:
            instrument.watch_tensor_frees(rec)
        self._open_step()

    def _end(self, last_step: int) -> None:
        self._close_step()
        rec = self._rec
        overlap = state.end(rec)
        if rec.profile_memory:
            instrument.unwatch_tensor_frees(rec)
        instrument.uninstall()
        rec.close()
        if rec.cuda:
            cuda.resolve_window(rec)
        if overlap is not None:
            user, job = overlap
            job.absorb(user)
        self._rec = None
        self._finished = rec
        rec.window = (self.window_start_step, last_step)
        if self.on_trace_ready is not None:
            self.on_trace_ready(self)

    def _open_step(self) -> None:
        self._step_t0 = now_ns()
        self._step_id = self.step_num

    def _close_step(self) -> None:
        rec = self._rec
        if rec is not None and self._step_t0 is not None and self.record_steps:
            t1 = now_ns()
            rec.add(Event(f"ProfilerStep#{self._step_id}", "step",
                          self._step_t0, t1 - self._step_t0, threading.get_ident()))
        self._step_t0 = None

    def add_metadata(self, key: str, value: str) -> None:
        """A string under `key` at the top level of the trace file, as torch's."""
        self._set_metadata(key, str(value))

    def add_metadata_json(self, key: str, value: str) -> None:
        """A JSON document (given as text) under `key` at the top level of the trace file."""
        self._set_metadata(key, json.loads(value))

    def _set_metadata(self, key: str, value: Any) -> None:
        self._metadata[key] = value
        rec = self._rec or self._finished
        if rec is not None:
            rec.metadata[key] = value

    # ---- results ---------------------------------------------------------------------------
    def _window(self) -> Recorder:
        rec = self._finished or self._rec
        if rec is None:
            raise ProfilerError("profile(): nothing was recorded yet (no window has run).")
        return rec

    def events(self) -> EventList:
        """The last window's events."""
        return EventList(self._window())

    def key_averages(self, group_by_input_shape: bool = False,
                     group_by_stack_n: int = 0) -> Any:
        """Events grouped by name (and shapes, and top stack frames), torch's FunctionEventAvg."""
        return self.events().key_averages(group_by_input_shape, group_by_stack_n)

    def export_chrome_trace(self, path: str) -> None:
        """Write the last window as a Chrome/Perfetto trace-event JSON file."""
        export_chrome_trace(self._window(), path)

    @property
    def window(self) -> tuple:
        """(first step, last step) of the last window."""
        return getattr(self._window(), "window", (0, 0))


def supported_activities() -> set:
    """The activities this process can profile: CPU, and CUDA where cupy sees a device."""
    return {ProfilerActivity.CPU, ProfilerActivity.CUDA} if cuda.available() \
        else {ProfilerActivity.CPU}


def kineto_available() -> bool:
    """False: shoal records with its own profiler, not torch's Kineto library (profile()
    takes use_kineto all the same)."""
    return False


def rank_from_env() -> Optional[int]:
    """RANK as `shoal run` (and torchrun) set it, or None outside a job."""
    value = os.environ.get("RANK")
    return int(value) if value is not None and value.isdigit() else None
