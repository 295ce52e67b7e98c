"""The losses torch also exposes at top level (`torch.cosine_embedding_loss`, ...), with
aten's signatures: positional options in aten's order and `reduction` as the integer enum of
torch.nn._reduction (0 none, 1 mean, 2 sum), not torch.nn.functional's string. Code written
against aten's names (and PyTorch's own autocast test lists) calls these.

Left out, `reduction` is 0 (no reduction) in torch 2.13's top-level bindings, although aten's
schema declares Mean: torch.cosine_embedding_loss(a, b, y) returns one loss per row. These
follow what torch does, not what its schema says."""

from __future__ import annotations

from typing import Any

from shoal.core.tensor import Tensor

__all__ = [
    "binary_cross_entropy_with_logits", "cosine_embedding_loss", "hinge_embedding_loss",
    "margin_ranking_loss", "poisson_nll_loss", "prelu", "triplet_margin_loss",
]

def _reduction(value: int) -> str:
    # torch applies Mean for 1 and Sum for 2 and leaves the loss unreduced for any other value
    # (-1 and 7 included), without an error; so does this.
    return {1: "mean", 2: "sum"}.get(value, "none")


def _losses() -> Any:
    # core.nn loads on first use (import time of `import shoal.core` stays as it was)
    from shoal.core.nn import losses_more  # noqa: PLC0415

    return losses_more


def binary_cross_entropy_with_logits(input: Tensor, target: Tensor, weight: Any = None,  # noqa: A002
                                     pos_weight: Any = None, reduction: int = 0) -> Tensor:
    """aten's binary_cross_entropy_with_logits (pos_weight before reduction)."""
    return _losses().bce_with_logits_broadcast(input, target, weight, _reduction(reduction),
                                               pos_weight)


def cosine_embedding_loss(input1: Tensor, input2: Tensor, target: Tensor, margin: float = 0.0,
                          reduction: int = 0) -> Tensor:
    """aten's cosine_embedding_loss."""
    return _losses().cosine_embedding_loss(input1, input2, target, margin,
                                           reduction=_reduction(reduction))


def hinge_embedding_loss(input: Tensor, target: Tensor, margin: float = 1.0,  # noqa: A002
                         reduction: int = 0) -> Tensor:
    """aten's hinge_embedding_loss."""
    return _losses().hinge_embedding_loss(input, target, margin, reduction=_reduction(reduction))


def margin_ranking_loss(input1: Tensor, input2: Tensor, target: Tensor, margin: float = 0.0,
                        reduction: int = 0) -> Tensor:
    """aten's margin_ranking_loss."""
    return _losses().margin_ranking_loss(input1, input2, target, margin,
                                         reduction=_reduction(reduction))


def poisson_nll_loss(input: Tensor, target: Tensor, log_input: bool, full: bool,  # noqa: A002
                     eps: float, reduction: int) -> Tensor:
    """aten's poisson_nll_loss: every option positional and required, as torch's."""
    return _losses().poisson_nll_loss(input, target, log_input, full, eps=eps,
                                      reduction=_reduction(reduction))


def triplet_margin_loss(anchor: Tensor, positive: Tensor, negative: Tensor, margin: float = 1.0,
                        p: float = 2.0, eps: float = 1e-6, swap: bool = False,
                        reduction: int = 0) -> Tensor:
    """aten's triplet_margin_loss."""
    return _losses().triplet_margin_loss(anchor, positive, negative, margin, p, eps, swap,
                                         reduction=_reduction(reduction))


def prelu(input: Tensor, weight: Tensor) -> Tensor:  # noqa: A002
    """torch.prelu: torch.nn.functional.prelu at top level."""
    from shoal.core.nn.activations_functional import prelu as _prelu  # noqa: PLC0415

    return _prelu(input, weight)
