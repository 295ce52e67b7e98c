"""torch.nn's multi-class margin loss modules, MultiMarginLoss, MultiLabelMarginLoss and
MultiLabelSoftMarginLoss, over losses_margin.py's functionals (apart from them, so that
functional.py importing the functionals does not import loss.py, which imports functional)."""

from __future__ import annotations

from typing import Any

from shoal.core.nn.loss import _Loss, _WeightedLoss
from shoal.core.nn.losses_margin import (
    multi_margin_loss, multilabel_margin_loss, multilabel_soft_margin_loss,
)
from shoal.core.tensor import Tensor

__all__ = ["MultiMarginLoss", "MultiLabelMarginLoss", "MultiLabelSoftMarginLoss"]


class MultiMarginLoss(_WeightedLoss):
    """Multi-class hinge loss over class scores and one target class per sample."""

    def __init__(self, p: int = 1, margin: float = 1.0, weight: Tensor | None = None,
                 size_average: Any = None, reduce: Any = None, reduction: str = "mean") -> None:
        super().__init__(weight, size_average, reduce, reduction)
        if p not in (1, 2):
            raise ValueError("only p == 1 and p == 2 supported")
        if weight is not None and weight.ndim != 1:
            raise ValueError(
                f"MultiMarginLoss: expected weight to be None or 1D tensor, got {weight.ndim}D "
                f"instead")
        self.p = p
        self.margin = margin

    def forward(self, input: Tensor, target: Tensor) -> Tensor:  # noqa: A002
        """multi_margin_loss with this module's settings."""
        return multi_margin_loss(input, target, p=self.p, margin=self.margin,
                                 weight=self.weight, reduction=self.reduction)


class MultiLabelMarginLoss(_Loss):
    """Multi-label hinge loss; each row of the target lists classes up to the first -1."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:  # noqa: A002
        """multilabel_margin_loss with this module's reduction."""
        return multilabel_margin_loss(input, target, reduction=self.reduction)


class MultiLabelSoftMarginLoss(_WeightedLoss):
    """Multi-label one-versus-all logistic loss over a 0/1 target per class."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:  # noqa: A002
        """multilabel_soft_margin_loss with this module's weight and reduction."""
        return multilabel_soft_margin_loss(input, target, weight=self.weight,
                                           reduction=self.reduction)
