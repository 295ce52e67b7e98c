"""`ShoalProcessGroup`: a `torch.distributed.ProcessGroup` whose collectives run on a shoal
tcp group (shared memory within a host, authenticated sockets across hosts).

Each method takes torch's C++-style arguments (lists of one tensor per device, an options
object), turns the tensors into arrays over the same memory (`convert`), and calls shoal's
group. A synchronous torch call (`opts.asyncOp` False) runs inline in the caller's thread, as
shoal's own synchronous calls do; an asynchronous one runs on the group's worker thread and
returns a `BridgeWork` whose Future DDP's comm hooks chain. shoal's op ledger, watchdog,
mismatch detection and metrics see every call.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd import profiler

from shoal.collectives.api import ProcessGroup as ShoalGroup
from shoal.collectives.types import CollectiveError
from shoal.torch_bridge import convert as cv
from shoal.torch_bridge.deferral import BackwardDeferral, in_autograd_node, spare_core_per_rank
from shoal.torch_bridge.work import (BridgeWork, in_callback_of, refuse_blocking_in_callback,
                                     timeout_seconds)

__all__ = ["ShoalProcessGroup"]


def _in_backward() -> bool:
    """True inside autograd's backward (DDP launches its bucket all_reduces from its hooks)."""
    return torch._C._current_graph_task_id() != -1  # noqa: SLF001 - torch's own query


def _inline(group, submit, timeout, result, epilogue) -> BridgeWork:
    """Run an async op at once in the caller's thread; its failure goes to the Work (DDP then
    raises it at the end of backward, as for an op that failed on the worker thread)."""
    try:
        submit(False, timeout)
        if epilogue is not None:
            epilogue()
    except CollectiveError as exc:
        return BridgeWork([], result, error=exc)
    return BridgeWork([], result, group=group)


def _start(pg: "ShoalProcessGroup", opts, submit, result, epilogue, op, how) -> BridgeWork:
    """Run or start one op as `how` says ("sync", "async", "inline" or "park")."""
    group, timeout = pg.shoal_group, cv.timeout_of(opts)
    if how == "inline":
        return _inline(group, submit, timeout, result, epilogue)
    if how == "park":
        return BridgeWork([pg.deferral.park(submit, timeout)], result, epilogue, group=group)
    if how == "async":
        return BridgeWork([submit(True, timeout)], result, epilogue, group=group)
    refuse_blocking_in_callback(group, op or "a synchronous collective")
    submit(False, timeout)
    if epilogue is not None:
        epilogue()
    return BridgeWork([], result)


def _profiled(pg, opts, submit, result, epilogue, op, how) -> BridgeWork:
    """`_start` inside a `shoal:<op>` span of torch.profiler: for an async op the span ends
    when its Future completes, so the trace shows the whole collective."""
    span = profiler.record_function(f"shoal:{op or 'collective'}")
    span.__enter__()
    if how in ("sync", "inline"):
        try:
            return _start(pg, opts, submit, result, epilogue, op, how)
        finally:
            span.__exit__(None, None, None)
    work = _start(pg, opts, submit, result, epilogue, op, how)
    work.wait_also_for(span._call_end_callbacks_on_future(work.get_future()))  # noqa: SLF001
    return work


class _NamedGroup(dist.ProcessGroup):
    """A torch ProcessGroup written in Python that keeps the name and description torch gives
    it: torch sets them after creating a group, and DeviceMesh reads `group_name`."""

    # A Python group registers no C++ backend, which is where torch would keep the names.
    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's C++ method name
        """Set the name torch knows this group by (`group_name`)."""
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802 - torch's C++ method name
        """The name torch knows this group by."""
        return getattr(self, "_group_name", "")

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 - torch's C++ method name
        """Set torch's description of this group (`group_desc`)."""
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802 - torch's C++ method name
        """torch's description of this group."""
        return getattr(self, "_group_desc", "")


