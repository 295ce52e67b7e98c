"""torch.utils's training helpers: activation checkpointing (core.utils.checkpoint)."""

from shoal.core.utils import checkpoint

__all__ = ["checkpoint"]
