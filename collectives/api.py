"""The process-group seam: `ProcessGroup` and its `Work` handles.

Public methods validate and unwrap their arguments (`collectives.arrays`) and hand them to the
private `_` hooks each backend (tcp, nccl) implements.
"""

from __future__ import annotations

import abc
import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np

from shoal.collectives import arrays
from shoal.collectives.composite import CompositeCollectives
from shoal.collectives.futures import Future, work_future
from shoal.collectives.types import (DEFAULT_COLLECTIVE_TIMEOUT_S, CollectiveTimeout, PremulSum,
                                     ReduceOp)
from shoal.core.errors import ShapeError
from shoal.core.timeouts import TimeoutLike, to_seconds


# ----------------------------------------------------------------------------- Work

class Work(abc.ABC):
    """The handle of one collective; `async_op=True` hands it to the caller, as torch does."""

    @abc.abstractmethod
    def wait(self, timeout: TimeoutLike = None) -> bool:
        """Block until the collective finished; True on success.

        Raises:
            CollectiveError: the collective failed (the subclass says why).
            CollectiveTimeout: it did not finish within `timeout` (it keeps running).
        """

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True once the collective finished, successfully or not."""

    @abc.abstractmethod
    def is_success(self) -> bool:
        """True once the collective finished without an error."""

    @abc.abstractmethod
    def exception(self) -> Optional[BaseException]:
        """The error it failed with, or None."""

    @abc.abstractmethod
    def result(self) -> list:
        """The output arrays (after waiting)."""

    @abc.abstractmethod
    def add_done_callback(self, fn: Callable[["Work"], Any]) -> None:
        """Call `fn(work)` once it finishes (at once if it already has), in the finishing thread."""

    def get_future(self) -> Future:
        """A Future completed with `result()` (the output tensors) once this work finishes, or
        with its error, as torch's Work.get_future()."""
        return work_future(self)

    def _source_rank(self) -> int:
        """For a recv from any source: the group rank the message came from (torch's name)."""
        source = getattr(self, "source_rank", None)
        if source is None:
            raise ValueError("_source_rank() is only defined for a completed recv.")
        return source

    def synchronize(self) -> None:
        """torch's Work.synchronize(): on the host, the same as wait()."""
        self.wait()


