"""DistributedDataParallel: data-parallel training of a core.nn.Module across a process group.

Every rank holds a replica of the module and feeds it its own shard of the batch; during
backward the reducer (`collectives.ddp.reducer`) averages the gradients bucket by bucket, each
bucket's all_reduce overlapping the rest of backward, so that after `loss.backward()` every
replica holds the same averaged `.grad` and the optimizer steps keep the replicas identical.
Behaviour and names follow torch.nn.parallel.DistributedDataParallel.
"""

from __future__ import annotations

import contextlib
import json
import logging
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from shoal.collectives import amp
from shoal.collectives.ddp import comm
from shoal.collectives.ddp.buckets import DEFAULT_FIRST_BUCKET_BYTES, MIB, GradBucket
from shoal.collectives.ddp.comm_hooks import BuiltinCommHookType, builtin_hook
from shoal.collectives.ddp.errors import DDPError
from shoal.collectives.ddp.future import Future
from shoal.collectives.ddp.join import Join, JoinHook, Joinable
from shoal.collectives.ddp.reducer import Reducer
from shoal.collectives.types import ReduceOp
from shoal.core import kernels, nn
from shoal.core.autograd import is_grad_enabled
from shoal.core.tensor import Tensor

log = logging.getLogger(__name__)

__all__ = ["DistributedDataParallel", "DDPError", "GradBucket", "Future"]

DEFAULT_BUCKET_CAP_MB = 25  # torch's


