"""fully_shard's vocabulary: its policies, its error and the sharded parameter type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from shoal.core import dtypes
from shoal.core.errors import ShoalError
from shoal.core.nn.parameter import Parameter
from shoal.core.tensor import Tensor

__all__ = ["CPUOffloadPolicy", "FSDPError", "MixedPrecisionPolicy", "OffloadPolicy",
           "ShardedParameter"]


class FSDPError(ShoalError, RuntimeError):
    """fully_shard misused: a module sharded twice, a parameter in two groups, a bad policy."""


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the gathered parameters and of the gradient reduction (None: the parameter's).

    param_dtype: the dtype forward and backward compute in (parameters are gathered in it).
    reduce_dtype: the dtype gradients are reduce-scattered in.
    output_dtype: floating outputs of the module are cast to it.
    cast_forward_inputs: cast floating inputs to param_dtype before forward.
    """

    param_dtype: Optional[Any] = None
    reduce_dtype: Optional[Any] = None
    output_dtype: Optional[Any] = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not dtypes.get(value).is_floating_point:
                raise FSDPError(f"MixedPrecisionPolicy.{name} must be a floating dtype, got "
                                f"{value!r}.")

    def np_dtype(self, name: str, default: np.dtype) -> np.dtype:
        """The numpy dtype of `name` ("param_dtype", ...), or `default` when it is None."""
        value = getattr(self, name)
        return default if value is None else dtypes.get(value).np


@dataclass(frozen=True)
class OffloadPolicy:
    """No offload: shards stay where the module's parameters are (torch's default policy)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep parameter shards, their gradients and so the optimizer state in host memory. shoal
    shards host parameters only, where this is what happens anyway; the policy is accepted so
    that torch's scripts run (pin_memory too: host arrays here are ordinary numpy memory)."""

    pin_memory: bool = True


class ShardedParameter(Parameter):
    """This rank's flat shard of a parameter: elements [shard_offset, shard_offset +
    shard_numel) of the flattened global parameter, padded with zeros to the group's chunk."""

    __slots__ = ("global_shape", "shard_offset", "shard_numel", "group")

    def to_local(self) -> Tensor:
        """The shard's valid elements (without padding) as a flat Tensor sharing memory."""
        return Tensor(self.array[:self.shard_numel])

    def full_tensor(self) -> Any:
        """The whole parameter, gathered from every rank (a collective: all ranks call it)."""
        chunk = self.array.size
        out = np.empty(chunk * self.group.size(), dtype=self.array.dtype)
        self.group.all_gather_into_tensor(out, np.ascontiguousarray(self.array)).wait()
        numel = int(np.prod(self.global_shape, dtype=np.int64))
        return Tensor(out[:numel].reshape(self.global_shape).copy())
