"""Loss modules with torch.nn's names (MSELoss, CrossEntropyLoss, NLLLoss, L1Loss, SmoothL1Loss)
over the functionals."""

from __future__ import annotations

from typing import Any

from shoal.core.nn import functional as F
from shoal.core.nn import losses_functional as _losses
from shoal.core.nn.module import Module
from shoal.core.tensor import Tensor

_REDUCTIONS = ("mean", "sum", "none")


class _Loss(Module):
    """A loss with a `reduction` ('mean', 'sum' or 'none'), checked when it is built."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(
                f"{type(self).__name__}: reduction must be one of {_REDUCTIONS}, got {reduction!r}."
            )
        self.reduction = reduction

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}" if self.reduction != "mean" else ""


class _WeightedLoss(_Loss):
    """A loss with optional per-class weights, kept as a buffer (in state_dict) as torch does."""

    def __init__(self, weight: Tensor | None = None, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.register_buffer("weight", weight)


class MSELoss(_Loss):
    """Mean (or summed, or elementwise) squared error between input and target."""

    def forward(self, input: Tensor, target: Any) -> Tensor:  # noqa: A002 - torch's name
        return F.mse_loss(input, target, reduction=self.reduction)


class NLLLoss(_WeightedLoss):
    """Negative log likelihood of log-probabilities (log_softmax output) and class indices."""

    def __init__(
        self, weight: Tensor | None = None, ignore_index: int = -100, reduction: str = "mean"
    ) -> None:
        super().__init__(weight, reduction)
        self.ignore_index = ignore_index

    def forward(self, input: Tensor, target: Any) -> Tensor:  # noqa: A002
        return F.nll_loss(
            input, target, weight=self.weight, ignore_index=self.ignore_index,
            reduction=self.reduction,
        )


class CrossEntropyLoss(_WeightedLoss):
    """log_softmax then NLL over dim 1, with class indices or class probabilities as targets."""

    def __init__(
        self, weight: Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__(weight, reduction)
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(
                f"CrossEntropyLoss: label_smoothing must be in [0, 1], got {label_smoothing}."
            )
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing

    def forward(self, input: Tensor, target: Any) -> Tensor:  # noqa: A002
        return F.cross_entropy(
            input, target, weight=self.weight, ignore_index=self.ignore_index,
            reduction=self.reduction, label_smoothing=self.label_smoothing,
        )


class L1Loss(_Loss):
    """Mean (or summed, or elementwise) absolute error between input and target."""

    def forward(self, input: Tensor, target: Any) -> Tensor:  # noqa: A002
        return _losses.l1_loss(input, target, reduction=self.reduction)


class SmoothL1Loss(_Loss):
    """Squared error below beta, absolute error above it (torch's SmoothL1Loss)."""

    def __init__(self, reduction: str = "mean", beta: float = 1.0) -> None:
        super().__init__(reduction)
        self.beta = beta

    def forward(self, input: Tensor, target: Any) -> Tensor:  # noqa: A002
        return _losses.smooth_l1_loss(input, target, reduction=self.reduction, beta=self.beta)
