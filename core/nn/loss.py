"""Loss modules with torch.nn's names (MSELoss, CrossEntropyLoss, NLLLoss, L1Loss, SmoothL1Loss,
BCELoss, BCEWithLogitsLoss, KLDivLoss, HuberLoss and the margin losses) over the functionals."""

from __future__ import annotations

from typing import Any

from shoal.core.nn import functional as F
from shoal.core.nn import losses_functional as _losses
from shoal.core.nn import losses_more as _more
from shoal.core.nn._reduction import legacy_get_string
from shoal.core.nn.module import Module
from shoal.core.tensor import Tensor

_REDUCTIONS = ("mean", "sum", "none")


class _Loss(Module):
    """A loss with a `reduction` ('mean', 'sum' or 'none'), checked when it is built.

    torch's deprecated `size_average`/`reduce` pair, when either is given, decides the
    reduction instead (with torch's warning), as in torch: reduce=False is 'none', else
    size_average=False is 'sum'."""

    def __init__(self, size_average: Any = None, reduce: Any = None,
                 reduction: str = "mean") -> None:
        super().__init__()
        if size_average is not None or reduce is not None:
            reduction = legacy_get_string(size_average, reduce)
        if reduction not in _REDUCTIONS:
            raise ValueError(
                f"{type(self).__name__}: reduction must be one of {_REDUCTIONS}, got {reduction!r}."
            )
        self.reduction = reduction

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}" if self.reduction != "mean" else ""


class _WeightedLoss(_Loss):
    """A loss with optional per-class weights, kept as a buffer (in state_dict) as torch does."""

    def __init__(self, weight: Tensor | None = None, size_average: Any = None,
                 reduce: Any = None, reduction: str = "mean") -> None:
        super().__init__(size_average, reduce, reduction)
        self.register_buffer("weight", weight)


class MSELoss(_Loss):
    """Mean (or summed, or elementwise) squared error between input and target."""

    def forward(self, input: Tensor, target: Any) -> Tensor:  # noqa: A002 - torch's name
        return F.mse_loss(input, target, reduction=self.reduction)


class NLLLoss(_WeightedLoss):
    """Negative log likelihood of log-probabilities (log_softmax output) and class indices."""

    def __init__(
        self, weight: Tensor | None = None, size_average: Any = None, ignore_index: int = -100,
        reduce: Any = None, reduction: str = "mean",
    ) -> None:
        super().__init__(weight, size_average, reduce, reduction)
        self.ignore_index = ignore_index

    def forward(self, input: Tensor, target: Any) -> Tensor:  # noqa: A002
        return F.nll_loss(
            input, target, weight=self.weight, ignore_index=self.ignore_index,
            reduction=self.reduction,
        )


class CrossEntropyLoss(_WeightedLoss):
    """log_softmax then NLL over dim 1, with class indices or class probabilities as targets."""

    def __init__(
        self, weight: Tensor | None = None, size_average: Any = None, ignore_index: int = -100,
        reduce: Any = None, reduction: str = "mean", label_smoothing: float = 0.0,
    ) -> None:
        super().__init__(weight, size_average, reduce, reduction)
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

    def __init__(self, size_average: Any = None, reduce: Any = None, reduction: str = "mean",
                 beta: float = 1.0) -> None:
        super().__init__(size_average, reduce, reduction)
        self.beta = beta

    def forward(self, input: Tensor, target: Any) -> Tensor:  # noqa: A002
        return _losses.smooth_l1_loss(input, target, reduction=self.reduction, beta=self.beta)


class BCELoss(_WeightedLoss):
    """Binary cross entropy of probabilities and targets in [0, 1]."""

    def forward(self, input: Tensor, target: Any) -> Tensor:  # noqa: A002
        return _more.binary_cross_entropy(input, target, self.weight, reduction=self.reduction)


class BCEWithLogitsLoss(_WeightedLoss):
    """Binary cross entropy of logits, computed stably; pos_weight weighs the positives."""

    def __init__(self, weight: Tensor | None = None, size_average: Any = None, reduce: Any = None,
                 reduction: str = "mean", pos_weight: Tensor | None = None) -> None:
        super().__init__(weight, size_average, reduce, reduction)
        self.register_buffer("pos_weight", pos_weight)

    def forward(self, input: Tensor, target: Any) -> Tensor:  # noqa: A002
        return _more.binary_cross_entropy_with_logits(
            input, target, self.weight, reduction=self.reduction, pos_weight=self.pos_weight)


