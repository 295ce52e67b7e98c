"""A window's events in Kineto's trace-event conventions, the ones torch's TensorBoard plugin,
Holistic Trace Analysis and Perfetto read: categories (`cpu_op`, `user_annotation`, `kernel`,
`cuda_runtime`), `External id`s, `fwdbwd` and `ac2g` flows, `[memory]` instants, collectives
named `gloo:<op>` / `nccl:<op>` with torch's collective arguments, and the OS's pids and thread
ids.

shoal's own categories stay inside the recorder (key_averages and the tests read them); only
the exported file speaks Kineto. Backends name their collectives after torch's analogue: the
nccl backend's are `nccl:<op>`, every other backend's (tcp, shoal's gloo-like one, and any
third-party one) `gloo:<op>`, since torch's plugin and HTA recognise only those two libraries.

Times: each event's `ts` and `dur` are microseconds from the file's `baseTimeNanoseconds`, as
Kineto writes them, so doubles keep nanoseconds exact (Unix microseconds would round to a
quarter of one, and children would stick out of their parents). Perfetto reads a fractional
`ts` as `int(ts * 1000)`; a quarter nanosecond is added before dividing so that truncation
(and rounding) land on the recorded nanosecond, keeping nested slices nested.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Optional

from shoal.core.profiler.cuda import CUDA_LANE
from shoal.core.profiler.events import Event, Recorder

# Kineto's `Input type` names (the plugin sizes communication from them) and c10's dtype names.
TORCH_TYPES = {
    "float32": ("float", "Float"), "float64": ("double", "Double"),
    "float16": ("c10::Half", "Half"), "bfloat16": ("c10::BFloat16", "BFloat16"),
    "int64": ("long int", "Long"), "int32": ("int", "Int"), "int16": ("short int", "Short"),
    "int8": ("signed char", "Char"), "uint8": ("unsigned char", "Byte"), "bool": ("bool", "Bool"),
    "complex64": ("c10::complex<float>", "ComplexFloat"),
    "complex128": ("c10::complex<double>", "ComplexDouble"),
}
# c10d's names for the `Collective name` argument.
C10D_NAMES = {"all_reduce": "allreduce", "monitored_barrier": "barrier"}
# Categories that are ranges a user or the framework marked, not ops: Kineto's user_annotation.
ANNOTATIONS = frozenset({"step", "optimizer", "user_annotation", "dataloader", "rpc",
                         "rpc_remote"})
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9, ]*)\]")
SYNTHETIC_TID = 1 << 30  # lanes of threads gone before the window ended: above any Linux tid


def library(backend: str) -> str:
    """The library prefix of a backend's collectives: `nccl` for nccl, else `gloo`."""
    return "nccl" if backend == "nccl" else "gloo"