class DistributedDataParallel(nn.Module, Joinable):
    """Wrap `module` so that backward averages its gradients across `process_group`.

    The arguments are torch's, in torch's order, so positional arguments mean what they do there:

    Args:
        module: the model; every rank must build it with the same parameters in the same order.
        device_ids: None or [] for a model on the host; [i] (or [device]) for a model on CUDA
            device i, which must be where its parameters are.
        output_device: where outputs go; a single-device model's outputs stay where they are
            computed, so this must be None or that device.
        dim: the dimension torch scatters inputs along across several devices of one process;
            shoal drives one device per process, so it is only recorded.
        broadcast_buffers: copy rank 0's buffers to every rank at the start of each forward.
        init_sync: broadcast rank 0's parameters and buffers at construction (False: each rank
            keeps its own, as torch).
        process_group: the group to reduce over (the default group when None).
        bucket_cap_mb: the size of a gradient bucket in MiB (None: 25; the first bucket holds
            1 MiB at most, so its all_reduce starts early in backward).
        find_unused_parameters: search each forward's graph for parameters it did not reach,
            and reduce those as zeros.
        check_reduction: ignored (deprecated in torch too).
        gradient_as_bucket_view: make each `.grad` a view into its bucket (saves memory and a
            copy per parameter).
        static_graph: the graph is the same every iteration: learn it in the first one, then
            allow reentrant backward (a parameter's hook firing several times) and skip the
            search for unused parameters.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Optional[Sequence[Any]] = None,
        output_device: Optional[Any] = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        init_sync: bool = True,
        process_group: Optional[Any] = None,
        bucket_cap_mb: Optional[float] = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ) -> None:
        nn.Module.__init__(self)
        Joinable.__init__(self)
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"DistributedDataParallel wraps a core.nn.Module, got {type(module).__name__}."
            )
        bucket_cap_mb = _checked_bucket_cap(bucket_cap_mb)
        self.device_ids, self.output_device = _check_devices(module, device_ids, output_device)
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"dim must be an int, got {type(dim).__name__}.")
        self.dim = dim
        self.module = module
        group = comm.resolve(process_group)
        # Plain attributes set through object.__setattr__ stay out of Module's registries.
        object.__setattr__(self, "process_group", group)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.static_graph = bool(static_graph)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.bucket_bytes_cap = max(1, int(bucket_cap_mb * MIB))
        self.require_backward_grad_sync = True
        self._rank = comm.rank(group)
        self._world = comm.size(group)
        self._divide_by_initial_world_size = True

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise DDPError(
                "DistributedDataParallel is not needed when a module has no parameter that "
                "requires a gradient."
            )
        self._param_names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._buffers_list = [b for _, b in module.named_buffers()]
        self._verify_same_parameters(named)
        if init_sync:
            self._broadcast_arrays([p.array for p in module.parameters()] + [
                b.array for b in self._buffers_list
            ], src=0)
        first = min(DEFAULT_FIRST_BUCKET_BYTES, self.bucket_bytes_cap)
        reducer = Reducer(
            self._params,
            self._param_names,
            group,
            bucket_limits=[first, self.bucket_bytes_cap],
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
        )
        object.__setattr__(self, "reducer", reducer)
        self._agree_found_inf(group)

    def _agree_found_inf(self, group: Any) -> None:
        """Make a GradScaler stepping these parameters agree its inf/NaN verdict over `group`.

        Every replica then skips the same steps even when an overflow sits in a gradient DDP
        does not reduce. Inside a Join block it stays local (a rank that ran out of data no
        longer steps, so a collective there would wait for it). The registry must not keep this
        wrapper alive: it sees it through a weak reference, and its entries go with it.
        """
        me = weakref.ref(self)

        def joining() -> bool:
            ddp = me()
            return ddp is not None and ddp.join_config.enable

        handle = amp.agree_for_replicas(self._params, group, paused=joining)
        object.__setattr__(self, "_found_inf_agreement", handle)
        weakref.finalize(self, handle.remove)

    # ------------------------------------------------------------------ construction checks

    def _verify_same_parameters(self, named: Sequence[tuple[str, Tensor]]) -> None:
        """Every rank learns every rank's parameter list; all raise on the first difference."""
        mine = [[n, list(p.array.shape), str(p.array.dtype)] for n, p in named]
        blob = np.frombuffer(json.dumps(mine).encode(), dtype=np.uint8)
        length = np.array([blob.size], dtype=np.int64)
        comm.all_reduce(self.process_group, length, ReduceOp.MAX)
        table = np.zeros((self._world, int(length[0]) + 1), dtype=np.int64)
        table[self._rank, 0] = blob.size
        table[self._rank, 1 : blob.size + 1] = blob
        comm.all_reduce(self.process_group, table, ReduceOp.SUM)
        lists = [
            json.loads(row[1 : int(row[0]) + 1].astype(np.uint8).tobytes()) for row in table
        ]
        reference = lists[0]
        for other_rank in range(1, self._world):
            problem = _first_difference(reference, lists[other_rank], other_rank)
            if problem:
                raise DDPError(
                    "DistributedDataParallel expects the same parameters, with the same shapes "
                    f"and dtypes in the same order, on every rank, but {problem} Build the same "
                    f"model on every rank (seen from rank {self._rank})."
                )

    def _broadcast_arrays(self, arrays: Sequence[Any], src: int) -> None:
        """Overwrite `arrays` with rank `src`'s values: one broadcast per dtype, coalesced.

        Packing and unpacking are core.kernels' flatten/unflatten: one kernel launch each for
        arrays on a CUDA device (whatever their number), numpy copies on the host.
        """
        by_dtype: dict[Any, list] = {}
        for arr in arrays:
            by_dtype.setdefault((arr.dtype, type(arr)), []).append(arr)
        for (dtype, _), group in sorted(by_dtype.items(), key=lambda kv: str(kv[0][0])):
            flat = kernels.flatten(group)
            comm.broadcast(self.process_group, flat, src=src)
            if self._rank != src:
                kernels.unflatten(flat, group)

    # ------------------------------------------------------------------ forward

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module; with grad on, prepare this rank to reduce the gradients of backward."""
        grad_on = is_grad_enabled()
        sync = grad_on and self.require_backward_grad_sync
        reducer = self.reducer
        if grad_on:
            reducer.check_prior_round()
        divide_by = self._world
        sync_buffers = sync and self.broadcast_buffers and bool(self._buffers_list)
        authoritative = 0
        if grad_on and self._join_config.enable:
            remaining = Join.notify_join_context(self)
            if remaining is not None and not self._divide_by_initial_world_size:
                divide_by = remaining
            flags = np.array([int(sync), self._rank, int(sync_buffers)], np.int64)
            comm.all_reduce(self.process_group, flags, ReduceOp.MAX)
            authoritative = int(flags[1])  # the highest rank still training
        if sync_buffers:
            self._sync_buffers(authoritative)
        if sync:
            reducer.open_round(divide_by)
        outputs = self.module(*inputs, **kwargs)
        if sync:
            outputs = reducer.attach(outputs)
        return outputs

    # ------------------------------------------------------------------ public extras

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within this block, backward accumulates gradients locally without communicating."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: Callable[[Any, GradBucket], Future]) -> None:
        """Reduce each bucket with `hook(state, bucket)`, which returns a Future of the result.

        The Future's value is the bucket's reduced flat buffer (averaged: the built-in
        all_reduce divides by the world size, a hook does its own division). Call it once,
        before the first forward. See `collectives.ddp.comm_hooks` for the built-in hooks.
        """
        if not callable(hook):
            raise TypeError(f"register_comm_hook needs a callable hook, got {type(hook).__name__}.")
        self.reducer.register_comm_hook(state, hook)

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """Reduce with a built-in hook by its `BuiltinCommHookType` (ALLREDUCE, FP16_COMPRESS),
        as torch's; it reduces over this module's process group."""
        if not isinstance(comm_hook_type, BuiltinCommHookType):
            raise TypeError(
                "_register_builtin_comm_hook needs a collectives.BuiltinCommHookType, got "
                f"{comm_hook_type!r}."
            )
        self.register_comm_hook(self.process_group, builtin_hook(comm_hook_type))

    @property
    def bucket_indices(self) -> list[list[int]]:
        """Parameter indices (in module order) of each gradient bucket, in launch order."""
        return self.reducer.bucket_indices

    # ------------------------------------------------------------------ Joinable

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """A Join context for uneven inputs across ranks: `with ddp.join(): for b in data: ...`.

        divide_by_initial_world_size: average over the initial world size even when fewer ranks
        still train (joined ranks contribute zeros); False averages over the ranks still
        training. throw_on_early_termination: raise on every rank as soon as one runs out.
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook a joined rank runs to shadow this module's collectives."""
        divide = kwargs.get("divide_by_initial_world_size", True)
        self._divide_by_initial_world_size = bool(divide)
        return _DDPJoinHook(self.process_group, self.reducer, self._sync_buffers,
                            self._sync_final_model)

    @property
    def join_device(self) -> Any:
        """The device of the parameters."""
        return self._params[0].device

    @property
    def join_process_group(self) -> Any:
        """The process group gradients are reduced over."""
        return self.process_group

    def _sync_buffers(self, src: int) -> None:
        """Overwrite every buffer with rank `src`'s."""
        self._broadcast_arrays([b.array for b in self._buffers_list], src=src)

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        # The last rank to join trained longest and holds the final model; copy it everywhere.
        source = np.array([self._rank if is_last_joiner else -1], dtype=np.int64)
        comm.all_reduce(self.process_group, source, ReduceOp.MAX)
        self._broadcast_arrays(
            [p.array for p in self.module.parameters()] + [b.array for b in self._buffers_list],
            src=int(source[0]),
        )


