"""`FullyShardedDataParallel(module)`: torch's older wrapper spelling, built on fully_shard.

The wrapper shards the modules `auto_wrap_policy` picks (a set of module classes, as torch's
ModuleWrapPolicy holds, or torch's function policy `fn(module, recurse, nonwrapped_numel)`),
children before parents, then the whole module as the root, and forwards calls to it. Its
parameters are the flat shards (torch's use_orig_params=True view of them), so an optimizer
built on `fsdp.parameters()` steps the shards.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Iterable, Optional

from shoal.collectives.fsdp.api import (
    CPUOffloadPolicy,
    FSDPError,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from shoal.collectives.fsdp.sharded_module import fully_shard
from shoal.collectives.world import member_group
from shoal.core.nn.module import Module

__all__ = ["CPUOffload", "FullyShardedDataParallel", "ShardingStrategy"]


class ShardingStrategy(enum.Enum):
    """torch's strategies: what is sharded and over which ranks."""

    FULL_SHARD = 1  # parameters, gradients and optimizer state; params freed after forward
    SHARD_GRAD_OP = 2  # the same, but parameters stay gathered from forward to backward
    NO_SHARD = 3
    HYBRID_SHARD = 4  # FULL_SHARD within a host, replicas across hosts
    _HYBRID_SHARD_ZERO2 = 5


class CPUOffload:
    """torch's FSDP1 offload flag: offload_params=True keeps shards in host memory."""

    def __init__(self, offload_params: bool = False) -> None:
        self.offload_params = offload_params


class FullyShardedDataParallel(Module):
    """Shards `module` with fully_shard (per `auto_wrap_policy`, then the root) and runs it."""

    def __init__(self, module: Module, process_group: Any = None,
                 sharding_strategy: Optional[ShardingStrategy] = None,
                 cpu_offload: Optional[CPUOffload] = None,
                 auto_wrap_policy: Optional[Iterable[type] | Callable] = None,
                 mixed_precision: Any = None, sync_module_states: bool = False,
                 use_orig_params: bool = True, **kwargs: Any) -> None:
        super().__init__()
        strategy = sharding_strategy or ShardingStrategy.FULL_SHARD
        if strategy is ShardingStrategy.NO_SHARD:
            raise FSDPError("ShardingStrategy.NO_SHARD is DistributedDataParallel: use it.")
        hybrid = "HYBRID" in strategy.name
        if hybrid and not isinstance(process_group, (tuple, list)):
            raise FSDPError("HYBRID_SHARD needs process_group=(intra_host_group, "
                            "inter_host_group), as torch's does.")
        mesh = (process_group[1], process_group[0]) if hybrid else process_group
        if sync_module_states:
            _broadcast_from_zero(module, process_group[0] if hybrid else process_group)
        options = {
            "mesh": mesh,
            "reshard_after_forward": strategy in (ShardingStrategy.FULL_SHARD,
                                                  ShardingStrategy.HYBRID_SHARD),
            "mp_policy": _mp_policy(mixed_precision),
            "offload_policy": CPUOffloadPolicy() if cpu_offload is not None and
            cpu_offload.offload_params else OffloadPolicy(),
        }
        for sub in reversed(list(module.modules())):  # children before their parents
            if sub is not module and _picked(auto_wrap_policy, sub):
                fully_shard(sub, **options)
        self.module = fully_shard(module, **options)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward."""
        return self.module(*args, **kwargs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Any:
        """Clip by the whole model's gradient norm across ranks (a collective)."""
        return self.module.clip_grad_norm_(max_norm, norm_type)


def _picked(policy: Any, module: Module) -> bool:
    if policy is None:
        return False
    if callable(policy) and not isinstance(policy, type):
        numel = sum(p.numel() for p in module.parameters())
        return bool(policy(module=module, recurse=False, nonwrapped_numel=numel))
    classes = tuple(getattr(policy, "_module_classes", policy))
    return isinstance(module, classes)


def _mp_policy(mixed_precision: Any) -> MixedPrecisionPolicy:
    if mixed_precision is None:
        return MixedPrecisionPolicy()
    if isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    return MixedPrecisionPolicy(param_dtype=getattr(mixed_precision, "param_dtype", None),
                                reduce_dtype=getattr(mixed_precision, "reduce_dtype", None))


def _broadcast_from_zero(module: Module, group: Any) -> None:
    """Give every rank rank 0's parameters and buffers (torch's sync_module_states)."""
    pg = member_group(group)
    for tensor in list(module.parameters()) + list(module.buffers()):
        pg.broadcast(tensor.array, 0).wait()
