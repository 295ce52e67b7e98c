"""The inputs a differentiation transform differentiates: physical leaves with every vmap level.

Under vmap the autograd graph is built on physical tensors (batch dims in front), so
differentiating a batched output with respect to an input gives per-sample gradients as long as
the input holds its own copy for every sample: an input that is the same for every sample (a
model's parameters) is first broadcast along each active level (a stride-0 view, no copy).
"""

from __future__ import annotations

from typing import Any

from shoal.core.func.batched import STATE, rewrap, unwrap_all
from shoal.core.ops import shape as shape_ops
from shoal.core.tensor import Tensor


def materialize(phys: Tensor, levels: list[int], want: list[tuple[int, int]]) -> Tensor:
    """phys (batch dims for `levels` in front) broadcast to every (level, size) in `want`."""
    present = list(levels)
    for lvl, size in want:
        if lvl in present:
            continue
        pos = sum(1 for p in present if p < lvl)
        phys = shape_ops.unsqueeze(phys, pos)
        phys = shape_ops.expand(phys, (*phys.shape[:pos], size, *phys.shape[pos + 1:]))
        present.insert(pos, lvl)
    return phys


def active_levels() -> list[tuple[int, int]]:
    """(level, batch size) of every vmap running on this thread, outermost first."""
    return [(lvl, size) for lvl, size, _ in STATE.levels]


class Leaf:
    """One differentiated input: its physical leaf tensor and the view the function gets."""

    __slots__ = ("physical", "levels", "view")

    def __init__(self, x: Any, op: str) -> None:
        if not isinstance(x, Tensor):
            raise RuntimeError(f"{op}: Expected the differentiated inputs to be Tensors, got "
                               f"{type(x).__name__}.")
        phys, levels = unwrap_all(x)
        want = active_levels()
        phys = materialize(phys, levels, want)
        if STATE.diff_depth > 0 and phys.requires_grad:
            # Nested in another transform: stay connected to its graph (a view it can see).
            leaf = shape_ops.reshape(phys, phys.shape)
        else:
            if not (phys.dtype.is_floating_point or phys.dtype.is_complex):
                raise RuntimeError(f"{op}: only Tensors of floating point dtype can require "
                                   f"gradients, got an input of dtype {phys.dtype!r}.")
            leaf = phys.detach().requires_grad_(True)
        self.physical = leaf
        self.levels = sorted(lvl for lvl, _ in want) or sorted(levels)
        self.view = rewrap(leaf, self.levels)


def as_output(t: Any, like: Leaf | None = None) -> Any:
    """A physical gradient wrapped in the levels of the leaf it belongs to."""
    return rewrap(t, like.levels) if like is not None else t
