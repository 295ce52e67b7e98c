"""Learning-rate schedulers with torch.optim.lr_scheduler's names and chainable semantics."""

from shoal.core.optim.lr_scheduler.base import LRScheduler, SchedulerError
from shoal.core.optim.lr_scheduler.basic import (
    ConstantLR,
    CosineAnnealingLR,
    ExponentialLR,
    LambdaLR,
    LinearLR,
    MultiStepLR,
    PolynomialLR,
    StepLR,
)
from shoal.core.optim.lr_scheduler.compose import ChainedScheduler, SequentialLR
from shoal.core.optim.lr_scheduler.cyclic import CosineAnnealingWarmRestarts, OneCycleLR
from shoal.core.optim.lr_scheduler.plateau import ReduceLROnPlateau

__all__ = [
    "ChainedScheduler", "ConstantLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts",
    "ExponentialLR", "LRScheduler", "LambdaLR", "LinearLR", "MultiStepLR", "OneCycleLR",
    "PolynomialLR", "ReduceLROnPlateau", "SchedulerError", "SequentialLR", "StepLR",
]
