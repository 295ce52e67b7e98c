"""Fused CUDA kernels (CuPy, compiled on first use) with the numpy references the CPU path runs.

Each family lives in its own module; importing this package never imports cupy.
"""

from shoal.core.kernels.adam import adam_step, adam_step_cuda, adam_step_reference
from shoal.core.kernels.fp16 import (
    compress,
    compress_cuda,
    compress_reference,
    decompress,
    decompress_cuda,
    decompress_reference,
)
from shoal.core.kernels.cross_entropy import (
    TargetError,
    cross_entropy_backward,
    cross_entropy_backward_cuda,
    cross_entropy_backward_reference,
    cross_entropy_forward,
    cross_entropy_forward_cuda,
    cross_entropy_forward_reference,
)
from shoal.core.kernels.buckets import (
    flatten,
    flatten_cuda,
    flatten_reference,
    unflatten,
    unflatten_cuda,
    unflatten_reference,
)
from shoal.core.kernels.gelu import (
    gelu_backward,
    gelu_backward_cuda,
    gelu_backward_reference,
    gelu_forward,
    gelu_forward_cuda,
    gelu_forward_reference,
)
from shoal.core.kernels._cuda import is_cuda_array
from shoal.core.kernels.sgd import sgd_step, sgd_step_cuda, sgd_step_reference

__all__ = [
    "TargetError",
    "adam_step", "adam_step_cuda", "adam_step_reference",
    "compress", "compress_cuda", "compress_reference",
    "cross_entropy_backward", "cross_entropy_backward_cuda", "cross_entropy_backward_reference",
    "cross_entropy_forward", "cross_entropy_forward_cuda", "cross_entropy_forward_reference",
    "decompress", "decompress_cuda", "decompress_reference",
    "flatten", "flatten_cuda", "flatten_reference",
    "gelu_backward", "gelu_backward_cuda", "gelu_backward_reference",
    "gelu_forward", "gelu_forward_cuda", "gelu_forward_reference",
    "is_cuda_array",
    "sgd_step", "sgd_step_cuda", "sgd_step_reference",
    "unflatten", "unflatten_cuda", "unflatten_reference",
]
