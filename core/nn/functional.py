"""torch.nn.functional's names over shoal's ops (imported as `core.nn.functional`, or F)."""

from __future__ import annotations

from typing import Any

from shoal.core.ops import reduce as _reduce
from shoal.core.ops.attention import scaled_dot_product_attention
from shoal.core.nn.losses_functional import embedding_bag, l1_loss, smooth_l1_loss
from shoal.core.ops.conv import conv1d, conv2d
from shoal.core.ops.conv_nd import conv3d
from shoal.core.ops.conv_transpose import conv_transpose1d, conv_transpose2d, conv_transpose3d
from shoal.core.ops.norm import batch_norm
from shoal.core.ops.pooling import adaptive_avg_pool2d, avg_pool2d, max_pool2d
from shoal.core.ops import unary as _unary
from shoal.core.ops.nn import (
    cross_entropy,
    dropout,
    embedding,
    layer_norm,
    linear,
    mse_loss,
    nll_loss,
    one_hot,
)
from shoal.core.tensor import Tensor
from shoal.core.nn.activations_functional import (
    celu, cosine_similarity, elu, glu, hardshrink, hardsigmoid, hardswish, hardtanh, leaky_relu,
    logsigmoid, mish, normalize, pad, pairwise_distance, pixel_shuffle, pixel_unshuffle, prelu,
    relu6, rrelu, selu, silu, softmin, softplus, softshrink, softsign, tanhshrink, threshold,
)
from shoal.core.nn.losses_margin import (
    multi_margin_loss, multilabel_margin_loss, multilabel_soft_margin_loss,
)
from shoal.core.nn.fold import fold, unfold
from shoal.core.nn.grid_sample import affine_grid, grid_sample
from shoal.core.nn.upsampling import (
    interpolate, upsample, upsample_bilinear, upsample_nearest,
)
from shoal.core.nn.losses_more import (
    binary_cross_entropy, binary_cross_entropy_with_logits, cosine_embedding_loss,
    gaussian_nll_loss, group_norm, hinge_embedding_loss, huber_loss, instance_norm, kl_div,
    local_response_norm, margin_ranking_loss, poisson_nll_loss, rms_norm, soft_margin_loss,
    triplet_margin_loss,
)

__all__ = [
    "linear",
    "relu",
    "gelu",
    "sigmoid",
    "tanh",
    "softmax",
    "log_softmax",
    "dropout",
    "cross_entropy",
    "nll_loss",
    "one_hot",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "embedding_bag",
    "layer_norm",
    "embedding",
    "conv1d",
    "conv2d",
    "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "max_pool2d",
    "avg_pool2d",
    "adaptive_avg_pool2d",
    "batch_norm",
    "scaled_dot_product_attention",
    "celu", "cosine_similarity", "elu", "glu", "hardshrink", "hardsigmoid", "hardswish",
    "hardtanh", "leaky_relu", "logsigmoid", "mish", "normalize", "pad", "pairwise_distance",
    "pixel_shuffle", "pixel_unshuffle", "prelu", "relu6", "selu", "silu", "softmin", "softplus",
    "softshrink", "softsign", "tanhshrink", "threshold",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "cosine_embedding_loss",
    "gaussian_nll_loss", "group_norm", "hinge_embedding_loss", "huber_loss", "instance_norm",
    "kl_div", "local_response_norm", "margin_ranking_loss", "poisson_nll_loss", "rms_norm",
    "soft_margin_loss", "triplet_margin_loss",
    "interpolate", "upsample", "upsample_bilinear", "upsample_nearest",
    "multi_margin_loss", "multilabel_margin_loss", "multilabel_soft_margin_loss",
    "fold", "unfold", "rrelu", "grid_sample", "affine_grid",
]


def relu(input: Tensor, inplace: bool = False) -> Tensor:  # noqa: A002 - torch's name
    """max(x, 0); `inplace` is accepted for torch compatibility and ignored."""
    return _unary.relu(input)


def gelu(input: Tensor, approximate: str = "none") -> Tensor:  # noqa: A002
    """GELU, exact (erf) or approximate='tanh'."""
    return _unary.gelu(input, approximate)


def sigmoid(input: Tensor) -> Tensor:  # noqa: A002
    """The logistic function."""
    return _unary.sigmoid(input)


def tanh(input: Tensor) -> Tensor:  # noqa: A002
    """Hyperbolic tangent."""
    return _unary.tanh(input)


def softmax(input: Tensor, dim: int = -1, dtype: Any = None) -> Tensor:  # noqa: A002
    """Softmax along dim."""
    return _reduce.softmax(input if dtype is None else input.to(dtype), dim)


def log_softmax(input: Tensor, dim: int = -1, dtype: Any = None) -> Tensor:  # noqa: A002
    """Log-softmax along dim."""
    return _reduce.log_softmax(input if dtype is None else input.to(dtype), dim)
