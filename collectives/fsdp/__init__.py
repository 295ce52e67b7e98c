"""Fully sharded data parallel (torch.distributed.fsdp): fully_shard and its policies."""

from shoal.collectives.fsdp.api import (
    CPUOffloadPolicy,
    FSDPError,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardedParameter,
)
from shoal.collectives.fsdp.sharded_module import FSDPModule, fully_shard, model_state_bytes
from shoal.collectives.fsdp.mesh import hybrid_mesh
from shoal.collectives.fsdp.wrapper import CPUOffload, FullyShardedDataParallel, ShardingStrategy

__all__ = ["CPUOffload", "CPUOffloadPolicy", "FSDPError", "FSDPModule",
           "FullyShardedDataParallel", "MixedPrecisionPolicy", "OffloadPolicy",
           "ShardedParameter", "ShardingStrategy", "fully_shard", "hybrid_mesh",
           "model_state_bytes"]
