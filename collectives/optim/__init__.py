"""Distributed optimizers over process groups (torch.distributed.optim)."""

from shoal.collectives.optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer"]