class CompletedWork(Work):
    """A Work that finished before it was handed out (what composite calls return, and the
    tcp backend's handle of an operation it ran inline)."""

    __slots__ = ("_result", "source_rank")

    def __init__(self, result: list, source_rank: Optional[int] = None):
        self._result = result
        self.source_rank = source_rank

    def wait(self, timeout: TimeoutLike = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> Optional[BaseException]:
        return None

    def result(self) -> list:
        return self._result

    def add_done_callback(self, fn: Callable[["Work"], Any]) -> None:
        fn(self)


class PendingWork(Work):
    """A Work another thread finishes once (`finish`): its wait with a timeout, its state and
    its done-callbacks. A subclass says what a wait that ran out of time was waiting for
    (`_timeout_message`)."""

    __slots__ = ("_event", "_done", "_exc", "_result", "_callbacks", "_lock")

    def __init__(self):
        self._event = threading.Event()
        self._done = False
        self._exc: Optional[BaseException] = None
        self._result: list = []
        self._callbacks: list = []
        self._lock = threading.Lock()

    def _timeout_message(self, seconds: float) -> str:
        return (f"An operation did not complete within the {seconds:g}s that wait() allowed; "
                "it is still running.")

    def finish(self, result: Optional[list], exc: Optional[BaseException]) -> None:
        """Complete the handle (called once) and run the callbacks, in this thread."""
        with self._lock:
            self._result = result if result is not None else []
            self._exc = exc
            self._done = True
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def wait(self, timeout: TimeoutLike = None) -> bool:
        seconds = to_seconds(timeout)
        if not self._done and not self._event.wait(seconds):
            raise CollectiveTimeout(self._timeout_message(seconds))
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done and self._exc is None

    def exception(self) -> Optional[BaseException]:
        return self._exc

    def result(self) -> list:
        self.wait()
        return self._result

    def add_done_callback(self, fn: Callable[["Work"], Any]) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(fn)
                return
        fn(self)


# ----------------------------------------------------------------------------- ProcessGroup

def _rank_arg(value: Any, size: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
        raise ValueError(f"{what} must be a rank in 0..{size - 1} of this group, got {value!r}.")
    return value


class ProcessGroup(CompositeCollectives, abc.ABC):
    """A set of ranks that run collectives together; ranks here are the group's own (0..size-1).

    Public methods validate and unwrap their arguments (numpy arrays, cupy arrays or
    `core.Tensor`s, used in place) and hand them to the backend's private `_` hooks. Every
    collective takes `async_op` and `timeout` (seconds or timedelta; default: the group's) and
    returns a `Work`, already completed when `async_op` is False.
    """

    backend_name = "?"

    def __init__(self, rank: int, size: int, name: str, timeout: TimeoutLike):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"A process group's size must be a positive int, got {size!r}.")
        _rank_arg(rank, size, "rank")
        self._rank = rank
        self._size = size
        self._name = name
        self._timeout = to_seconds(timeout, DEFAULT_COLLECTIVE_TIMEOUT_S)

    # -- identity and settings

    def rank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    def size(self) -> int:
        """Number of ranks in the group."""
        return self._size

    @property
    def name(self) -> str:
        """The group's name ("default" for the world)."""
        return self._name

    @property
    def timeout(self) -> float:
        """Default timeout of this group's collectives, in seconds."""
        return self._timeout

    def set_timeout(self, timeout: TimeoutLike) -> None:
        """Change the default timeout of later collectives."""
        self._timeout = to_seconds(timeout, DEFAULT_COLLECTIVE_TIMEOUT_S)

    @staticmethod
    def _completed_work(result: list) -> Work:
        return CompletedWork(result)

    def _t(self, timeout: TimeoutLike) -> float:
        seconds = to_seconds(timeout)
        return self._timeout if seconds is None else seconds

    # -- collectives

    def all_reduce(self, tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False,
                   timeout: TimeoutLike = None) -> Work:
        """Reduce `tensor` across ranks, leaving the result in every rank's `tensor`."""
        arr = arrays.unwrap(tensor, "all_reduce tensor")
        if type(op) is not ReduceOp:
            if isinstance(op, PremulSum):
                arrays.premul(arr, op.factor, copy=False)  # then a SUM, in place as torch's
                op = ReduceOp.SUM
            op = arrays.reduce_op(op)
        if op is not ReduceOp.SUM:
            arrays.check_reducible(op, arr.dtype)
        return self._all_reduce(tensor, arr, op, async_op, self._t(timeout))

    def broadcast(self, tensor, src: int = 0, async_op: bool = False,
                  timeout: TimeoutLike = None) -> Work:
        """Copy rank `src`'s `tensor` into every rank's `tensor`.

        torch's `pg.broadcast([t], BroadcastOptions)` form is accepted too (async).
        """
        if isinstance(tensor, (list, tuple)):
            return self._torch_broadcast(tensor, src)
        arr = arrays.unwrap(tensor, "broadcast tensor")
        _rank_arg(src, self._size, "broadcast src")
        return self._broadcast(tensor, arr, src, async_op, self._t(timeout))

    def reduce(self, tensor, dst: int = 0, op: ReduceOp = ReduceOp.SUM, async_op: bool = False,
               timeout: TimeoutLike = None) -> Work:
        """Reduce `tensor` across ranks into rank `dst`'s `tensor` (others keep theirs).

        torch's `pg.reduce([t], ReduceOptions)` form is accepted too (async).
        """
        if isinstance(tensor, (list, tuple)):
            return self._torch_reduce(tensor, dst)
        arr = arrays.unwrap(tensor, "reduce tensor")
        if isinstance(op, PremulSum):
            # dst scales its own tensor; the others send a scaled copy and keep theirs
            scaled = arrays.premul(arr, op.factor, copy=self._rank != dst)
            tensor, arr, op = (tensor if scaled is arr else scaled), scaled, ReduceOp.SUM
        op = arrays.reduce_op(op)
        arrays.check_reducible(op, arr.dtype)
        _rank_arg(dst, self._size, "reduce dst")
        return self._reduce(tensor, arr, dst, op, async_op, self._t(timeout))

    def all_gather(self, tensor_list: Sequence, tensor, async_op: bool = False,
                   timeout: TimeoutLike = None) -> Work:
        """Fill `tensor_list[j]` with rank j's `tensor` on every rank."""
        arr = arrays.unwrap(tensor, "all_gather tensor")
        outs = arrays.unwrap_list(tensor_list, "all_gather tensor_list", self._size)
        arrays.same_layout(outs, arr, "all_gather tensor_list", "the input tensor")
        return self._all_gather(list(tensor_list), outs, arr, async_op, self._t(timeout))

    def all_gather_into_tensor(self, output, input,  # noqa: A002 - torch's parameter name
                               async_op: bool = False,
                               timeout: TimeoutLike = None) -> Work:
        """Concatenate every rank's `input` along a new leading block into `output`."""
        arr = arrays.unwrap(input, "all_gather_into_tensor input")
        out = arrays.unwrap(output, "all_gather_into_tensor output")
        if out.dtype != arr.dtype or out.size != arr.size * self._size:
            raise ShapeError(
                f"all_gather_into_tensor output is {arrays.describe(out)} but must hold {self._size} x "
                f"{arrays.describe(arr)} (the input on each of the {self._size} ranks)."
            )
        flat = out.reshape(-1)
        outs = [flat[i * arr.size:(i + 1) * arr.size].reshape(arr.shape) for i in range(self._size)]
        return self._all_gather([output], outs, arr, async_op, self._t(timeout))

    def gather(self, tensor, gather_list: Optional[Sequence] = None, dst: int = 0,
               async_op: bool = False, timeout: TimeoutLike = None) -> Work:
        """Collect every rank's `tensor` into `gather_list` on rank `dst`.

        torch's `pg.gather([[outs]], [t], GatherOptions)` form is accepted too (async).
        """
        if isinstance(tensor, (list, tuple)):
            return self._torch_gather(tensor, gather_list, dst)
        arr = arrays.unwrap(tensor, "gather tensor")
        _rank_arg(dst, self._size, "gather dst")
        outs = None
        if self._rank == dst:
            if gather_list is None:
                raise ValueError(f"gather needs gather_list on the destination rank {dst}.")
            outs = arrays.unwrap_list(gather_list, "gather gather_list", self._size)
            arrays.same_layout(outs, arr, "gather gather_list", "the input tensor")
        elif gather_list:
            raise ValueError(f"gather_list must be None or empty on rank {self._rank}, which is not dst {dst}.")
        return self._gather(gather_list, outs, arr, dst, async_op, self._t(timeout))

    def scatter(self, tensor, scatter_list: Optional[Sequence] = None, src: int = 0,
                async_op: bool = False, timeout: TimeoutLike = None) -> Work:
        """Rank `src` sends `scatter_list[j]` to rank j's `tensor`.

        torch's `pg.scatter([t], [[ins]], ScatterOptions)` form is accepted too (async).
        """
        if isinstance(tensor, (list, tuple)):
            return self._torch_scatter(tensor, scatter_list, src)
        out = arrays.unwrap(tensor, "scatter tensor")
        _rank_arg(src, self._size, "scatter src")
        ins = None
        if self._rank == src:
            if scatter_list is None:
                raise ValueError(f"scatter needs scatter_list on the source rank {src}.")
            ins = arrays.unwrap_list(scatter_list, "scatter scatter_list", self._size)
            arrays.same_layout(ins, out, "scatter scatter_list", "the output tensor")
        elif scatter_list:
            raise ValueError(f"scatter_list must be None or empty on rank {self._rank}, which is not src {src}.")
        return self._scatter(tensor, out, ins, src, async_op, self._t(timeout))

    def reduce_scatter(self, output, input_list: Sequence, op: ReduceOp = ReduceOp.SUM,
                       async_op: bool = False, timeout: TimeoutLike = None) -> Work:
        """Reduce `input_list[j]` across ranks into rank j's `output`.

        torch's `pg.reduce_scatter([out], [[ins]], ReduceScatterOptions)` form is accepted
        too (async).
        """
        if isinstance(output, (list, tuple)):
            return self._torch_reduce_scatter(output, input_list, op)
        out = arrays.unwrap(output, "reduce_scatter output")
        ins = arrays.unwrap_list(input_list, "reduce_scatter input_list", self._size)
        arrays.same_layout(ins, out, "reduce_scatter input_list", "the output tensor")
        if isinstance(op, PremulSum):
            ins = [arrays.premul(x, op.factor, copy=True) for x in ins]  # inputs stay as given
            op = ReduceOp.SUM
        op = arrays.reduce_op(op)
        arrays.check_reducible(op, out.dtype)
        return self._reduce_scatter(output, out, ins, op, async_op, self._t(timeout))

    def all_to_all(self, output_list: Sequence, input_list: Sequence, async_op: bool = False,
                   timeout: TimeoutLike = None, *, result: Optional[list] = None) -> Work:
        """Send `input_list[j]` to rank j, which receives it in its `output_list[i]`.

        `result` (shoal's): what the Work's `result()` and Future hold instead of
        `output_list`; all_to_all_single passes its whole output tensor, as torch's Work does.
        """
        outs = arrays.unwrap_list(output_list, "all_to_all output_list", self._size)
        ins = arrays.unwrap_list(input_list, "all_to_all input_list", self._size)
        for i, (o, x) in enumerate(zip(outs, ins)):
            arrays.check_same_dtype(o, x, f"all_to_all output_list[{i}]", f"input_list[{i}]",
                             rule="all arrays must share one dtype")
        if result is not None and not isinstance(result, (list, tuple)):
            raise TypeError(
                f"all_to_all result must be a list of what the Work should hold, got "
                f"{type(result).__name__}."
            )
        held = list(output_list) if result is None else list(result)
        return self._all_to_all(held, outs, ins, async_op, self._t(timeout))

    def send(self, tensor, dst: int, tag: int = 0, async_op: bool = False,
             timeout: TimeoutLike = None) -> Work:
        """Send `tensor` to rank `dst`; the matching `recv` must use the same tag."""
        arr = arrays.unwrap(tensor, "send tensor")
        _rank_arg(dst, self._size, "send dst")
        if dst == self._rank:
            raise ValueError(f"Rank {self._rank} cannot send to itself.")
        return self._send(arr, dst, self._tag(tag), async_op, self._t(timeout))

    def recv(self, tensor, src: Optional[int] = None, tag: int = 0, async_op: bool = False,
             timeout: TimeoutLike = None) -> Work:
        """Receive into `tensor` from rank `src` (None: any rank); `work.source_rank` says who."""
        arr = arrays.unwrap(tensor, "recv tensor")
        if src is not None:
            _rank_arg(src, self._size, "recv src")
            if src == self._rank:
                raise ValueError(f"Rank {self._rank} cannot receive from itself.")
        return self._recv(tensor, arr, src, self._tag(tag), async_op, self._t(timeout))

    def barrier(self, async_op: bool = False, timeout: TimeoutLike = None) -> Work:
        """Return once every rank of the group has called barrier."""
        return self._barrier(async_op, self._t(timeout))

    def monitored_barrier(self, timeout: TimeoutLike = None, wait_all_ranks: bool = False) -> None:
        """A barrier whose rank 0 names the ranks that did not arrive within `timeout`.

        Raises:
            CollectiveTimeout: on rank 0 naming the first missing rank (all of them with
                `wait_all_ranks`); on the others, the same reason relayed by rank 0.
        """
        self._monitored_barrier(self._t(timeout), bool(wait_all_ranks))

    def all_gather_object(self, obj: Any, timeout: TimeoutLike = None) -> list:
        """Every rank's picklable `obj`, in rank order."""
        data = arrays.pickle_to_array(obj)
        mine = np.array([data.size], dtype=np.int64)
        sizes = [np.zeros(1, dtype=np.int64) for _ in range(self._size)]
        self.all_gather(sizes, mine, timeout=timeout)
        longest = int(max(s[0] for s in sizes))
        padded = np.zeros(longest, dtype=np.uint8)
        padded[: data.size] = data
        outs = [np.empty(longest, dtype=np.uint8) for _ in range(self._size)]
        self.all_gather(outs, padded, timeout=timeout)
        return [arrays.array_to_object(o[: int(s[0])]) for o, s in zip(outs, sizes)]

    def broadcast_object_list(self, object_list: list, src: int = 0,
                              timeout: TimeoutLike = None) -> None:
        """Replace every rank's `object_list` items with rank `src`'s (lists of equal length)."""
        _rank_arg(src, self._size, "broadcast_object_list src")
        if self._rank == src:
            blobs = [arrays.pickle_to_array(o) for o in object_list]
            sizes = np.array([b.size for b in blobs], dtype=np.int64)
        else:
            sizes = np.zeros(len(object_list), dtype=np.int64)
        self.broadcast(sizes, src=src, timeout=timeout)
        data = (np.concatenate(blobs) if self._rank == src and blobs
                else np.empty(int(sizes.sum()), dtype=np.uint8))
        self.broadcast(data, src=src, timeout=timeout)
        if self._rank != src:
            offsets = np.concatenate([[0], np.cumsum(sizes)])
            for i in range(len(object_list)):
                object_list[i] = arrays.array_to_object(data[offsets[i]:offsets[i + 1]])

    # -- lifecycle

    @abc.abstractmethod
    def abort(self) -> None:
        """Fail every pending and later collective of this group on every rank, now."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Leave the group: say goodbye to peers and release sockets and threads."""

    @staticmethod
    def _tag(tag: Any) -> int:
        if isinstance(tag, bool) or not isinstance(tag, int) or not -(2 ** 31) <= tag < 2 ** 31:
            raise ValueError(f"tag must be a 32-bit int, got {tag!r}.")
        return tag

    # -- private hooks (each gets the caller's objects and their unwrapped arrays)

    @abc.abstractmethod
    def _all_reduce(self, tensor, arr, op: ReduceOp, async_op: bool, timeout: float) -> Work: ...

    @abc.abstractmethod
    def _broadcast(self, tensor, arr, src: int, async_op: bool, timeout: float) -> Work: ...

    @abc.abstractmethod
    def _reduce(self, tensor, arr, dst: int, op: ReduceOp, async_op: bool, timeout: float) -> Work: ...

    @abc.abstractmethod
    def _all_gather(self, outputs, outs, arr, async_op: bool, timeout: float) -> Work: ...

    @abc.abstractmethod
    def _gather(self, outputs, outs, arr, dst: int, async_op: bool, timeout: float) -> Work: ...

    @abc.abstractmethod
    def _scatter(self, tensor, out, ins, src: int, async_op: bool, timeout: float) -> Work: ...

    @abc.abstractmethod
    def _reduce_scatter(self, output, out, ins, op: ReduceOp, async_op: bool, timeout: float) -> Work: ...

    @abc.abstractmethod
    def _all_to_all(self, outputs, outs, ins, async_op: bool, timeout: float) -> Work: ...

    @abc.abstractmethod
    def _send(self, arr, dst: int, tag: int, async_op: bool, timeout: float) -> Work: ...

    @abc.abstractmethod
    def _recv(self, tensor, arr, src: Optional[int], tag: int, async_op: bool, timeout: float) -> Work: ...

    @abc.abstractmethod
    def _barrier(self, async_op: bool, timeout: float) -> Work: ...

    @abc.abstractmethod
    def _monitored_barrier(self, timeout: float, wait_all_ranks: bool) -> None: ...
