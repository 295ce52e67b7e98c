"""What the profiler records: one event per op, backward node, collective, RPC or user range.

Times are `time.perf_counter_ns()` (CLOCK_MONOTONIC on Linux, the clock the op ledger's
`time.monotonic()` reads too), turned into wall-clock microseconds only on export so that
traces of different processes can be laid side by side.
"""

from __future__ import annotations

import os
import sys
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
        # (op event, start CUDA event, end CUDA event, device, stream pointer)
        self.cuda_pending: list[tuple] = []
        self.correlations = 0  # the last correlation id linking an op to its kernel event
        self.events: list[Event] = []
        # allocations (+) and frees (-), with timestamps; args["Addr"]: the object's id
        self.mem_events: list[Event] = []
        self.thread_names: dict[int, str] = {}  # lanes that are not threads (an RPC callee)
        # thread ident -> (native thread id, name): events hold the cheap ident, the trace the
        # OS's id; read when the window starts and ends (threads that lived only in between
        # get a lane of their own, named by their ident)
        self.threads: dict[int, tuple[int, str]] = {}
        self.note_threads()
        self.live: dict[int, tuple] = {}  # id of a weakref -> (weakref, bytes, id of object)
        self.counted: set[int] = set()  # ids of the live arrays whose bytes were counted
        self.live_tensors: dict[int, int] = {}  # id of a live counted tensor -> its bytes
        self.gpu_addrs: dict[int, int] = {}  # Addr (an object's id) -> its GPU, for cupy arrays
        self.mem_raw: list[tuple] = []  # (time, +-bytes, tid, address) of allocations and frees
        self.free_callback = self._make_free_callback()  # one callback for every weak reference
        self.detailed_raw: list = []  # the detailed path's tuples (or Events, with CUDA)
        self.raw: list[tuple] = []  # (name, cat, start, dur, tid, flow) from the lean path
        self.closed = False  # set when the window ends: later frees are not this window's
        self.forward_flows: set[int] = set()  # node seqs a forward event has claimed
        self.pid = os.getpid()
        self.started_ns = now_ns()
        self.window = (0, 0)  # (first step, last step), set when the window ends
        self.metadata: dict[str, Any] = {}  # add_metadata's keys, top-level in the trace file

    @property
    def detailed(self) -> bool:
        """True when each op needs more than its name and times (the lean path is off)."""
        return self.record_shapes or self.profile_memory or self.with_stack or self.cuda

    def _make_free_callback(self) -> Any:
        # A closure over bound methods: it runs once per freed tensor while profiling memory.
        pop, discard, append = self.live.pop, self.counted.discard, self.mem_raw.append
        get_ident = threading.get_ident

        def freed(ref: Any) -> None:
            # after close() `live` is empty: nothing is recorded for a finished window
            entry = pop(id(ref), None)
            if entry is not None:
                discard(entry[2])
                append((now_ns(), -entry[1], get_ident(), entry[2]))

        return freed

    def note_threads(self) -> None:
        """Remember every live thread's native id and name (at the window's start and end)."""
        for t in threading.enumerate():
            if t.ident is not None and t.native_id is not None:
                self.threads[t.ident] = (t.native_id, t.name)

    def close(self) -> None:
        """End the window: later frees are not its own, so drop the weak references (their
        callbacks would keep firing for the window's surviving tensors) and turn the tuples
        into Events."""
        self.closed = True
        self.note_threads()
        self.live.clear()
        self.counted.clear()
        self.live_tensors.clear()
        self.free_callback = None
        self.flush()

    def flush(self) -> None:
        """Turn the lean path's tuples into Events (called when the window ends)."""
        n = len(self.raw)
        raw = self.raw[:n]
        del self.raw[:n]
        claimed = self.forward_flows
        events = self.events
        for name, cat, t0, dur, tid, flow in raw:
            if flow and cat == "cpu_op":
                # tuples are appended as ops finish, so the innermost op that made a tensor
                # comes first and claims its autograd node
                if flow in claimed:
                    flow = 0
                else:
                    claimed.add(flow)
            events.append(Event(name, cat, t0, dur, tid, flow=flow))
        n = len(self.detailed_raw)
        draw = self.detailed_raw[:n]
        del self.detailed_raw[:n]
        for item in draw:
            if item.__class__ is Event:  # kept as an Event for its CUDA times
                ev = item
            else:
                name, cat, t0, dur, tid, flow, mem, shapes, stack = item
                ev = Event(name, cat, t0, dur, tid, mem=mem, stack=stack,
                           shapes=None if shapes is None else [list(x) for x in shapes])
                ev.flow = flow
            if ev.flow and ev.cat == "cpu_op":
                if ev.flow in claimed:
                    ev.flow = 0
                else:
                    claimed.add(ev.flow)
            events.append(ev)
        n = len(self.mem_raw)
        mem = self.mem_raw[:n]
        del self.mem_raw[:n]
        for t, nbytes, tid, addr in mem:
            self.mem_events.append(Event("[memory]", "memory", t, 0, tid, {"Addr": addr},
                                         mem=nbytes))

    def absorb(self, other: "Recorder") -> None:
        """Add what `other`, a user's window that recorded over this one (the job profiler's),
        recorded since this window began: its events but its steps, and its allocations and
        frees when this window profiles memory."""
        other.flush()
        since = self.started_ns
        # not its ProfilerStep ranges: this window's steps are its own (the job's count)
        self.events.extend([ev for ev in list(other.events)
                            if ev.start >= since and ev.cat != "step"])
        if self.profile_memory:
            self.mem_events.extend([m for m in list(other.mem_events) if m.start >= since])
        self.thread_names.update(other.thread_names)
        self.threads.update(other.threads)

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



def user_stack(limit: int = 16) -> list:
    """The caller's stack, innermost first, without the profiler's and shoal.core's frames."""
    frames = []
    # CPython's frame walk; inspect.stack() would read every frame's source lines, per op.
    f: Any = sys._getframe(2)  # noqa: SLF001
    while f is not None and len(frames) < limit:
        fname = f.f_code.co_filename
        if not fname.startswith(_CORE_DIR):
            frames.append(f"{fname}({f.f_lineno}): {f.f_code.co_name}")
        f = f.f_back
    return frames
