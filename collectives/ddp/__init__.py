"""DistributedDataParallel: bucketed gradient all-reduce overlapping backward, communication
hooks and Join for uneven inputs."""

from shoal.collectives.ddp.ddp import DDPError, DistributedDataParallel, Future, GradBucket
from shoal.collectives.ddp.powersgd_hook import PowerSGDState, powerSGD_hook

__all__ = ["DistributedDataParallel", "DDPError", "GradBucket", "Future", "PowerSGDState",
           "powerSGD_hook"]
