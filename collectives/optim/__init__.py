"""Distributed optimizers over process groups (torch.distributed.optim)."""

from shoal.collectives.optim.ddp_zero_hook import hook_with_zero_step
from shoal.collectives.optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer", "hook_with_zero_step"]