class KLDivLoss(_Loss):
    """KL divergence of log-probabilities `input` from `target`."""

    def __init__(self, size_average: Any = None, reduce: Any = None, reduction: str = "mean",
                 log_target: bool = False) -> None:
        Module.__init__(self)
        if size_average is not None or reduce is not None:
            reduction = legacy_get_string(size_average, reduce)
        if reduction not in _REDUCTIONS + ("batchmean",):
            raise ValueError(f"KLDivLoss: reduction must be one of "
                             f"{_REDUCTIONS + ('batchmean',)}, got {reduction!r}.")
        self.reduction, self.log_target = reduction, log_target

    def forward(self, input: Tensor, target: Any) -> Tensor:  # noqa: A002
        return _more.kl_div(input, target, reduction=self.reduction, log_target=self.log_target)


class HuberLoss(_Loss):
    """Quadratic below delta, linear above."""

    def __init__(self, reduction: str = "mean", delta: float = 1.0) -> None:
        super().__init__(reduction=reduction)
        self.delta = delta

    def forward(self, input: Tensor, target: Any) -> Tensor:  # noqa: A002
        return _more.huber_loss(input, target, self.reduction, self.delta)


class SoftMarginLoss(_Loss):
    """log(1 + exp(-y x))."""

    def forward(self, input: Tensor, target: Any) -> Tensor:  # noqa: A002
        return _more.soft_margin_loss(input, target, reduction=self.reduction)


class _MarginLoss(_Loss):
    def __init__(self, margin: float = 0.0, size_average: Any = None, reduce: Any = None,
                 reduction: str = "mean") -> None:
        super().__init__(size_average, reduce, reduction)
        self.margin = margin


class MarginRankingLoss(_MarginLoss):
    """max(0, -y (x1 - x2) + margin)."""

    def forward(self, input1: Tensor, input2: Tensor, target: Any) -> Tensor:
        return _more.margin_ranking_loss(input1, input2, target, self.margin,
                                         reduction=self.reduction)


class CosineEmbeddingLoss(_MarginLoss):
    """1 - cos for similar pairs, max(0, cos - margin) for dissimilar ones."""

    def forward(self, input1: Tensor, input2: Tensor, target: Any) -> Tensor:
        return _more.cosine_embedding_loss(input1, input2, target, self.margin,
                                           reduction=self.reduction)


class HingeEmbeddingLoss(_MarginLoss):
    """x for y == 1, max(0, margin - x) for y == -1."""

    def __init__(self, margin: float = 1.0, size_average: Any = None, reduce: Any = None,
                 reduction: str = "mean") -> None:
        super().__init__(margin, size_average, reduce, reduction)

    def forward(self, input: Tensor, target: Any) -> Tensor:  # noqa: A002
        return _more.hinge_embedding_loss(input, target, self.margin, reduction=self.reduction)


class GaussianNLLLoss(_Loss):
    """Gaussian negative log likelihood with a predicted variance."""

    def __init__(self, *, full: bool = False, eps: float = 1e-6, reduction: str = "mean") -> None:
        super().__init__(reduction=reduction)
        self.full, self.eps = full, eps

    def forward(self, input: Tensor, target: Any, var: Any) -> Tensor:  # noqa: A002
        return _more.gaussian_nll_loss(input, target, var, self.full, self.eps, self.reduction)


class PoissonNLLLoss(_Loss):
    """Poisson negative log likelihood (of log-rates by default)."""

    def __init__(self, log_input: bool = True, full: bool = False, size_average: Any = None,
                 eps: float = 1e-8, reduce: Any = None, reduction: str = "mean") -> None:
        super().__init__(size_average, reduce, reduction)
        self.log_input, self.full, self.eps = log_input, full, eps

    def forward(self, log_input: Tensor, target: Any) -> Tensor:
        return _more.poisson_nll_loss(log_input, target, self.log_input, self.full,
                                      eps=self.eps, reduction=self.reduction)


class TripletMarginLoss(_Loss):
    """max(d(a, p) - d(a, n) + margin, 0)."""

    def __init__(self, margin: float = 1.0, p: float = 2.0, eps: float = 1e-6,
                 swap: bool = False, size_average: Any = None, reduce: Any = None,
                 reduction: str = "mean") -> None:
        super().__init__(size_average, reduce, reduction)
        self.margin, self.p, self.eps, self.swap = margin, p, eps, swap

    def forward(self, anchor: Tensor, positive: Tensor, negative: Tensor) -> Tensor:
        return _more.triplet_margin_loss(anchor, positive, negative, self.margin, self.p,
                                         self.eps, self.swap, reduction=self.reduction)
