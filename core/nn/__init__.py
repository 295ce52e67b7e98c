"""Neural-network building blocks with torch.nn's names: Module, Parameter, layers, containers."""

from core.nn import functional, init
from core.nn.containers import ModuleList, Sequential
from core.nn.layers import (
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
from core.nn.module import IncompatibleKeys, Module, RemovableHandle, StateDictError
from core.nn.parameter import Parameter

__all__ = [
    "GELU", "Dropout", "Embedding", "Identity", "IncompatibleKeys", "LayerNorm", "Linear",
    "Module", "ModuleList", "Parameter", "ReLU", "RemovableHandle", "Sequential", "Sigmoid",
    "StateDictError", "Tanh", "functional", "init",
]
