"""The reducer behind DistributedDataParallel: gradient hooks, bucket launches, finalization.

One *round* is the backward of the forwards since the last reduction. DDP opens a round before
its module's forward and the reducer creates a *sentinel* graph node at that moment, which the
forward's outputs are tied to. core's engine runs ready nodes newest first, so a node older than
every op of the forward runs after all of them: the sentinel's backward is the end of this
module's backward, where torch's reducer runs its callback queued on the autograd engine. Until
then, each parameter's post-accumulate hook copies its gradient into its bucket, and a bucket
whose gradients are all in launches its asynchronous all_reduce, buckets strictly in order so
that every rank issues the same collectives in the same sequence.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from shoal.collectives import metrics
from shoal.collectives.ddp import comm
from shoal.collectives.ddp.buckets import Bucket, GradBucket, compute_bucket_assignment
from shoal.collectives.ddp.errors import (
    DDPError,
    graph_changed_error,
    ready_twice_error,
    unfinished_error,
    with_ddp_context,
)
from shoal.collectives.ddp.future import future_value, wait_bounded
from shoal.collectives.ddp.graph import map_tensors, reachable_leaves, same_memory
from shoal.collectives.ddp.hook_contract import call_hook, take_hook_result
from shoal.collectives.types import CollectiveError, ReduceOp
from shoal.core import backend
from shoal.core.autograd import Node
from shoal.core.profiler import state as _profiler
from shoal.core.tensor import Tensor

log = logging.getLogger(__name__)


INLINE_LAST_BUCKET = True


class _FailedWork:
    """The outcome of a synchronous bucket all_reduce that failed: wait() raises its error."""

    def __init__(self, exc: CollectiveError) -> None:
        self._exc = exc

    def wait(self, timeout: Any = None) -> bool:
        raise self._exc

    def add_done_callback(self, fn: Callable) -> None:
        fn(self)


def _stamp_done(bucket: Bucket, _work: Any) -> None:
    # Runs in the backend's thread when the bucket's collective ends (for the metric).
    bucket.done_at = time.perf_counter()


def _profile_bucket(bucket: Bucket, done: float) -> None:
    """The bucket's all-reduce as one profiler event: its index, bytes, and how long its
    first gradient waited for its last (what a bucket order or size change would save)."""
    recorder = _profiler.recorder
    if recorder is None:
        return
    first = bucket.first_ready_at or bucket.launched_at
    recorder.add_range(
        f"DDP bucket {bucket.index} all_reduce", "ddp", int(bucket.launched_at * 1e9),
        int(done * 1e9),
        {"bucket": bucket.index, "bytes": int(bucket.buffer.nbytes),
         "params": len(bucket.params), "is_last": bucket.is_last,
         "waited_for_last_gradient_us": round(max(0.0, bucket.launched_at - first) * 1e6, 1)},
    )


def _adopt_as_grad(param: Tensor, view: Any) -> None:
    # The view becomes the gradient: with gradient_as_bucket_view the bucket is reused (the
    # next round reduces in place), otherwise the next round gets a fresh buffer.
    grad = param.grad
    if grad is None:
        param.grad = Tensor(view)
    elif not same_memory(grad.array, view):
        grad.array = view


# --------------------------------------------------------------------------------- Reducer

class Reducer:
    """Buckets gradients, reduces them during backward and writes the averages into .grad."""

    def __init__(
        self,
        params: Sequence[Tensor],
        names: Sequence[str],
        group: Any,
        *,
        bucket_limits: Sequence[int],
        find_unused_parameters: bool,
        static_graph: bool,
        gradient_as_bucket_view: bool,
    ) -> None:
        self._params = list(params)
        self._names = list(names)
        self._group = group
        self._rank = comm.rank(group)
        self._world = comm.size(group)
        self._limits = list(bucket_limits)
        self._find_unused = find_unused_parameters
        self._static = static_graph
        self._as_view = gradient_as_bucket_view
        count = len(self._params)
        self._numels = [int(p.array.size) for p in self._params]
        self._dtypes = [p.array.dtype for p in self._params]
        self._build(list(range(count - 1, -1, -1)))

        # communication hook (None: all_reduce then divide, built in)
        self._hook: Optional[Callable] = None
        self._hook_state: Any = None

        # the round in progress
        self._open = False
        self._sentinel: Optional[Tensor] = None
        self._ready = [False] * count
        self._n_ready = 0
        self._fired = 0
        self._next_bucket = 0
        self._inline_wait = 0.0  # the last bucket's all_reduce when it ran inline
        self._unused: list[int] = []
        self._unused_marked = False
        self._used_ids: set[int] = set()
        self._div = float(self._world)

        # static graph: hook counts learned in the first synchronised round
        self._static_counts: Optional[list[int]] = None
        self._learn_counts = [0] * count
        self._counts_left: list[int] = []
        self._static_unused: list[int] = []
        self._globally_unused: set[int] = set()

        # Bucket rebuild from the observed order, once, at the end of the first synchronised
        # round, which therefore reduces after backward in the rebuilt layout instead of
        # overlapping in the initial one. Every round of every process then reduces in the
        # same layout: the ring and shared-memory all_reduces sum an element in an order that
        # depends on its offset in the bucket, so a process restarted from a checkpoint must
        # not reduce its first round in another layout than the run it continues (bitwise-
        # identical resumes).
        self._may_rebuild = static_graph or not find_unused_parameters
        self._rebuilt = False
        self._arrival: list[int] = []
        # When each gradient arrived in a round reduced only at its end (the first round, or a
        # static graph's learning round): each bucket's first arrival, for its profiler event.
        self._arrived_at: dict[int, float] = {}
        self._deferring = False
        self.rounds_synced = 0

        self._handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
            for i, p in enumerate(self._params)
        ]

    # ------------------------------------------------------------------ buckets and layout

    def _build(self, order: list[int]) -> None:
        indices = compute_bucket_assignment(self._numels, self._dtypes, order, self._limits)
        self._buckets = [Bucket(k, idx, self._params) for k, idx in enumerate(indices)]
        self._buckets[-1].is_last = True
        self._where = [(0, 0)] * len(self._params)
        for bucket in self._buckets:
            for slot, i in enumerate(bucket.param_indices):
                self._where[i] = (bucket.index, slot)
        log.debug(
            "rank %s: %s DDP bucket(s) of %s bytes", self._rank, len(self._buckets),
            [b.nbytes for b in self._buckets],
        )

    @property
    def bucket_indices(self) -> list[list[int]]:
        """The parameter indices of each bucket, in launch order."""
        return [list(b.param_indices) for b in self._buckets]

    @property
    def bucket_nbytes(self) -> list[int]:
        """The size of each bucket's buffer in bytes, in launch order."""
        return [b.nbytes for b in self._buckets]

    def rebuild_order(self) -> list[int]:
        """This rank's observed arrival order, completed with the parameters that never came."""
        seen = set(self._arrival)
        missing = [i for i in range(len(self._params) - 1, -1, -1) if i not in seen]
        return list(self._arrival) + missing

    def rebuild(self, order: Sequence[int]) -> None:
        """Rebuild the buckets from `order` (every rank must pass the same one); done once."""
        order = [int(i) for i in order]
        if sorted(order) != list(range(len(self._params))):
            raise DDPError(
                f"Bucket rebuild got an order that is not a permutation of the "
                f"{len(self._params)} parameter indices: {order}."
            )
        self._build(order)
        self._rebuilt = True
        self._arrival = []

    def _adopt_layout(self) -> None:
        """Rebuild from rank 0's arrival order: ranks may observe different orders, and every
        rank's buckets must match."""
        order = np.array(self.rebuild_order(), dtype=np.int64)
        comm.broadcast(self._group, order, src=0)
        self.rebuild(order.tolist())
        log.debug("rank %s: rebuilt DDP buckets: %s", self._rank, self.bucket_indices)

    # ------------------------------------------------------------------ configuration

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Reduce each bucket with hook(state, GradBucket) -> Future instead of all_reduce."""
        if self._hook is not None:
            raise DDPError(
                "register_comm_hook can only be called once per DistributedDataParallel; a hook "
                f"({getattr(self._hook, '__name__', self._hook)!r}) is already registered."
            )
        if self.rounds_synced or self._open:
            raise DDPError(
                "register_comm_hook must be called before the first forward and backward; this "
                "DistributedDataParallel has already reduced gradients."
            )
        self._hook = hook
        self._hook_state = state

    @property
    def static_learned(self) -> bool:
        """True once the static graph's hook counts are known."""
        return self._static_counts is not None

    @property
    def needs_used_map(self) -> bool:
        """Whether this round ends with an all_reduce of which parameters had a gradient."""
        return (self._find_unused and not self._static) or (
            self._static and self._static_counts is None
        )

    # ------------------------------------------------------------------ a round

    def check_prior_round(self) -> None:
        """Raise when the previous round started reducing but its backward never finished."""
        if not (self._open and self._fired):
            return
        self._close()
        raise self._unfinished(at_end=False)

    def _unfinished(self, at_end: bool) -> DDPError:
        return unfinished_error(self._names, self._ready, self._rank,
                                static_learned=self._static_counts is not None,
                                find_unused=self._find_unused, at_end=at_end)

    def open_round(self, divide_by: float) -> None:
        """Expect gradients: called before the module's forward with grad sync on."""
        if self._open:
            return  # a second forward before backward: both feed the same reduction
        self._open = True
        self._div = float(divide_by)
        self._ready = [False] * len(self._params)
        self._n_ready = 0
        self._fired = 0
        self._next_bucket = 0
        self._inline_wait = 0.0  # a failed round's must not count in this one
        self._unused = []
        self._unused_marked = False
        self._used_ids = set()
        if self._static_counts is not None:
            self._counts_left = list(self._static_counts)
        self._deferring = self._may_rebuild and not self._rebuilt
        self._arrived_at = {}
        for bucket in self._buckets:
            bucket.reset()
            if not self._as_view:
                bucket.swap_buffers()
        self._sentinel = self._make_sentinel()

    def attach(self, outputs: Any) -> Any:
        """After forward: find unused parameters if asked, and tie the outputs to the sentinel."""
        if not self._open:
            return outputs
        if self._find_unused and not self._static:
            self._used_ids |= reachable_leaves(outputs)
            self._unused = [
                i for i, p in enumerate(self._params) if id(p) not in self._used_ids
            ]
        elif self._static_counts is not None:
            self._unused = list(self._static_unused)
        sentinel = self._sentinel

        def tie(t: Tensor) -> Tensor:
            if not t.requires_grad:
                return t
            out = Tensor(t.array)
            out.requires_grad = True
            xp = backend.array_module(sentinel.array)
            out.grad_fn = Node(
                "DDPSinkBackward", lambda g: (g, xp.zeros((), dtype=sentinel.array.dtype)),
                (t, sentinel),
            )
            return out

        return map_tensors(outputs, tie)

    def _make_sentinel(self) -> Tensor:
        xp = backend.array_module(self._params[0].array)
        anchor = Tensor(xp.zeros((), dtype=np.float32), requires_grad=True)
        sentinel = Tensor(xp.zeros((), dtype=np.float32))
        sentinel.requires_grad = True
        sentinel.grad_fn = Node("DDPFinalizeBackward", self._on_sentinel, (anchor,))
        return sentinel

    def _close(self) -> None:
        self._open = False
        self._sentinel = None

    # ------------------------------------------------------------------ during backward

    def _on_grad(self, index: int, param: Tensor) -> None:
        if not self._open:
            return  # no_sync, eval, or a backward after the round finished: accumulate locally
        self._fired += 1
        if self._static and self._static_counts is None:
            # First static round: only learn how often each hook fires; reduce at the end.
            self._learn_counts[index] += 1
            if self._learn_counts[index] == 1:
                self._arrival.append(index)
                self._arrived_at[index] = time.perf_counter()
            return
        if self._static_counts is not None:
            left = self._counts_left[index]
            if left == 0:
                raise graph_changed_error(self._names[index], self._rank,
                                          used_in_first=bool(self._static_counts[index]))
            self._counts_left[index] = left - 1
            if left > 1:
                return  # more reentrant backward passes will add to this gradient
        if not self._unused_marked:
            self._unused_marked = True
            for i in self._unused:
                self._mark_ready(i)
        self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        if self._ready[index]:
            raise ready_twice_error(self._names[index], self._rank,
                                    reduced_as_unused=index in self._unused)
        self._ready[index] = True
        self._n_ready += 1
        if self._deferring:
            self._arrival.append(index)
            self._arrived_at[index] = time.perf_counter()
            return  # reduced in finalize, once the layout is rebuilt from this order
        b, slot = self._where[index]
        bucket = self._buckets[b]
        self._fill(bucket, slot, self._params[index])
        if bucket.pending == len(bucket.params):
            bucket.first_ready_at = time.perf_counter()
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _fill(self, bucket: Bucket, slot: int, param: Tensor) -> None:
        view = bucket.views[slot]
        grad = param.grad
        div = self._div if self._hook is None else 1.0
        if grad is None:
            view.fill(0)
            return
        g = grad.array
        xp = backend.array_module(view)
        if self._as_view and same_memory(g, view):
            if div != 1.0:
                xp.divide(view, div, out=view)
            return
        if div != 1.0:
            xp.divide(g, div, out=view, casting="unsafe")
        else:
            xp.copyto(view, g, casting="unsafe")
        if self._as_view:
            grad.array = view

    def _launch_ready(self) -> None:
        buckets = self._buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].pending == 0:
            self._launch(buckets[self._next_bucket])
            self._next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched_at = time.perf_counter()
        if self._hook is None and bucket.is_last and INLINE_LAST_BUCKET:
            # Backward is over once the last bucket is ready and finalize waits for it at once:
            # reducing it here, in the caller's thread, skips a hand-off to the group's worker
            # thread (it runs inline when the earlier buckets are done).
            started = time.perf_counter()
            try:
                bucket.work = comm.all_reduce(self._group, bucket.buffer, ReduceOp.SUM)
            except CollectiveError as exc:
                bucket.work = _FailedWork(exc)  # raised with DDP's context by finalize
            # Nothing of backward is left to hide it behind: all of it is exposed waiting.
            self._inline_wait = time.perf_counter() - started
        elif self._hook is None:
            bucket.work = comm.all_reduce(self._group, bucket.buffer, ReduceOp.SUM, async_op=True)
        else:
            bucket.work = call_hook(self._hook, self._hook_state, bucket)
        on_done = getattr(bucket.work, "add_done_callback", None)
        if on_done is not None:
            on_done(functools.partial(_stamp_done, bucket))

    # ------------------------------------------------------------------ end of backward

    def _on_sentinel(self, grad: Any) -> tuple:
        if self._open:
            self.finalize()
        return (None,)

    def finalize(self) -> None:
        """Launch what is left, wait for every bucket and write the averaged gradients."""
        try:
            # Decided before learning ends: joined ranks shadow the same collectives.
            needs_used_map = self.needs_used_map
            learning = self._static and self._static_counts is None
            if not learning and self._n_ready < len(self._params):
                raise self._unfinished(at_end=True)
            if self._deferring:
                self._adopt_layout()
            if learning:
                self._finish_learning()
            if learning or self._deferring:
                self._fill_all_and_launch()
            used_work, used = self._launch_used_map(needs_used_map)
            self._wait_and_unpack(used_work, used)
            self.rounds_synced += 1
        finally:
            self._deferring = False
            self._close()

    def _finish_learning(self) -> None:
        counts = self._learn_counts
        self._static_counts = list(counts)
        self._static_unused = [i for i, c in enumerate(counts) if c == 0]

    def _fill_all_and_launch(self) -> None:
        """Reduce a round whose gradients all arrived before any bucket was filled."""
        arrived = self._arrived_at
        for bucket in self._buckets:
            for slot, i in enumerate(bucket.param_indices):
                self._ready[i] = True
                self._fill(bucket, slot, self._params[i])
            bucket.pending = 0
            # the bucket's own first gradient (in the layout just rebuilt), for the profiler
            firsts = [arrived[i] for i in bucket.param_indices if i in arrived]
            bucket.first_ready_at = min(firsts) if firsts else 0.0
        self._arrived_at = {}
        self._n_ready = len(self._params)
        self._launch_ready()

    def _launch_used_map(self, needed: bool) -> tuple[Any, Any]:
        if not needed:
            return None, None
        used = np.array([p.grad is not None for p in self._params], dtype=np.int64)
        return comm.all_reduce(self._group, used, ReduceOp.SUM, async_op=True), used

    def _wait_and_unpack(self, used_work: Any, used: Any) -> None:
        start = time.perf_counter()
        for bucket in self._buckets:
            try:
                if self._hook is None:
                    result = bucket.work.wait()
                else:
                    result = wait_bounded(bucket.work, getattr(self._group, "timeout", None))
            except CollectiveError as exc:
                raise with_ddp_context(exc, self._rank, bucket.index, len(self._buckets),
                                       self.rounds_synced + 1) from exc
            done = bucket.done_at or time.perf_counter()
            metrics.DDP_BUCKET_ALLREDUCE_SECONDS.observe(max(0.0, done - bucket.launched_at))
            if _profiler.recorder is not None:
                _profile_bucket(bucket, done)
            if self._hook is not None:
                # Any future-like result counts, not only this package's Future: its value()
                # (what torch.futures.Future.wait() returns) is the reduced buffer.
                take_hook_result(bucket, future_value(bucket.work, result))
        if used_work is not None:
            used_work.wait()
            unused_everywhere = {i for i, n in enumerate(used.tolist()) if n == 0}
            if self._static:
                self._globally_unused = unused_everywhere
        else:
            unused_everywhere = self._globally_unused
        metrics.DDP_COMM_WAIT_SECONDS.observe(time.perf_counter() - start + self._inline_wait)
        self._inline_wait = 0.0
        for bucket in self._buckets:
            for slot, i in enumerate(bucket.param_indices):
                if i in unused_everywhere:
                    continue  # no rank had a gradient: leave .grad as it was (None), as torch
                _adopt_as_grad(self._params[i], bucket.views[slot])

    # ------------------------------------------------------------------ join: shadow a round

    def shadow_backward(self) -> None:
        """On a rank that ran out of data: issue this round's collectives with zero gradients."""
        if self._may_rebuild and not self._rebuilt:
            self._adopt_layout()  # as the training ranks do at the end of their first round
        works = []
        for bucket in self._buckets:
            bucket.reset()
            # New zeros: the old buffer may hold this rank's last gradients (adopted as .grad).
            bucket.set_buffer(backend.array_module(bucket.buffer).zeros_like(bucket.buffer))
            bucket.launched_at = time.perf_counter()
            if self._hook is None:
                works.append(comm.all_reduce(self._group, bucket.buffer, async_op=True))
            else:
                works.append(self._hook(self._hook_state, GradBucket(bucket, bucket.is_last)))
        used = None
        if self.needs_used_map:
            used = np.zeros(len(self._params), dtype=np.int64)
            works.append(comm.all_reduce(self._group, used, async_op=True))
        for work in works:
            work.wait()
        if self._static and self._static_counts is None:
            # Learn what the other ranks' graph uses, so later shadows match theirs.
            self._static_counts = [1 if n else 0 for n in used.tolist()]
            self._static_unused = [i for i, c in enumerate(self._static_counts) if c == 0]
            self._globally_unused = set(self._static_unused)
        self.rounds_synced += 1

    def remove_hooks(self) -> None:
        """Unregister the gradient hooks (the DDP wrapper is being discarded)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
