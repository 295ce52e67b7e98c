"""BatchedTensor: a tensor under vmap, holding the whole batch with the batch dim in front.

A BatchedTensor at level L wraps `value` (a plain Tensor, or a BatchedTensor of an outer,
lower level) whose dim 0 is level L's batch; the function vmap runs sees only the other dims
(the logical shape). Ops reach it through core/func/dispatch.py, whose per-op rules
(core/func/rules.py) rewrite the op on the logical shape into one op on the value: a single
numpy call for the whole batch. Nested vmaps nest wrappers, so a rule handles one batch dim, and
the innermost value (the physical tensor) holds every level's dim in level order.

The physical tensors are ordinary tensors: the autograd graph that ops record is built on them,
which is what lets grad/vjp inside vmap (core/func/autodiff.py) produce per-sample results.
"""

from __future__ import annotations

import threading
from typing import Any

from shoal.core.tensor import Tensor

_new = object.__new__


class VmapState(threading.local):
    """The vmap levels active on this thread, innermost last: (level, batch size, randomness)."""

    def __init__(self) -> None:
        self.levels: list[tuple[int, int, str]] = []
        self.next_level = 1
        # Set by core.func.grad/vjp while the function they differentiate runs with no graph
        # wanted of the gradient (first order): rules may then use array-level backwards.
        self.first_order = False
        # How many differentiation transforms are running on this thread: an inner one must
        # keep its gradient's graph so that the outer one can differentiate it.
        self.diff_depth = 0


STATE = VmapState()


def data_dependent_error(what: str) -> RuntimeError:
    """torch's refusal of Python control flow on a batched value."""
    return RuntimeError(
        f"vmap: It looks like you're calling {what} on a Tensor inside vmap: the function sees "
        "one sample's logical tensor, but its data holds the whole batch, so a Python value "
        "cannot be taken from it. Use core.where (or masking) instead of data-dependent "
        "control flow."
    )


class BatchedTensor(Tensor):
    """A tensor inside vmap: the logical per-sample view of a batched value."""

    __slots__ = ("_value", "_level")

    @property  # type: ignore[override]
    def array(self) -> Any:
        """Refused: an op that reads the data directly has no batching rule."""
        raise NotImplementedError(
            "vmap: code read the data of a batched tensor directly: a function outside core's "
            "registered ops (core/func/rules*.py list the ops vmap supports) reached `.array`; "
            "compute it outside vmap or with supported ops."
        )

    @property
    def shape(self) -> tuple:
        """The logical (per-sample) shape."""
        return tuple(self._value.shape[1:])

    @property
    def dtype(self) -> Any:
        """The element type."""
        return self._value.dtype

    @property
    def device(self) -> Any:
        """Where the data lives."""
        return self._value.device

    @property
    def ndim(self) -> int:
        """The logical number of dims."""
        return self._value.ndim - 1

    @property  # type: ignore[override]
    def requires_grad(self) -> bool:
        """Whether the batched value is tracked by autograd."""
        return self._value.requires_grad

    @property  # type: ignore[override]
    def grad_fn(self) -> Any:
        """The batched value's node."""
        return self._value.grad_fn

    @property  # type: ignore[override]
    def grad(self) -> Any:
        """Always None: gradients under vmap come from core.func.grad, not .grad."""
        return None

    def dim(self) -> int:
        """The logical number of dims."""
        return self.ndim

    def size(self, dim: int | None = None) -> Any:
        """The logical shape, or one logical dim's length."""
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        """Elements per sample."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __iter__(self) -> Any:
        if not self.shape:
            raise TypeError("iteration over a 0-d tensor")
        return (self[i] for i in range(self.shape[0]))

    def item(self) -> Any:
        """Refused, as torch refuses it under vmap."""
        raise data_dependent_error(".item()")

    def tolist(self) -> Any:
        """Refused under vmap."""
        raise data_dependent_error(".tolist()")

    def numpy(self, force: bool = False) -> Any:
        """Refused under vmap."""
        raise data_dependent_error(".numpy()")

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        raise data_dependent_error("numpy conversion")

    def __bool__(self) -> bool:
        raise data_dependent_error("bool() (an if or while on a tensor)")

    def __float__(self) -> float:
        raise data_dependent_error("float()")

    def __int__(self) -> int:
        raise data_dependent_error("int()")

    def __index__(self) -> int:
        raise data_dependent_error("an index conversion")

    def __repr__(self) -> str:
        return f"BatchedTensor(lvl={self._level}, bdim=0, value=\n{self._value!r})"

    def detach(self) -> "BatchedTensor":
        """The batched value cut from the graph."""
        return batched(self._value.detach(), self._level)

    def backward(self, *args: Any, **kwargs: Any) -> None:
        """Refused: use core.func.grad or vjp inside vmap."""
        raise RuntimeError("vmap: backward() on a batched tensor is not supported; use "
                           "core.func.grad or core.func.vjp inside vmap instead.")


def batched(value: Any, level: int) -> BatchedTensor:
    """Wrap `value` (batch dim in front) as a BatchedTensor at `level`."""
    out = _new(BatchedTensor)
    out._value = value  # noqa: SLF001 - BatchedTensor's constructor
    out._level = level  # noqa: SLF001
    return out


def level_of(x: Any) -> int | None:
    """x's vmap level, or None for an unbatched value."""
    return x._level if isinstance(x, BatchedTensor) else None  # noqa: SLF001


def value_of(x: BatchedTensor) -> Any:
    """The batched value (batch dim in front) a BatchedTensor wraps."""
    return x._value  # noqa: SLF001


def unwrap_all(x: Any) -> tuple[Any, list[int]]:
    """(physical tensor, its batch levels in dim order) for a tensor under any number of vmaps.

    The levels ascend: an outer vmap's dim comes first (rules put a level's dim at the front of
    its wrapper's value, which is itself the logical view of the outer levels)."""
    levels = []
    while isinstance(x, BatchedTensor):
        levels.append(x._level)  # noqa: SLF001
        x = x._value  # noqa: SLF001
    levels.reverse()
    return x, levels


def rewrap(physical: Any, levels: list[int]) -> Any:
    """The BatchedTensor nesting that unwrap_all took apart."""
    out = physical
    for level in levels:
        out = batched(out, level)
    return out
