"""Lazy CuPy access for the kernel modules: nothing here imports cupy until a kernel runs."""

from __future__ import annotations

import functools
from typing import Any, Callable

from shoal.core.errors import DeviceError

# Accumulate half-precision values in float and everything else in its own type, so a float16
# parameter's update is computed at float32 precision and rounded once on the way out.
ACC_PREAMBLE = r"""
template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };
"""

# The opening every optimizer kernel shares: the gradient (negated with `maximize`) and the
# parameter, loaded in the accumulation type A.
GRAD_PARAM_PROLOGUE = r"""
typedef Acc<T>::type A;
A g = (A)grad;
if (maximize) g = -g;
A p = (A)param;
"""


def is_cuda_array(array: Any) -> bool:
    """True when `array` is a cupy ndarray (checked by module name, without importing cupy)."""
    return type(array).__module__.split(".", 1)[0] == "cupy"


@functools.lru_cache(maxsize=None)
def cupy():
    """The cupy module, imported on first use; DeviceError when it is not installed."""
    try:
        import cupy as cp  # noqa: PLC0415 - lazy on purpose: core imports without cupy
    except ImportError as exc:
        raise DeviceError(
            "A CUDA kernel was requested but cupy is not installed; install shoal[cuda12] or "
            "shoal[cuda13] on a machine with an NVIDIA GPU."
        ) from exc
    return cp


def cached_kernel(builder: Callable[[], Any]) -> Callable[[], Any]:
    """Decorate a zero-argument kernel builder so it runs once, on first use."""
    return functools.lru_cache(maxsize=None)(builder)


def launch_1d(total: int, threads: int = 256, max_blocks: int = 65535) -> tuple[tuple, tuple]:
    """Grid and block sizes for a grid-stride loop over `total` items."""
    blocks = max(1, min(max_blocks, (total + threads - 1) // threads))
    return (blocks,), (threads,)
