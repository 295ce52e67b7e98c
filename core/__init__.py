"""shoal's compute core: tensors on numpy or cupy, autograd, nn, optim, CUDA kernels."""

from core.errors import ShoalError  # noqa: F401