class ShoalProcessGroup(_NamedGroup):
    """torch's process group over `shoal_group` (see the module's doc).

    Where a bucket's all_reduce runs when DDP starts it inside backward:
    `defer_in_backward` (None, the default: True where this process has fewer than two cores
    per rank of the group on its host) parks it until backward ends and then runs the parked
    ones back to back in backward's thread (`torch_bridge.deferral`): without a core to spare,
    the group's worker thread would only take turns with backward. False hands it to the
    worker thread at once, to overlap backward. `inline_in_backward` (default False) runs it
    at once in backward's thread: no hand-off, but a rank waits there for a late peer.
    """

    def __init__(self, shoal_group: ShoalGroup):
        super().__init__(shoal_group.rank(), shoal_group.size())
        self.shoal_group = shoal_group
        self.inline_in_backward = False
        self.defer_in_backward: Optional[bool] = None
        self.deferral = BackwardDeferral(shoal_group.name)
        self._no_spare_core: Optional[bool] = None

    def getBackendName(self) -> str:  # noqa: N802 - torch's C++ method name
        """The backend's name as torch reports it."""
        return "shoal"

    def __repr__(self) -> str:
        g = self.shoal_group
        return f"ShoalProcessGroup(rank={g.rank()}, size={g.size()}, group={g.name!r})"

    def _defers(self) -> bool:
        """`defer_in_backward`, or where it is None, whether the host lacks a core per rank
        for the worker thread (decided once: the affinity and the topology do not change)."""
        if self.defer_in_backward is not None:
            return self.defer_in_backward
        if self._no_spare_core is None:
            g = self.shoal_group
            topology = getattr(g, "topology", None)
            local = len(topology.local_ranks(g.rank())) if topology is not None else g.size()
            self._no_spare_core = not spare_core_per_rank(local)
        return self._no_spare_core

    def _how(self, asynchronous: bool, in_backward_ok: bool) -> str:
        """"sync", "async" (the worker thread), "inline" or "park" (see the class's doc)."""
        if not asynchronous:
            return "sync"
        # Never inline or park in a callback of this group's own Future: that runs on its
        # worker thread, or inside a flush, whose caller may be about to wait for it.
        if not in_backward_ok or not _in_backward() or in_callback_of(self.shoal_group):
            return "async"
        if self.inline_in_backward:
            return "inline"
        return "park" if self._defers() and in_autograd_node() else "async"

    def _settle(self) -> None:
        """Submit the parked ops before any other op, so the group sees this rank's ops in the
        order they were issued, as on a rank that parks nothing."""
        if self.deferral.has_pending:
            self.deferral.flush(to_worker=in_callback_of(self.shoal_group))

    def _run(self, opts: Any, submit: Callable[[bool, Optional[float]], Any], result: list,
             epilogue: Optional[Callable[[], None]] = None, op: str = "",
             inline_ok: bool = False) -> BridgeWork:
        """Run `submit(async_op, timeout)` (one shoal collective) and wrap its Work;
        `inline_ok`: an async op may run inline or be parked inside backward."""
        how = self._how(cv.is_async(opts), inline_ok)
        if how != "park":
            self._settle()
        if profiler._is_profiler_enabled:  # noqa: SLF001 - torch's own flag, read per call
            return _profiled(self, opts, submit, result, epilogue, op, how)
        return _start(self, opts, submit, result, epilogue, op, how)

    # -- all_reduce

    def allreduce(self, tensors: Sequence, opts: Any = None) -> BridgeWork:
        """All-reduce `tensors[0]` in place (several tensors: coalesced)."""
        if len(tensors) != 1:
            return self.allreduce_coalesced(tensors, opts)
        arr = cv.host_array(tensors[0], "all_reduce tensor")
        op = cv.reduce_op(opts)
        return self._run(opts, lambda a, t: self.shoal_group.all_reduce(
            arr, op, async_op=a, timeout=t), list(tensors), op="all_reduce", inline_ok=True)

    def allreduce_coalesced(self, tensors: Sequence, opts: Any = None) -> BridgeWork:
        """All-reduce every tensor in place through one flat buffer per dtype."""
        self._settle()
        arrs = cv.host_arrays(tensors, "all_reduce_coalesced tensors")
        op = cv.reduce_op(opts)
        groups: dict[Any, list] = {}
        for a in arrs:
            groups.setdefault(a.dtype, []).append(a)
        flats = [(np.concatenate([a.reshape(-1) for a in members]), members)
                 for members in groups.values()]
        works = [self.shoal_group.all_reduce(flat, op, async_op=True, timeout=cv.timeout_of(opts))
                 for flat, _ in flats]

        def scatter_back() -> None:
            for flat, members in flats:
                start = 0
                for a in members:
                    a.reshape(-1)[...] = flat[start:start + a.size]
                    start += a.size
        return BridgeWork(works, list(tensors), scatter_back, group=self.shoal_group)

    # -- one root

    def broadcast(self, tensors: Sequence, opts: Any = None) -> BridgeWork:
        """Copy the root's `tensors[0]` into every rank's."""
        arr = cv.host_array(cv.one(tensors, "broadcast"), "broadcast tensor")
        src = cv.root_of(opts)
        return self._run(opts, lambda a, t: self.shoal_group.broadcast(
            arr, src, async_op=a, timeout=t), list(tensors), op="broadcast")

    def reduce(self, tensors: Sequence, opts: Any = None) -> BridgeWork:
        """Reduce every rank's `tensors[0]` into the root's."""
        arr = cv.host_array(cv.one(tensors, "reduce"), "reduce tensor")
        dst, op = cv.root_of(opts), cv.reduce_op(opts)
        return self._run(opts, lambda a, t: self.shoal_group.reduce(
            arr, dst, op, async_op=a, timeout=t), list(tensors), op="reduce")

    def gather(self, output_lists: Sequence, inputs: Sequence, opts: Any = None) -> BridgeWork:
        """Collect every rank's `inputs[0]` into the root's `output_lists[0]`."""
        arr = cv.host_array(cv.one(inputs, "gather"), "gather tensor")
        dst = cv.root_of(opts)
        outs = None
        if self.shoal_group.rank() == dst:
            outs = cv.host_arrays(cv.one(output_lists, "gather"), "gather gather_list")
        return self._run(opts, lambda a, t: self.shoal_group.gather(
            arr, outs, dst, async_op=a, timeout=t), list(output_lists), op="gather")

    def scatter(self, outputs: Sequence, input_lists: Sequence, opts: Any = None) -> BridgeWork:
        """The root sends `input_lists[0][j]` to rank j's `outputs[0]`."""
        out = cv.host_array(cv.one(outputs, "scatter"), "scatter tensor")
        src = cv.root_of(opts)
        ins = None
        if self.shoal_group.rank() == src:
            ins = cv.host_arrays(cv.one(input_lists, "scatter"), "scatter scatter_list")
        return self._run(opts, lambda a, t: self.shoal_group.scatter(
            out, ins, src, async_op=a, timeout=t), list(outputs), op="scatter")

    # -- gathers

    def allgather(self, output_lists: Sequence, inputs: Sequence, opts: Any = None) -> BridgeWork:
        """Fill `output_lists[0][j]` with rank j's `inputs[0]`."""
        arr = cv.host_array(cv.one(inputs, "allgather"), "all_gather tensor")
        outs = cv.host_arrays(cv.one(output_lists, "allgather"), "all_gather tensor_list")
        return self._run(opts, lambda a, t: self.shoal_group.all_gather(
            outs, arr, async_op=a, timeout=t), list(output_lists), op="all_gather")

    def all_gather_single(self, output: Any, input: Any,  # noqa: A002 - torch's name
                          opts: Any = None) -> BridgeWork:
        """Every rank's `input`, end to end, into `output` (all_gather_into_tensor)."""
        out = cv.host_array(output, "all_gather_into_tensor output")
        arr = cv.host_array(input, "all_gather_into_tensor input")
        return self._run(opts, lambda a, t: self.shoal_group.all_gather_into_tensor(
            out, arr, async_op=a, timeout=t), [output], op="all_gather_into_tensor")

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists: Sequence, inputs: Sequence,
                            opts: Any = None) -> BridgeWork:
        """`output_lists[r][i]` := rank r's `inputs[i]`."""
        self._settle()
        self.shoal_group.all_gather_coalesced(
            [cv.host_arrays(row, "allgather_coalesced output") for row in output_lists],
            cv.host_arrays(inputs, "allgather_coalesced input"), timeout=cv.timeout_of(opts))
        return BridgeWork([], list(output_lists))

    def all_gather_single_coalesced(self, outputs: Sequence, inputs: Sequence,
                                    opts: Any = None) -> BridgeWork:
        """One all_gather_into_tensor per (output, input) pair, as one handle."""
        self._settle()
        works = [self.shoal_group.all_gather_into_tensor(
            cv.host_array(o, "output"), cv.host_array(i, "input"), async_op=True,
            timeout=cv.timeout_of(opts)) for o, i in zip(outputs, inputs)]
        return BridgeWork(works, list(outputs), group=self.shoal_group)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # -- reduce_scatter and all_to_all

    def reduce_scatter(self, outputs: Sequence, input_lists: Sequence,
                       opts: Any = None) -> BridgeWork:
        """Reduce `input_lists[0][j]` across ranks into rank j's `outputs[0]`."""
        out = cv.host_array(cv.one(outputs, "reduce_scatter"), "reduce_scatter output")
        ins = cv.host_arrays(cv.one(input_lists, "reduce_scatter"), "reduce_scatter input_list")
        op = cv.reduce_op(opts)
        return self._run(opts, lambda a, t: self.shoal_group.reduce_scatter(
            out, ins, op, async_op=a, timeout=t), list(outputs), op="reduce_scatter")

    def reduce_scatter_single(self, output: Any, input: Any,  # noqa: A002 - torch's name
                              opts: Any = None) -> BridgeWork:
        """This rank's block of the reduction of every rank's `input` (reduce_scatter_tensor)."""
        out = cv.host_array(output, "reduce_scatter_tensor output")
        arr = cv.host_array(input, "reduce_scatter_tensor input")
        op = cv.reduce_op(opts)
        return self._run(opts, lambda a, t: self.shoal_group.reduce_scatter_tensor(
            out, arr, op, async_op=a, timeout=t), [output], op="reduce_scatter_tensor")

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: Sequence, inputs: Sequence,
                                        opts: Any = None) -> BridgeWork:
        """One reduce_scatter_tensor per (output, input) pair, as one handle."""
        self._settle()
        op = cv.reduce_op(opts)
        works = [self.shoal_group.reduce_scatter_tensor(
            cv.host_array(o, "output"), cv.host_array(i, "input"), op, async_op=True,
            timeout=cv.timeout_of(opts)) for o, i in zip(outputs, inputs)]
        return BridgeWork(works, list(outputs), group=self.shoal_group)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(self, outputs: Sequence, inputs: Sequence, opts: Any = None) -> BridgeWork:
        """Send `inputs[j]` to rank j, which receives it in its `outputs[i]`."""
        outs = cv.host_arrays(outputs, "all_to_all output_list")
        ins = cv.host_arrays(inputs, "all_to_all input_list")
        return self._run(opts, lambda a, t: self.shoal_group.all_to_all(
            outs, ins, async_op=a, timeout=t), list(outputs), op="all_to_all")

    def all_to_all_single(self, output: Any, input: Any,  # noqa: A002 - torch's name
                          output_split_sizes: Sequence[int], input_split_sizes: Sequence[int],
                          opts: Any = None) -> BridgeWork:
        """Rows of `input` to every rank, by split sizes (equal when empty)."""
        out = cv.host_array(output, "all_to_all_single output")
        arr = cv.host_array(input, "all_to_all_single input")
        outs, ins = list(output_split_sizes) or None, list(input_split_sizes) or None
        return self._run(opts, lambda a, t: self.shoal_group.all_to_all_single(
            out, arr, outs, ins, async_op=a, timeout=t), [output], op="all_to_all_single")

    alltoall_base = all_to_all_single

    # -- point to point and barriers

    def send(self, tensors: Sequence, dst: int, tag: int) -> BridgeWork:
        """Send `tensors[0]` to group rank `dst`."""
        self._settle()
        arr = cv.host_array(cv.one(tensors, "send"), "send tensor")
        return BridgeWork([self.shoal_group.send(arr, dst, tag, async_op=True)], list(tensors),
                          group=self.shoal_group)

    def recv(self, tensors: Sequence, src: int, tag: int) -> BridgeWork:
        """Receive into `tensors[0]` from group rank `src`."""
        self._settle()
        arr = cv.host_array(cv.one(tensors, "recv"), "recv tensor")
        return BridgeWork([self.shoal_group.recv(arr, src, tag, async_op=True)], list(tensors),
                          group=self.shoal_group)

    def recv_anysource(self, tensors: Sequence, tag: int) -> BridgeWork:
        """Receive into `tensors[0]` from whichever rank sends first."""
        self._settle()
        arr = cv.host_array(cv.one(tensors, "recv"), "recv tensor")
        work = self.shoal_group.recv(arr, None, tag, async_op=True)
        return BridgeWork([work], list(tensors), source_rank=lambda: work.source_rank,
                          group=self.shoal_group)

    def barrier(self, opts: Any = None) -> BridgeWork:
        """Return once every rank of the group called barrier."""
        return self._run(opts, lambda a, t: self.shoal_group.barrier(async_op=a, timeout=t), [], op="barrier")

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """A barrier whose rank 0 names the ranks that did not arrive within `timeout`."""
        self._settle()
        self.shoal_group.monitored_barrier(timeout_seconds(timeout), wait_all_ranks)

    # -- lifecycle

    def abort(self) -> None:
        """Fail every pending and later collective of this group on every rank."""
        self.shoal_group.abort()
        self.deferral.stop()  # the parked ops fail as the group's others do

    def shutdown(self) -> None:
        """Leave the group: release its connections and threads."""
        self.deferral.stop()
        self.shoal_group.shutdown()