class Lanes:
    """Thread idents -> the OS's thread ids, and each lane's name."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.tids: dict[int, int] = {}
        self.names: dict[int, str] = {}

    def tid(self, ident: int) -> int:
        """The lane of thread `ident`: its native id, or a synthetic one above any tid."""
        tid = self.tids.get(ident)
        if tid is None:
            known = self.rec.threads.get(ident)
            if known is not None and ident not in self.rec.thread_names:
                tid, name = known
                name = f"thread {tid} ({name})"
            else:
                tid = SYNTHETIC_TID + len([t for t in self.tids.values() if t >= SYNTHETIC_TID])
                name = self.rec.thread_names.get(ident, f"thread ident {ident}")
            self.tids[ident] = tid
            self.names[tid] = name
        return tid


def collective_args(args: dict, rank: Optional[int], world_size: int,
                    default_group: Optional[str] = None) -> dict:
    """torch's collective arguments (record_param_comms') from shoal's ledger arguments, which
    stay beside them: the call's dtype and element counts, the group's name, size and ranks."""
    op = str(args.get("op", ""))
    m = _ARRAY.search(str(args.get("call", "")))
    dtype, shape = (m.group(1), [int(x) for x in m.group(2).split(",") if x.strip()]) if m \
        else ("", [])
    ranks = list(args.get("group_ranks") or range(world_size))
    size = len(ranks) or 1
    n = math.prod(shape) if m else 0
    n_in, n_out = n, n
    if op in ("all_gather", "gather"):
        n_out = n * size
    elif op == "reduce_scatter":  # described by its output block: "float32[4] x size"
        n_in = n * size
    kineto_type, c10_type = TORCH_TYPES.get(dtype, (dtype, dtype))
    group = str(args.get("group", ""))
    out = {
        "Collective name": C10D_NAMES.get(op, op), "dtype": c10_type,
        "In msg nelems": n_in, "Out msg nelems": n_out, "Group size": size,
        "In split size": "[]", "Out split size": "[]",
        "Global rank start": ranks[0] if ranks else 0,
        "Global rank stride": (ranks[1] - ranks[0]) if len(ranks) > 1 else 1,
        "Process Group Name": group,
        "Process Group Description": "default_pg" if group == default_group else group,
        "Process Group Ranks": str(ranks), "Rank": rank if rank is not None else 0,
        "Seq": args.get("seq", 0),
    }
    if m:
        out["Input Dims"] = [shape]
        out["Input type"] = [kineto_type]
    out.update(args)
    return out


class Converter:
    """Builds one window's trace events; `us(ns)` and `dur(ns)` give the file's times."""

    def __init__(self, rec: Recorder, pid: int, rank: Optional[int], world_size: int,
                 us: Callable[[int], float], default_group: Optional[str] = None) -> None:
        self.rec, self.pid, self.rank, self.world_size, self.us = rec, pid, rank, world_size, us
        self.default_group = default_group
        self.lanes = Lanes(rec)
        self.out: list[dict] = []
        self.external = 0
        self.async_ids = 0
        self.devices: dict[int, set] = {}  # GPU pid (device) -> its stream lanes
        self.groups: dict[str, dict] = {}  # process groups the collectives ran in
        self.launches: dict[int, tuple[int, Event]] = {}  # correlation -> (External id, op)

    def dur(self, ns: int) -> float:
        """A duration in microseconds that Perfetto reads back as exactly `ns`."""
        return (ns + 0.25) / 1e3

    def _x(self, ev: Event, name: str, cat: str, args: dict, start: int = 0, dur: int = -1,
           tid: Optional[int] = None) -> dict:
        self.external += 1
        item = {"ph": "X", "cat": cat, "name": name, "pid": self.pid,
                "tid": self.lanes.tid(ev.tid) if tid is None else tid,
                "ts": self.us(start or ev.start), "dur": self.dur(ev.dur if dur < 0 else dur),
                "args": {"External id": self.external, **args}}
        self.out.append(item)
        return item

    def events(self, linked: set) -> list[dict]:
        """Every event of the window, sorted as Kineto writes them (start, longest first)."""
        evs = sorted(self.rec.events, key=lambda e: (e.start, -e.dur))
        converters = {"cpu_op": self._cpu_op, "backward": self._backward,
                      "collective": self._collective, "ddp": self._ddp}
        for ev in evs:
            if ev.cat == "kernel":
                continue  # after the launching ops, which give them their External ids
            converters.get(ev.cat, self._annotation)(ev, linked)
        for ev in evs:
            if ev.cat == "kernel":
                self._kernel(ev)
        return self.out

    def _op_args(self, ev: Event) -> dict:
        args: dict[str, Any] = dict(ev.args) if ev.args else {}
        if ev.shapes is not None:
            args["Input Dims"] = [list(s) for s in ev.shapes]
        if ev.stack:
            args["Call stack"] = ";".join(ev.stack)
        if ev.mem:
            args["Allocated Bytes"] = ev.mem
        if ev.flow:
            args["Sequence number"] = ev.flow - 1
        return args

    def _cpu_op(self, ev: Event, linked: set) -> None:
        args = self._op_args(ev)
        corr = args.pop("correlation", None)
        item = self._x(ev, ev.name, "cpu_op", args)
        if ev.flow in linked:
            self._flow("s", "fwdbwd", ev.flow, item)
        if corr is not None:
            self.launches[corr] = (item["args"]["External id"], ev)

    def _backward(self, ev: Event, linked: set) -> None:
        """torch's nesting: `autograd::engine::evaluate_function: XBackward0` around the node
        `XBackward0` itself (a nanosecond inside it at each end, so the two never tie)."""
        args = self._op_args(ev)
        corr = args.pop("correlation", None)
        outer = self._x(ev, f"autograd::engine::evaluate_function: {ev.name}", "cpu_op",
                        {k: v for k, v in args.items() if k == "Sequence number"})
        trim = 1 if ev.dur >= 3 else 0
        inner = self._x(ev, ev.name, "cpu_op", args, ev.start + trim, ev.dur - 2 * trim)
        if ev.flow in linked:
            self._flow("f", "fwdbwd", ev.flow, outer)
        if corr is not None:
            self.launches[corr] = (inner["args"]["External id"], ev)

    def _annotation(self, ev: Event, linked: set) -> None:
        del linked
        self._x(ev, ev.name, "user_annotation", self._op_args(ev))

    def _collective(self, ev: Event, linked: set) -> None:
        del linked
        args = dict(ev.args or {})
        group = str(args.get("group", ""))
        backend = str(args.get("backend", ""))
        ranks = list(args.get("group_ranks") or range(self.world_size))
        self.groups.setdefault(group, {"backend": backend, "ranks": ranks})
        name = f"{library(backend)}:{args.get('op', ev.name)}"
        self._x(ev, name, "user_annotation",
                collective_args(args, self.rank, self.world_size, self.default_group))

    def _ddp(self, ev: Event, linked: set) -> None:
        """A DDP bucket: an async range (its own track), since buckets overlap each other and
        the backward on one thread, which complete events may not."""
        del linked
        self.async_ids += 1
        tid = self.lanes.tid(ev.tid)
        common = {"cat": "ddp", "name": ev.name, "id": self.async_ids, "pid": self.pid,
                  "tid": tid}
        self.out.append({"ph": "b", **common, "ts": self.us(ev.start), "args": dict(ev.args or {})})
        self.out.append({"ph": "e", **common, "ts": self.us(ev.end)})

    def _kernel(self, ev: Event) -> None:
        """An op's GPU span on (device, stream), its launch on the op's thread, and the `ac2g`
        flow between them, all sharing the correlation id."""
        args = dict(ev.args or {})
        corr = args.get("correlation")
        device, stream = int(args.get("device", 0)), int(args.get("stream", 0))
        self.devices.setdefault(device, set()).add(stream)
        launch = self.launches.get(corr)
        external = launch[0] if launch else 0
        if launch is not None:
            op = launch[1]
            trim = 1 if op.dur >= 3 else 0
            rt = self._x(op, "cudaLaunchKernel", "cuda_runtime",
                         {"correlation": corr, "cbid": 211}, op.start + trim, op.dur - 2 * trim)
            rt["args"]["External id"] = external
            self._flow("s", "ac2g", corr, rt)
        self.external += 1
        item = {"ph": "X", "cat": "kernel", "name": ev.name, "pid": device, "tid": stream,
                "ts": self.us(ev.start), "dur": self.dur(ev.dur),
                "args": {"External id": external, "device": device, "stream": stream,
                         "correlation": corr, "context": 1}}
        self.out.append(item)
        if launch is not None:
            self._flow("f", "ac2g", corr, item)

    def _flow(self, ph: str, cat: str, flow_id: int, at: dict) -> None:
        item = {"ph": ph, "id": flow_id, "pid": at["pid"], "tid": at["tid"], "ts": at["ts"],
                "cat": cat, "name": cat}
        if ph == "f":
            item["bp"] = "e"
        self.out.append(item)

    def memory(self, gpu_addrs: dict) -> list[dict]:
        """torch's `[memory]` instants (Device Type 0 = CPU, 1 = CUDA; Addr the object's id)
        and a counter track per device of the bytes live."""
        out = []
        live: dict[tuple[int, int], int] = {}
        for m in sorted(self.rec.mem_events, key=lambda e: e.start):
            addr = int((m.args or {}).get("Addr", 0))
            device = gpu_addrs.get(addr)
            key = (0, -1) if device is None else (1, device)
            live[key] = live.get(key, 0) + m.mem
            ts = self.us(m.start)
            out.append({"ph": "i", "s": "t", "cat": "cpu_instant_event", "name": "[memory]",
                        "pid": self.pid, "tid": self.lanes.tid(m.tid), "ts": ts,
                        "args": {"Total Reserved": live[key], "Total Allocated": live[key],
                                 "Bytes": m.mem, "Device Id": key[1], "Device Type": key[0],
                                 "Addr": addr}})
            out.append({"ph": "C", "name": "Memory" if device is None else f"Memory GPU{device}",
                        "pid": self.pid, "tid": 0, "ts": ts,
                        "args": {"Total Allocated": live[key]}})
        return out


def lanes_metadata(conv: Converter, process_name: str, sort_index: int) -> list[dict]:
    """process_name/labels/sort_index of the rank's process and its GPUs, and each thread's
    name and sort index, as Kineto writes them."""
    pid = conv.pid
    out = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
            "args": {"name": process_name}},
           {"ph": "M", "name": "process_labels", "pid": pid, "tid": 0, "args": {"labels": "CPU"}},
           {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
            "args": {"sort_index": sort_index}}]
    for tid, name in sorted(conv.lanes.names.items()):
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                    "args": {"name": name}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                    "args": {"sort_index": tid}})
    for device, streams in sorted(conv.devices.items()):
        out.append({"ph": "M", "name": "process_name", "pid": device, "tid": 0,
                    "args": {"name": f"{process_name} GPU {device}"}})
        out.append({"ph": "M", "name": "process_labels", "pid": device, "tid": 0,
                    "args": {"labels": f"GPU {device}"}})
        for stream in sorted(streams):
            out.append({"ph": "M", "name": "thread_name", "pid": device, "tid": stream,
                        "args": {"name": f"stream {stream}"}})
    return out


__all__ = ["CUDA_LANE", "Converter", "Lanes", "collective_args", "lanes_metadata", "library"]
