"""Neural-network building blocks with torch.nn's names: Module, Parameter, layers, containers."""

from shoal.core.nn import functional
from shoal.core.nn import init
from shoal.core.nn.containers import ModuleList, Sequential
from shoal.core.nn.layers import (
    GELU,
    Dropout,
    Embedding,
    Identity,
    LayerNorm,
    Linear,
    ReLU,
    Sigmoid,
    Tanh,
)
from shoal.core.nn.module import IncompatibleKeys, Module, RemovableHandle, StateDictError
from shoal.core.nn.parameter import Parameter

__all__ = [
    "GELU", "Dropout", "Embedding", "Identity", "IncompatibleKeys", "LayerNorm", "Linear",
    "Module", "ModuleList", "Parameter", "ReLU", "RemovableHandle", "Sequential", "Sigmoid",
    "StateDictError", "Tanh", "functional", "init",
]
