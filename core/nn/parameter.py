"""`Parameter`: a leaf Tensor with requires_grad=True that Module registers on assignment."""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.core.tensor import Tensor


class Parameter(Tensor):
    """A Tensor a Module owns as a trainable weight; shares `data`'s array when given a Tensor."""

    __slots__ = ()

    def __init__(self, data: Any = None, requires_grad: bool = True) -> None:
        if data is None:
            data = np.empty((0,), dtype=np.float32)
        if isinstance(data, Tensor):
            data = data.array
        super().__init__(data, requires_grad=requires_grad)

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()

    def __deepcopy__(self, memo: dict) -> "Parameter":
        copied = Parameter(self.array.copy(), requires_grad=self.requires_grad)
        if self.grad is not None:
            copied.grad = Tensor(self.grad.array.copy())
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (Parameter, (self.array, self.requires_grad))
