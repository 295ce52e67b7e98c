"""DistributedDataParallel: bucketed gradient all-reduce overlapping backward, communication
hooks and Join for uneven inputs."""

from shoal.collectives.ddp.ddp import DDPError, DistributedDataParallel, Future, GradBucket

__all__ = ["DistributedDataParallel", "DDPError", "GradBucket", "Future"]
