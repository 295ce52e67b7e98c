"""What the profiler records: one event per op, backward node, collective, RPC or user range.

Times are `time.perf_counter_ns()` (CLOCK_MONOTONIC on Linux, the clock the op ledger's
`time.monotonic()` reads too), turned into wall-clock microseconds only on export so that
traces of different processes can be laid side by side.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional

# Wall clock minus the monotonic clock, read once: exported timestamps are Unix microseconds.
EPOCH_OFFSET_NS = time.time_ns() - time.perf_counter_ns()

now_ns = time.perf_counter_ns

# Frames under shoal/core (ops, nn, the profiler) are machinery, not the user's stack.
_CORE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Event:
    """One timed range (or, with dur 0 and kind 'mem', one allocation or free)."""

    __slots__ = ("name", "cat", "start", "dur", "tid", "args", "flow", "mem", "shapes", "stack",
                 "cuda")

    def __init__(
        self, name: str, cat: str, start: int, dur: int, tid: int,
        args: Optional[dict] = None, flow: int = 0, mem: int = 0,
        shapes: Optional[list] = None, stack: Optional[list] = None,
    ) -> None:
        self.name = name
        self.cat = cat
        self.start = start
        self.dur = dur
        self.tid = tid
        self.args = args
        self.flow = flow  # the autograd node's sequence number, linking forward and backward
        self.mem = mem  # bytes allocated (positive) or freed (negative) by this event itself
        self.shapes = shapes
        self.stack = stack
        self.cuda = 0  # nanoseconds on the GPU (ProfilerActivity.CUDA, ops on cupy arrays)

    @property
    def end(self) -> int:
        """Nanoseconds at the end of the range."""
        return self.start + self.dur

    def __repr__(self) -> str:
        return f"<Event {self.cat}:{self.name} {self.dur / 1e3:.1f}us>"


class Recorder:
    """Collects one profiling window's events from every thread (list.append is atomic)."""

    def __init__(
        self, record_shapes: bool = False, profile_memory: bool = False, with_stack: bool = False,
        cuda: bool = False,
    ) -> None:
        self.record_shapes = record_shapes
        self.profile_memory = profile_memory
        self.with_stack = with_stack
        self.cuda = cuda
        self.cuda_ref: Optional[tuple] = None  # (reference CUDA event, its CPU time)
        self.cuda_pending: list[tuple] = []  # (op event, start CUDA event, end CUDA event)
        self.events: list[Event] = []
        self.mem_events: list[Event] = []  # allocations (+) and frees (-), with timestamps
        self.thread_names: dict[int, str] = {}  # lanes that are not threads (an RPC callee)
        self.live: dict[int, int] = {}  # id of a profiled output tensor -> its bytes
        self.forward_flows: set[int] = set()  # node seqs a forward event has claimed
        self.pid = os.getpid()
        self.started_ns = now_ns()
        self.window = (0, 0)  # (first step, last step), set when the window ends
        self.lock = threading.Lock()

    def add(self, ev: Event) -> None:
        """Append a finished event."""
        self.events.append(ev)

    def add_range(
        self, name: str, cat: str, start_ns: int, end_ns: int, args: Optional[dict] = None
    ) -> Event:
        """Append a range measured by someone else (a collective, an RPC) on this thread."""
        ev = Event(name, cat, start_ns, max(0, end_ns - start_ns), threading.get_ident(), args)
        self.events.append(ev)
        return ev

    def memory(self, nbytes: int) -> None:
        """Record an allocation (positive) or a free (negative) happening now."""
        self.mem_events.append(Event("[memory]", "memory", now_ns(), 0, threading.get_ident(),
                                     mem=nbytes))


def shapes_of(args: tuple) -> list:
    """torch's "Input Shapes": a list per positional argument, [] for non-tensors."""
    out = []
    for a in args:
        shape = getattr(a, "shape", None)
        out.append(list(shape) if shape is not None and not isinstance(a, type) else [])
    return out


def user_stack(limit: int = 16) -> list:
    """The caller's stack, innermost first, without the profiler's and shoal.core's frames."""
    import sys  # noqa: PLC0415 - only with with_stack=True

    frames = []
    f: Any = sys._getframe(2)
    while f is not None and len(frames) < limit:
        fname = f.f_code.co_filename
        if not fname.startswith(_CORE_DIR):
            frames.append(f"{fname}({f.f_lineno}): {f.f_code.co_name}")
        f = f.f_back
    return frames
