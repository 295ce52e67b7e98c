"""Self times, memory attribution, key_averages and torch's table."""

from __future__ import annotations

from typing import Any, Optional

from shoal.core.profiler.chrome import export_chrome_trace
from shoal.core.profiler.events import Event, Recorder
from shoal.core.profiler.schedule import ProfilerError

# torch's sort keys (the CUDA ones read 0 unless ProfilerActivity.CUDA timed ops on a GPU).
SORT_KEYS = (
    "cpu_time", "cpu_time_total", "self_cpu_time_total", "cpu_memory_usage",
    "self_cpu_memory_usage", "count", "cuda_time", "cuda_time_total", "self_cuda_time_total",
    "cuda_memory_usage", "self_cuda_memory_usage",
)


class FunctionEvent:
    """One event with what analysis derives: self time (us) and memory with children."""

    __slots__ = ("ev", "self_ns", "self_mem", "total_mem", "self_cuda")

    def __init__(self, ev: Event) -> None:
        self.ev = ev
        self.self_ns = ev.dur
        self.self_cuda = ev.cuda
        self.self_mem = ev.mem
        self.total_mem = 0

    @property
    def name(self) -> str:
        """The event's name."""
        return self.ev.name

    key = name

    @property
    def cpu_time_total(self) -> float:
        """The event's duration (us), children included."""
        return self.ev.dur / 1e3

    cpu_time = cpu_time_total

    @property
    def self_cpu_time_total(self) -> float:
        """The event's duration (us) less its children's."""
        return self.self_ns / 1e3

    @property
    def cpu_memory_usage(self) -> int:
        """Bytes allocated by the event, children included."""
        return self.total_mem

    @property
    def self_cpu_memory_usage(self) -> int:
        """Bytes allocated by the event itself."""
        return self.self_mem

    @property
    def input_shapes(self) -> list:
        """The shapes of the op's arguments (record_shapes), else []."""
        return self.ev.shapes or []

    @property
    def stack(self) -> list:
        """The user's frames at the call (with_stack), innermost first."""
        return self.ev.stack or []

    @property
    def thread(self) -> int:
        """The recording thread's identifier."""
        return self.ev.tid

    @property
    def sequence_nr(self) -> int:
        """The autograd node's sequence number linking forward and backward (-1: none)."""
        return self.ev.flow - 1 if self.ev.flow else -1

    count = 1

    def __repr__(self) -> str:
        return (f"<FunctionEvent name={self.name} cpu_time={self.cpu_time_total:.3f}us "
                f"self_cpu_time={self.self_cpu_time_total:.3f}us>")


def resolve(rec: Recorder) -> list[FunctionEvent]:
    """Nest each thread's events to get self times; charge frees to the op running then."""
    by_tid: dict[int, list] = {}
    for ev in rec.events:
        by_tid.setdefault(ev.tid, []).append((ev.start, 0, -ev.dur, FunctionEvent(ev)))
    for m in rec.mem_events:
        by_tid.setdefault(m.tid, []).append((m.start, 1, 0, m))
    out: list[FunctionEvent] = []
    children: dict[int, list] = {}
    for items in by_tid.values():
        items.sort(key=lambda x: (x[0], x[1], x[2]))
        stack: list[FunctionEvent] = []
        for start, kind, _, item in items:
            # a free at an op's last instant still belongs to it; a new op there does not
            while stack and (stack[-1].ev.end < start
                             or (kind == 0 and stack[-1].ev.end <= start)):
                stack.pop()
            if kind == 1:  # a free: charged to the innermost op running when it happened
                # (an allocation's bytes are its op's own already: Event.mem)
                if stack and item.mem < 0:
                    stack[-1].self_mem += item.mem
                continue
            if stack:
                parent = stack[-1]
                parent.self_ns -= item.ev.dur
                parent.self_cuda -= item.ev.cuda
                children.setdefault(id(parent), []).append(item)
            stack.append(item)
            out.append(item)
    # inclusive memory: children start after their parent, so walk newest first
    for fe in reversed(out):
        fe.total_mem = fe.self_mem + sum(c.total_mem for c in children.get(id(fe), ()))
    return out


