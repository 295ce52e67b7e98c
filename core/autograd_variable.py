"""torch.autograd.Variable: since torch 0.4 every tensor is a Variable, and the name survives
in older code as a no-op wrapper (`Variable(t)`, `Variable(t, requires_grad=True)`,
`isinstance(t, Variable)`). Here it is the same: the call hands the tensor back."""

from __future__ import annotations

from typing import Any

__all__ = ["Variable"]


class _VariableMeta(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        from shoal.core.tensor import Tensor  # noqa: PLC0415 - core.autograd loads before tensors

        return isinstance(instance, Tensor)


class Variable(metaclass=_VariableMeta):
    """`Variable(t, requires_grad=False, volatile=False)`: t itself (requires_grad set when asked)."""

    def __new__(cls, data: Any = None, requires_grad: bool = False, volatile: bool = False) -> Any:
        from shoal.core.tensor import Tensor  # noqa: PLC0415

        if not isinstance(data, Tensor):
            raise TypeError(f"Variable data has to be a tensor, but got {type(data).__name__}")
        if requires_grad:
            data.requires_grad_(True)
        return data
