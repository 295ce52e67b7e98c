"""The `nccl` backend: collectives on CUDA devices through NCCL (cupy.cuda.nccl).

One communicator per group and device, formed through the store (`bootstrap`). Every
collective runs on the group's own CUDA stream, which first waits for the caller's current
stream (an event), and returns a `Work` backed by an event recorded after it (`work`).
cupy arrays and CUDA `core.Tensor`s are used in place; numpy arrays are staged through pinned
host memory and the device, and their work blocks the host, so DDP's small host-side control
collectives run unchanged on this backend. The shared watchdog (`backends.watchdog`) finishes
work whose events fired (this group's `watchdog_tick`), fails overdue work and NCCL's
asynchronous errors; failing aborts the communicator from a separate thread with its own
deadline, so an abort that hangs cannot hang the process.

NCCL has no message tags and no receive-from-anyone: `tag` is accepted and ignored (as torch
does) and `recv` needs `src`. Point-to-point transfers between two ranks match in call order.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from shoal.collectives import env, metrics
from shoal.collectives.api import Work
from shoal.collectives.arrays import describe
from shoal.collectives.backends.api import Verdict
from shoal.collectives.backends.base import BackendGroup
from shoal.collectives.backends.ledger import OpRecord
from shoal.collectives.backends.nccl import bootstrap, store_barrier, teardown
from shoal.collectives.backends.nccl import runtime as _nccl_runtime
from shoal.collectives.backends.nccl.devices import check_arrays_on, pick_device
from shoal.collectives.backends.nccl.staging import DeviceStage
from shoal.collectives.backends.nccl.work import InFlight, NcclWork
from shoal.collectives.backends.watchdog import exit_after_error
from shoal.collectives.constants import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_GROUP_NAME,
    WATCHDOG_TICK_S,
)
from shoal.collectives.store.api import Store
from shoal.collectives.types import (
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    GroupDestroyed,
    ReduceOp,
)
from shoal.core.errors import ShapeError
from shoal.core.timeouts import TimeoutLike

logger = logging.getLogger(__name__)

__all__ = ["ProcessGroupNCCL", "ABORT_TIMEOUT_S"]

# How long the watchdog waits for ncclCommAbort before giving up on it (it then leaves the
# abort thread behind and fails the work anyway).
ABORT_TIMEOUT_S = 10.0
# Extra time synchronize() allows past an operation's timeout: the watchdog's diagnosis (a
# store query) and its abort both fit in it, so the watchdog's error is what the caller sees.
_SYNC_GRACE_S = 5.0


def _reduce_spec(rt: Any, op: ReduceOp, dtype: Any, what: str):
    """NCCL's operation for `op` on `dtype`; a TypeError names the collective `what`."""
    try:
        return _nccl_runtime.reduce_spec(dtype, op, rt.nccl_version)
    except TypeError as exc:
        raise TypeError(f"{what}: {exc}") from None