class FunctionEventAvg:
    """Events grouped under one key: torch's field names, times in microseconds."""

    def __init__(self, key: str, input_shapes: Optional[str], stack: Optional[list]) -> None:
        self.key = key
        self.input_shapes = input_shapes
        self.stack = stack or []
        self.count = 0
        self.cpu_time_total = 0.0
        self.self_cpu_time_total = 0.0
        self.cpu_memory_usage = 0
        self.self_cpu_memory_usage = 0
        self.cuda_time_total = 0.0
        self.self_cuda_time_total = 0.0
        self.cuda_memory_usage = 0
        self.self_cuda_memory_usage = 0

    def add(self, fe: FunctionEvent) -> None:
        """Fold one event in."""
        self.count += 1
        self.cpu_time_total += fe.ev.dur / 1e3
        self.self_cpu_time_total += fe.self_ns / 1e3
        self.cpu_memory_usage += fe.total_mem
        self.self_cpu_memory_usage += fe.self_mem
        self.cuda_time_total += fe.ev.cuda / 1e3
        self.self_cuda_time_total += fe.self_cuda / 1e3

    @property
    def cpu_time(self) -> float:
        """Average CPU time per call (us)."""
        return self.cpu_time_total / self.count if self.count else 0.0

    @property
    def cuda_time(self) -> float:
        """Average CUDA time per call (us)."""
        return self.cuda_time_total / self.count if self.count else 0.0

    def __repr__(self) -> str:
        return (f"<FunctionEventAvg key={self.key} count={self.count} "
                f"self_cpu_time_total={self.self_cpu_time_total:.3f}us>")


class EventList(list):
    """The window's events (FunctionEvent) with key_averages() and table()."""

    def __init__(self, rec: Recorder) -> None:
        rec.flush()
        super().__init__(resolve(rec))
        self.recorder = rec

    def key_averages(self, group_by_input_shape: bool = False,
                     group_by_stack_n: int = 0) -> "KeyAverages":
        """Group by name (and input shapes, and the top `group_by_stack_n` frames)."""
        groups: dict[tuple, FunctionEventAvg] = {}
        for fe in self:
            if fe.ev.cat == "kernel":  # its time is already its op's CUDA time
                continue
            shapes = str(fe.ev.shapes) if group_by_input_shape and fe.ev.shapes else None
            stack = tuple(fe.ev.stack[:group_by_stack_n]) if group_by_stack_n and fe.ev.stack \
                else ()
            k = (fe.ev.name, shapes, stack)
            g = groups.get(k)
            if g is None:
                g = groups[k] = FunctionEventAvg(fe.ev.name, shapes, list(stack))
            g.add(fe)
        return KeyAverages(groups.values(), self.recorder)

    def table(self, **kwargs: Any) -> str:
        """The ungrouped events as a table (key_averages().table is the usual view)."""
        return self.key_averages().table(**kwargs)

    @property
    def self_cpu_time_total(self) -> float:
        """The sum of the events' self CPU times (us)."""
        return sum(fe.self_ns for fe in self) / 1e3

    def total_average(self) -> "FunctionEventAvg":
        """Every event folded into one average keyed "Total", as torch's."""
        total = FunctionEventAvg("Total", None, None)
        for fe in self:
            total.add(fe)
        return total

    def export_chrome_trace(self, path: str) -> None:
        """Write the events as a Chrome/Perfetto trace-event JSON file."""
        export_chrome_trace(self.recorder, path)

    def peak_memory(self) -> int:
        """The most bytes live at once during the window (allocations minus frees)."""
        deltas = sorted([(m.start, m.mem) for m in self.recorder.mem_events])
        live = peak = 0
        for _, d in deltas:
            live += d
            peak = max(peak, live)
        return peak


_UNITS = {"s": 1e6, "ms": 1e3, "us": 1.0}


