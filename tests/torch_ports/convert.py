"""Values between torch and shoal for the ported tests that run both side by side."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shoal import core


def to_torch(value: Any) -> Any:
    """shoal tensors and dtypes (also inside lists, tuples and dicts) as torch's."""
    if isinstance(value, core.Tensor):
        return torch.from_numpy(np.array(value.detach().numpy(force=True)))
    if isinstance(value, core.dtypes.DType):
        return getattr(torch, str(value).rpartition(".")[2])
    if isinstance(value, (list, tuple)):
        return type(value)(to_torch(v) for v in value)
    if isinstance(value, dict):
        return {k: to_torch(v) for k, v in value.items()}
    return value


def to_core(value: Any, requires_grad: bool = False) -> Any:
    """torch tensors (also inside lists and tuples) as shoal's, floating ones requiring grad
    when asked."""
    if isinstance(value, torch.Tensor):
        out = core.tensor(value.detach().numpy().copy())
        if requires_grad and (value.is_floating_point() or value.is_complex()):
            out.requires_grad_(True)
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(to_core(v, requires_grad) for v in value)
    return value
