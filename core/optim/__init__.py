"""Optimizers and learning-rate schedulers, with torch's names and semantics."""

from shoal.core.optim import lr_scheduler
from shoal.core.optim.adam import Adam, AdamW
from shoal.core.optim.adam_variants import Adamax, NAdam, RAdam
from shoal.core.optim.adaptive import Adadelta, Adagrad, RMSprop, Rprop
from shoal.core.optim.asgd import ASGD
from shoal.core.optim.lbfgs import LBFGS
from shoal.core.optim.optimizer import Optimizer, OptimizerError
from shoal.core.optim.sgd import SGD

__all__ = [
    "ASGD", "LBFGS", "SGD", "Adadelta", "Adagrad", "Adam", "AdamW", "Adamax", "NAdam", "Optimizer",
    "OptimizerError", "RAdam", "RMSprop", "Rprop", "lr_scheduler",
]
