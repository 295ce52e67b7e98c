"""Optimizers (SGD, Adam, AdamW) and learning-rate schedulers, with torch's names and semantics."""

from core.optim import lr_scheduler
from core.optim.adam import Adam, AdamW
from core.optim.optimizer import Optimizer, OptimizerError
from core.optim.sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "OptimizerError", "lr_scheduler"]