def _checked_bucket_cap(bucket_cap_mb: Optional[float]) -> float:
    """`bucket_cap_mb`, None meaning torch's default.

    Raises:
        ValueError: not a positive number.
    """
    if bucket_cap_mb is None:
        return DEFAULT_BUCKET_CAP_MB
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not (
        bucket_cap_mb > 0
    ):
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}.")
    return bucket_cap_mb


def _check_devices(module: nn.Module, device_ids: Optional[Sequence[Any]],
                   output_device: Optional[Any]) -> tuple[Optional[list], Optional[Any]]:
    """torch's rule: device_ids and output_device name the one device of a CUDA model and are
    None (or empty) for a host model."""
    devices = {str(p.device) for p in module.parameters()}
    ids = None if device_ids is None else list(device_ids)
    on_host = devices <= {"cpu"}
    if ids and len(ids) != 1:
        raise ValueError(
            f"device_ids must name the one device of this process's model, got {ids}; shoal "
            "drives one device per process (start one process per GPU)."
        )

    def as_name(d: Any) -> str:
        return f"cuda:{d}" if isinstance(d, int) and not isinstance(d, bool) else str(d)

    if on_host and (ids or output_device is not None):
        raise ValueError(
            "DistributedDataParallel device_ids and output_device arguments only work with a "
            f"model on a CUDA device, but got device_ids {device_ids}, output_device "
            f"{output_device}, and module parameters on {sorted(devices)}."
        )
    if ids and {as_name(ids[0])} != devices:
        raise ValueError(
            f"device_ids {ids} do not name the device of the model's parameters, {sorted(devices)}."
        )
    if output_device is not None and {as_name(output_device)} != devices:
        raise ValueError(
            f"output_device {output_device!r} must be the model's device, {sorted(devices)}."
        )
    return (ids or None), output_device


class _DDPJoinHook(JoinHook):
    """Shadows one DDP iteration on a rank that has run out of data.

    It is handed the wrapper's group, reducer and its two synchronising steps rather than the
    wrapper, so it needs none of the wrapper's private state.
    """

    def __init__(self, group: Any, reducer: Reducer, sync_buffers: Callable[[int], None],
                 sync_final_model: Callable[[bool], None]) -> None:
        self._group = group
        self._reducer = reducer
        self._sync_buffers = sync_buffers
        self._sync_final_model = sync_final_model

    def main_hook(self) -> None:
        """Match the forward's control all_reduce and buffer broadcast, then backward's."""
        flags = np.array([0, -1, 0], dtype=np.int64)
        comm.all_reduce(self._group, flags, ReduceOp.MAX)
        sync, authoritative, sync_buffers = (int(x) for x in flags)
        if sync_buffers:
            self._sync_buffers(authoritative)
        if sync:
            self._reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Make every replica equal to the last joiner's."""
        self._sync_final_model(is_last_joiner)


def _first_difference(reference: list, other: list, other_rank: int) -> str:
    """A sentence naming the first parameter where `other` differs from rank 0's list, or ''."""
    for index, (ref, oth) in enumerate(zip(reference, other)):
        if ref[1] != oth[1] or ref[2] != oth[2]:
            return (
                f"rank {other_rank} differs from rank 0 at parameter {index}: rank 0 has "
                f"{ref[0]!r} of shape {tuple(ref[1])} and dtype {ref[2]}, rank {other_rank} has "
                f"{oth[0]!r} of shape {tuple(oth[1])} and dtype {oth[2]}."
            )
    if len(reference) != len(other):
        longer, rank_longer = (reference, 0) if len(reference) > len(other) else (other, other_rank)
        extra = longer[min(len(reference), len(other))]
        return (
            f"rank {other_rank} has {len(other)} parameters and rank 0 has {len(reference)}: "
            f"parameter {min(len(reference), len(other))} ({extra[0]!r} of shape "
            f"{tuple(extra[1])}) exists only on rank {rank_longer}."
        )
    return ""