def _fmt_time(us: float, unit: Optional[str] = None) -> str:
    """torch's time cell: `unit` (s, ms, us) when given, else the largest that reads >= 1."""
    if unit in _UNITS:
        return f"{us / _UNITS[unit]:.3f}{unit}"
    if us >= 1e6:
        return f"{us / 1e6:.3f}s"
    if us >= 1e3:
        return f"{us / 1e3:.3f}ms"
    return f"{us:.3f}us"


def _fmt_mem(n: int) -> str:
    for unit, size in (("Gb", 1024 ** 3), ("Mb", 1024 ** 2), ("Kb", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} b"


class KeyAverages(list):
    """A list of FunctionEventAvg with torch's table()."""

    def __init__(self, groups: Any, rec: Recorder) -> None:
        super().__init__(groups)
        self.recorder = rec

    def table(self, sort_by: Optional[str] = None, row_limit: int = 100,
              max_src_column_width: int = 75, max_name_column_width: int = 55,
              max_shapes_column_width: int = 80, header: Optional[str] = None,
              top_level_events_only: bool = False, time_unit: Optional[str] = None) -> str:
        """torch's table: Name, Self CPU %, Self CPU, CPU total %, CPU total, CPU time avg,
        (CPU Mem, Self CPU Mem,) # of Calls, (Input Shapes, Source Location); every time in
        `time_unit` (s, ms or us) when given (another value: each time's own unit, as torch's)."""
        if sort_by is not None and sort_by not in SORT_KEYS:
            raise ProfilerError(
                f"table(): unknown sort_by {sort_by!r}; allowed: {', '.join(SORT_KEYS)}."
            )
        rows = list(self)
        if sort_by is not None:
            rows.sort(key=lambda r: getattr(r, sort_by), reverse=True)
        if row_limit is not None and row_limit > 0:
            rows = rows[:row_limit]
        total_self = sum(r.self_cpu_time_total for r in self) or 1.0
        mem = self.recorder.profile_memory
        shapes = any(r.input_shapes for r in rows)
        stacks = any(r.stack for r in rows)
        headers = ["Name", "Self CPU %", "Self CPU", "CPU total %", "CPU total", "CPU time avg"]
        gpu = self.recorder.cuda
        if gpu:
            headers += ["Self CUDA", "CUDA total", "CUDA time avg"]
        if mem:
            headers += ["CPU Mem", "Self CPU Mem"]
        headers += ["# of Calls"]
        if shapes:
            headers += ["Input Shapes"]
        if stacks:
            headers += ["Source Location"]
        lines = []
        for r in rows:
            cells = [
                r.key[:max_name_column_width],
                f"{100 * r.self_cpu_time_total / total_self:.2f}%",
                _fmt_time(r.self_cpu_time_total, time_unit),
                f"{100 * r.cpu_time_total / total_self:.2f}%",
                _fmt_time(r.cpu_time_total, time_unit),
                _fmt_time(r.cpu_time, time_unit),
            ]
            if gpu:
                cells += [_fmt_time(r.self_cuda_time_total, time_unit), _fmt_time(r.cuda_time_total, time_unit),
                          _fmt_time(r.cuda_time, time_unit)]
            if mem:
                cells += [_fmt_mem(r.cpu_memory_usage), _fmt_mem(r.self_cpu_memory_usage)]
            cells += [str(r.count)]
            if shapes:
                cells += [(r.input_shapes or "[]")[:max_shapes_column_width]]
            if stacks:
                cells += [r.stack[0][:max_src_column_width] if r.stack else ""]
            lines.append(cells)
        widths = [max(len(h), *(len(c[i]) for c in lines)) if lines else len(h)
                  for i, h in enumerate(headers)]
        sep = "  ".join("-" * w for w in widths)

        def fmt(cells: list) -> str:
            first = cells[0].ljust(widths[0])
            return "  ".join([first] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])])

        out = ["=" * len(sep), header] if header is not None else []
        out += [sep, fmt(headers), sep] + [fmt(c) for c in lines] + [sep]
        out.append(f"Self CPU time total: {_fmt_time(sum(r.self_cpu_time_total for r in self), time_unit)}")
        return "\n".join(out) + "\n"
