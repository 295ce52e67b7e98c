"""float16 compression of gradient buffers for communication, as DDP's fp16_compress_hook.

`compress` scales in the source precision and rounds once to float16, so dividing by the world
size before the cast (rather than after, as torch's hook does) keeps sums of large gradients
from overflowing float16's 65504. `decompress` widens and scales back into the caller's buffer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.core.errors import ShapeError
from shoal.core.kernels._cuda import cached_kernel, cupy, is_cuda_array


def _check_pair(source: Any, target: Any, op: str) -> None:
    if source.shape != target.shape:
        raise ShapeError(
            f"{op} needs equal shapes; got {tuple(source.shape)} and {tuple(target.shape)}."
        )


def compress_reference(
    x: np.ndarray, scale: float = 1.0, out: np.ndarray | None = None
) -> np.ndarray:
    """float16(x * scale) on numpy, computed in x's precision and rounded once."""
    if out is None:
        out = np.empty(x.shape, dtype=np.float16)
    _check_pair(x, out, "compress")
    np.multiply(x, np.asarray(scale, dtype=x.dtype), out=out, casting="same_kind")
    return out


def decompress_reference(h: np.ndarray, out: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """out = float(h) * scale on numpy, in place, and return `out`."""
    _check_pair(h, out, "decompress")
    np.multiply(h, np.asarray(scale, dtype=out.dtype), out=out)
    return out


@cached_kernel
def _compress_kernels():
    cp = cupy()
    compress = cp.ElementwiseKernel(
        "T x, float64 scale", "float16 y",
        # Multiply in T as numpy does, then round to half through float (exact for float T).
        "y = (float16)(float)(x * (T)scale);", "shoal_fp16_compress",
    )
    decompress = cp.ElementwiseKernel(
        "float16 h, float64 scale", "T x",
        "x = (T)(float)h * (T)scale;", "shoal_fp16_decompress",
    )
    return compress, decompress


def compress_cuda(x: Any, scale: float = 1.0, out: Any | None = None) -> Any:
    """float16(x * scale) on cupy, one elementwise kernel."""
    cp = cupy()
    if out is None:
        out = cp.empty(x.shape, dtype=cp.float16)
    _check_pair(x, out, "compress")
    _compress_kernels()[0](x, float(scale), out)
    return out


def decompress_cuda(h: Any, out: Any, scale: float = 1.0) -> Any:
    """out = float(h) * scale on cupy, one elementwise kernel writing `out` in place."""
    _check_pair(h, out, "decompress")
    _compress_kernels()[1](h, float(scale), out)
    return out


def compress(x: Any, scale: float = 1.0, out: Any | None = None) -> Any:
    """float16(x * scale): the CUDA kernel for cupy arrays, the numpy reference otherwise."""
    if is_cuda_array(x):
        return compress_cuda(x, scale, out)
    return compress_reference(x, scale, out)


def decompress(h: Any, out: Any, scale: float = 1.0) -> Any:
    """out = float(h) * scale: the CUDA kernel for cupy arrays, the numpy reference otherwise."""
    if is_cuda_array(h):
        return decompress_cuda(h, out, scale)
    return decompress_reference(h, out, scale)
