"""Fully sharded data parallel (torch.distributed.fsdp): fully_shard and its policies."""

from shoal.collectives.fsdp.api import (
    CPUOffloadPolicy,
    FSDPError,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardedParameter,
)
from shoal.collectives.fsdp.fully_shard import FSDPModule, fully_shard, model_state_bytes

__all__ = ["CPUOffloadPolicy", "FSDPError", "FSDPModule", "MixedPrecisionPolicy",
           "OffloadPolicy", "ShardedParameter", "fully_shard", "model_state_bytes"]