class ProcessGroupNCCL(BackendGroup):
    """A process group over NCCL; ranks meet through `store`.

    Args:
        store, rank, size, timeout, name, global_ranks: as for `BackendGroup` (the store also
            carries the NCCL unique id).
        device: the CUDA device (index, 'cuda:N' or core Device); default: LOCAL_RANK (which
            then becomes this thread's current device, as torchrun scripts do with
            torch.cuda.set_device), else the current device.
        abort_timeout: how long the watchdog waits for ncclCommAbort before giving up on it.
        runtime: the CUDA/NCCL runtime (default: cupy's); tests pass a stand-in.

    Raises:
        BackendUnavailable: no CUDA device, cupy or NCCL here.
        CollectiveTimeout: a rank did not join within `timeout` (named).
        CollectiveError: the communicator could not be created.
    """

    backend_name = "nccl"

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        timeout: TimeoutLike = DEFAULT_COLLECTIVE_TIMEOUT_S,
        name: str = DEFAULT_GROUP_NAME,
        global_ranks: Optional[list[int]] = None,
        device: Any = None,
        abort_timeout: float = ABORT_TIMEOUT_S,
        runtime: Any = None,
        host: Optional[str] = None,
        watchdog_tick: float = WATCHDOG_TICK_S,
    ):
        super().__init__(store, rank, size, timeout, name, global_ranks)
        del host  # NCCL picks its own interfaces (NCCL_SOCKET_IFNAME)
        self._rt = runtime if runtime is not None else _nccl_runtime.load()
        self._abort_timeout = float(abort_timeout)
        self._grace_s = self._abort_timeout + _SYNC_GRACE_S
        self.device = pick_device(self._rt, device, rank, name)
        self._inflight = InFlight()
        self._device_selected = False  # in the watchdog's thread, by its first tick
        self._launch_lock = threading.RLock()
        self._fail_lock = threading.Lock()
        self._failure: Optional[tuple[str, str, Optional[str]]] = None  # kind, cause, dump path
        self._destroyed = False
        self._comm: Any = None
        self._barrier_buf: Any = None
        deadline = time.monotonic() + self._timeout
        self._prefix = bootstrap.join_generation(store, name, rank, size)
        with self._rt.device_context(self.device):
            self._stream = self._rt.new_stream()
            bootstrap.announce(store, self._prefix, rank, self.device)
            bootstrap.await_peers(store, self._prefix, rank, size, name, deadline)
            uid = bootstrap.exchange_unique_id(store, self._prefix, rank, name,
                                               self._rt.unique_id, deadline)
            device = self.device

            def create():
                with self._rt.device_context(device):
                    return self._rt.communicator(size, uid, rank)

            self._comm = bootstrap.init_communicator(create, rank, size, name, deadline)
        self._start_watchdog(watchdog_tick)
        logger.debug("Rank %d joined nccl group %r of %d ranks on cuda:%d", rank, name, size,
                     self.device)

    # ------------------------------------------------------------------ introspection

    def __repr__(self) -> str:
        return (f"ProcessGroupNCCL(name={self.name!r}, rank={self._rank}, size={self._size}, "
                f"device=cuda:{self.device})")

    @classmethod
    def check_backend_availability(cls) -> Optional[str]:
        """None where cupy, a CUDA device and the NCCL library are here; else why not."""
        return _nccl_runtime.unavailable_sentence()

    @property
    def runtime(self) -> Any:
        """The CUDA/NCCL runtime this group runs on (cupy's, or a test's stand-in)."""
        return self._rt

    @property
    def sync_grace_s(self) -> float:
        """How long past an operation's timeout `synchronize()` waits: by then the watchdog has
        diagnosed and aborted, so its error is what the caller sees."""
        return self._grace_s

    @property
    def store_prefix(self) -> str:
        """The prefix of this incarnation of the group's keys in the store."""
        return self._prefix

    @property
    def failed(self) -> bool:
        """True once the group failed (a timeout, an NCCL error, abort())."""
        return self._failure is not None

    @property
    def failure(self) -> Optional[str]:
        """Why the group failed (a sentence), or None while it is healthy."""
        return None if self._failure is None else self._failure[1]

    def watchdog_tick(self) -> None:
        """Finish the work whose events fired (callbacks see the group's device as current)."""
        if not self._device_selected:
            self._device_selected = True
            try:
                self._rt.use_device(self.device)
            except Exception:
                logger.debug("the watchdog could not select device %s", self.device,
                             exc_info=True)
        self._inflight.finish_fired()

    def async_error(self) -> Optional[str]:
        """NCCL's asynchronous error of the communicator (None while healthy or failed)."""
        comm = self._comm
        if comm is None or self._failure is not None:
            return None
        return comm.async_error()

    def fail_from_watchdog(self, verdict: Verdict) -> None:
        """Fail the group for the watchdog's verdict: the overdue work gets its message."""
        overdue = None if verdict.kind == "error" else self._inflight.find(verdict.record)
        self._fail_group(verdict.kind, verdict.cause, overdue, verdict.message,
                         list(verdict.culprits), dump_path=verdict.dump_path)

    # ------------------------------------------------------------------ failure

    def _fail_group(self, kind: str, cause: str, culprit: Optional[NcclWork],
                    message: Optional[str], culprits: list, dump_path: Optional[str] = None,
                    in_launch: bool = False) -> None:
        """Fail the group once: fail every outstanding work, then abort the communicator.

        The work fails first: an abort lets NCCL's kernels exit, which fires their events, and
        no caller may take such an event for success (NcclWork.poll checks the failure too).
        """
        with self._fail_lock:
            if self._failure is not None:
                return
            self._failure = (kind, cause, dump_path)
        logger.warning("Rank %d: nccl group %r failed (culprits: %s): %s", self._rank, self.name,
                       culprits, cause)
        if culprit is not None and message is not None:
            cls = CollectiveMismatch if kind == "mismatch" else CollectiveTimeout
            culprit.finish(cls(message))
            metrics.count_error(culprit.record.op, kind)
        for work in self._inflight.outstanding():
            err = self.error_for(work.record)
            if work.finish(err):
                metrics.count_error(work.record.op, kind)
        self._abort_comm(wait_for_launch=not in_launch)
        if env.async_error_handling():
            exit_after_error(
                message or f"Rank {self._rank}'s nccl group '{self.name}' failed: {cause}."
            )

    def error_for(self, rec: OpRecord) -> CollectiveError:
        """The error operation `rec` fails with, once the group failed."""
        kind, cause, path = self._failure
        text = f"Rank {self._rank}'s {rec.label} of group '{self.name}' failed: {cause}"
        if kind in ("timeout", "error"):
            text += "; the NCCL communicator was aborted"
        text += "."
        if path:
            text += f" Recent collectives of this rank are in {path}."
        return CollectiveError(text)

    def _abort_comm(self, wait_for_launch: bool = True) -> bool:
        """ncclCommAbort in its own thread; True if it returned within the abort deadline."""
        comm, self._comm = self._comm, None
        if comm is None:
            return True
        return teardown.abort(comm, self._launch_lock, wait_for_launch, self._rank, self.name,
                              self._abort_timeout)

    # ------------------------------------------------------------------ launching

    def _launch(self, op: str, desc: str, nbytes: int, timeout: float, async_op: bool,
                outputs: list, arrays: list, body: Callable[[DeviceStage, Any], None],
                p2p: bool = False, blocking: bool = False, work_hook=None) -> Work:
        """Run `body(stage, comm)` on the group's stream after the caller's, and return its Work."""
        rt = self._rt
        check_arrays_on(rt, self.device, op, arrays, self._rank, self.name)
        host = any(not rt.is_device_array(a) for a in arrays)
        with self._launch_lock:
            if self._destroyed:
                raise GroupDestroyed(
                    f"{op} was called on nccl group '{self.name}' after it was destroyed."
                )
            if self._failure is not None:
                raise CollectiveError(
                    f"Rank {self._rank}'s {op} cannot run: nccl group '{self.name}' failed earlier: "
                    f"{self._failure[1]}."
                )
            rec = self._ledger.open(op, desc, nbytes, timeout, p2p)
            work = NcclWork(self, rec, outputs, host_blocking=blocking or host)
            if work_hook is not None:
                work_hook(work)
            self._inflight.track(work)
            comm = self._comm
            try:
                with rt.device_context(self.device):
                    rt.wait_event(self._stream, rt.record(rt.current_stream()))
                    with rt.stream_context(self._stream):
                        body(DeviceStage(rt, self._stream, work), comm)
                    work.event = rt.record(self._stream)
            except Exception as exc:
                if self._failure is None:
                    # NCCL refused to enqueue: the communicator cannot be trusted any more.
                    self._fail_group("error", f"rank {self._rank} could not launch {rec.label}: "
                                     f"{type(exc).__name__}: {exc}", None, None, [self._rank],
                                     in_launch=True)
                work.finish(self.error_for(rec))
                raise work.exception() from exc
        if not async_op:
            work.wait()
        return work

    # ------------------------------------------------------------------ collectives

    def _all_reduce(self, tensor, arr, op, async_op, timeout):
        spec = _reduce_spec(self._rt, op, arr.dtype, "all_reduce")
        size = self._size

        def body(st: DeviceStage, comm) -> None:
            d = st.dev(arr)
            comm.all_reduce(d, d, spec, self._stream)
            if spec.divide_after:
                self._rt.divide(d, size)
            st.back(d, arr)

        return self._launch("all_reduce", f"all_reduce({describe(arr)}, op={op.name})", arr.nbytes,
                            timeout, async_op, [tensor], [arr], body)

    def _reduce(self, tensor, arr, dst, op, async_op, timeout):
        spec = _reduce_spec(self._rt, op, arr.dtype, "reduce")
        me, size = self._rank, self._size

        def body(st: DeviceStage, comm) -> None:
            d = st.dev(arr)
            comm.reduce(d, d, spec, dst, self._stream)
            if me == dst:
                if spec.divide_after:
                    self._rt.divide(d, size)
                st.back(d, arr)

        return self._launch("reduce", f"reduce({describe(arr)}, dst={dst}, op={op.name})",
                            arr.nbytes, timeout, async_op, [tensor], [arr], body)

    def _broadcast(self, tensor, arr, src, async_op, timeout):
        me = self._rank

        def body(st: DeviceStage, comm) -> None:
            d = st.dev(arr, upload=me == src)
            comm.broadcast(d, src, self._stream)
            if me != src:
                st.back(d, arr)

        return self._launch("broadcast", f"broadcast({describe(arr)}, src={src})", arr.nbytes,
                            timeout, async_op, [tensor], [arr], body)

    def _all_gather(self, outputs, outs, arr, async_op, timeout):
        n = arr.size

        def body(st: DeviceStage, comm) -> None:
            d = st.dev(arr)
            flat, own = st.flat_of(outs, n, arr.dtype, upload=False)
            comm.all_gather(d, flat, self._stream)
            if not own:
                for q, o in enumerate(outs):
                    piece = flat[q * n:(q + 1) * n]
                    if self._rt.is_device_array(o):
                        self._rt.copy(o, piece)
                    else:
                        st.back(piece, o)

        return self._launch("all_gather", f"all_gather({describe(arr)})", arr.nbytes, timeout,
                            async_op, outputs, [arr, *outs], body)

    def _reduce_scatter(self, output, out, ins, op, async_op, timeout):
        spec = _reduce_spec(self._rt, op, out.dtype, "reduce_scatter")
        size = self._size

        def body(st: DeviceStage, comm) -> None:
            flat, _own = st.flat_of(ins, out.size, out.dtype)
            d = st.dev(out, upload=False)
            comm.reduce_scatter(flat, d, spec, self._stream)
            if spec.divide_after:
                self._rt.divide(d, size)
            st.back(d, out)

        return self._launch("reduce_scatter",
                            f"reduce_scatter({describe(out)} x {size}, op={op.name})",
                            out.nbytes * size, timeout, async_op, [output], [out, *ins], body)

    def _all_to_all(self, outputs, outs, ins, async_op, timeout):
        me = self._rank
        if outs[me].size != ins[me].size:
            raise ShapeError(
                f"all_to_all output_list[{me}] is {describe(outs[me])} but input_list[{me}] is "
                f"{describe(ins[me])} on rank {me}; a rank's own block must keep its size."
            )
        rt = self._rt

        def body(st: DeviceStage, comm) -> None:
            dins = [st.dev(x) for x in ins]
            douts = [st.dev(o, upload=False) for o in outs]
            with rt.group():
                for q in range(self._size):
                    if q != me:
                        comm.send(dins[q], q, self._stream)
                        comm.recv(douts[q], q, self._stream)
            rt.copy(douts[me], dins[me])
            for d, o in zip(douts, outs):
                st.back(d, o)

        desc = ("all_to_all(in " + ", ".join(describe(x) for x in ins) + "; out "
                + ", ".join(describe(o) for o in outs) + ")")
        return self._launch("all_to_all", desc, sum(x.nbytes for x in ins), timeout, async_op,
                            outputs, [*outs, *ins], body)

    def _gather(self, outputs, outs, arr, dst, async_op, timeout):
        me, rt = self._rank, self._rt

        def body(st: DeviceStage, comm) -> None:
            d = st.dev(arr)
            if me == dst:
                douts = [st.dev(o, upload=False) for o in outs]
                with rt.group():
                    for q in range(self._size):
                        if q != me:
                            comm.recv(douts[q], q, self._stream)
                rt.copy(douts[me], d)
                for dq, o in zip(douts, outs):
                    st.back(dq, o)
            else:
                with rt.group():
                    comm.send(d, dst, self._stream)

        arrays = [arr, *(outs or [])]
        return self._launch("gather", f"gather({describe(arr)}, dst={dst})", arr.nbytes, timeout,
                            async_op, list(outputs) if outputs else [], arrays, body)

    def _scatter(self, tensor, out, ins, src, async_op, timeout):
        me, rt = self._rank, self._rt

        def body(st: DeviceStage, comm) -> None:
            d = st.dev(out, upload=False)
            if me == src:
                dins = [st.dev(x) for x in ins]
                with rt.group():
                    for q in range(self._size):
                        if q != me:
                            comm.send(dins[q], q, self._stream)
                rt.copy(d, dins[me])
            else:
                with rt.group():
                    comm.recv(d, src, self._stream)
            st.back(d, out)

        return self._launch("scatter", f"scatter({describe(out)}, src={src})", out.nbytes,
                            timeout, async_op, [tensor], [out, *(ins or [])], body)

    def _send(self, arr, dst, tag, async_op, timeout):
        def body(st: DeviceStage, comm) -> None:
            d = st.dev(arr)
            with self._rt.group():
                comm.send(d, dst, self._stream)

        return self._launch("send", f"send({describe(arr)}, dst={dst}, tag={tag})", arr.nbytes,
                            timeout, async_op, [arr], [arr], body, p2p=True)

    def _recv(self, tensor, arr, src, tag, async_op, timeout):
        if src is None:
            raise ValueError(
                "The nccl backend cannot receive from any rank: NCCL matches point-to-point "
                "messages by peer, so pass src=."
            )

        def body(st: DeviceStage, comm) -> None:
            d = st.dev(arr, upload=False)
            with self._rt.group():
                comm.recv(d, src, self._stream)
            st.back(d, arr)

        def hook(work: NcclWork) -> None:
            work.source_rank = src

        return self._launch("recv", f"recv({describe(arr)}, src={src}, tag={tag})", arr.nbytes,
                            timeout, async_op, [tensor], [arr], body, p2p=True, work_hook=hook)

    def _barrier(self, async_op, timeout):
        def body(st: DeviceStage, comm) -> None:
            if self._barrier_buf is None:
                self._barrier_buf = self._rt.empty((1,), np.int32)
            buf = self._barrier_buf
            spec = _nccl_runtime.reduce_spec(np.int32, ReduceOp.SUM, self._rt.nccl_version)
            comm.all_reduce(buf, buf, spec, self._stream)

        # A device-side barrier means nothing to the host: its work blocks the host, as torch's.
        return self._launch("barrier", "barrier()", 0, timeout, async_op, [], [], body, blocking=True)

    def _monitored_barrier(self, timeout, wait_all_ranks):
        """Through the store (NCCL cannot tell who is missing): rank 0 names absent ranks."""
        with self._launch_lock:
            if self._failure is not None:
                raise CollectiveError(
                    f"Rank {self._rank}'s monitored_barrier cannot run: nccl group '{self.name}' "
                    f"failed earlier: {self._failure[1]}."
                )
            # Bounded by its own waits; the watchdog's limit lies beyond them, so the barrier
            # names the missing ranks itself instead of the watchdog failing the group.
            rec = self._ledger.open("monitored_barrier", "monitored_barrier()", 0,
                                    timeout + 2 * _SYNC_GRACE_S, False)
        error = store_barrier.monitored_barrier(
            self._store, f"{self._prefix}/monitored_barrier/{rec.seq}", rec.seq, self._rank,
            self._size, self.name, timeout, wait_all_ranks, _SYNC_GRACE_S)
        self._ledger.finish(rec, error)
        if error is not None:
            raise error

    # ------------------------------------------------------------------ lifecycle

    def abort(self) -> None:
        """Abort the communicator now and fail every pending and later collective."""
        self._fail_group("error", f"rank {self._rank} aborted the group (ProcessGroup.abort())",
                         None, None, [self._rank])

    def shutdown(self) -> None:
        """Leave the group: destroy the communicator (abort it if work is still pending)."""
        if not self._leave():
            return
        pending = self._inflight.outstanding()
        comm = self._comm
        if comm is not None and not pending:
            self._comm = None
            teardown.destroy(comm, self._rank, self.name, self._abort_timeout)
        elif comm is not None:
            self._abort_comm()
        error = GroupDestroyed(
            f"Nccl group '{self.name}' was destroyed while this collective was still running."
        )
        for work in pending:
            work.finish(error)
