"""Optimizers (SGD, Adam, AdamW) and learning-rate schedulers, with torch's names and semantics."""

from shoal.core.optim import lr_scheduler
from shoal.core.optim.adam import Adam, AdamW
from shoal.core.optim.optimizer import Optimizer, OptimizerError
from shoal.core.optim.sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "OptimizerError", "lr_scheduler"]
