"""shoal's compute core: tensors on numpy or cupy, autograd, nn, optim, CUDA kernels."""

from shoal.core import dtypes
from shoal.core.tensor import Tensor  # first: it binds the ops as methods (core/ops/bind.py)
from shoal.core.autograd import (
    AutogradError,
    RemovableHandle,
    enable_grad,
    is_grad_enabled,
    no_grad,
    set_grad_enabled,
)
from shoal.core.backend import Device
from shoal.core.backend import Device as device
from shoal.core.dtypes import DType, DTypeError, bfloat16, float16, float32, float64, int32, int64
from shoal.core.dtypes import int8, int16, uint8
from shoal.core.dtypes import bool_ as bool
from shoal.core.errors import DeviceError, ShapeError, ShoalError
from shoal.core.ops.arith import add, div, mul, pow, sub  # noqa: A004
from shoal.core.ops.creation import (
    arange,
    as_tensor,
    empty,
    empty_like,
    eye,
    from_numpy,
    full,
    full_like,
    linspace,
    ones,
    ones_like,
    rand,
    randint,
    randn,
    randperm,
    tensor,
    zeros,
    zeros_like,
)
from shoal.core.ops.interop import DLPackError, from_dlpack, to_dlpack
from shoal.core.ops.alloc import retain_freed_memory
from shoal.core.ops.linalg import matmul
from shoal.core.ops.logical import all, allclose, any, equal, isclose, nonzero  # noqa: A004
from shoal.core.ops.random import get_rng_state, initial_seed, manual_seed, set_rng_state
from shoal.core.determinism import (
    NondeterministicError,
    are_deterministic_algorithms_enabled,
    is_deterministic_algorithms_warn_only_enabled,
    use_deterministic_algorithms,
)
from shoal.core.ops.reduce import (
    amax,
    amin,
    argmax,
    argmin,
    log_softmax,
    logsumexp,
    max,
    mean,
    min,
    softmax,
    sum,
)
from shoal.core.ops.shape import (
    cat,
    chunk,
    clone,
    flatten,
    maximum,
    minimum,
    permute,
    reshape,
    split,
    squeeze,
    stack,
    transpose,
    unsqueeze,
    where,
)
from shoal.core.ops.unary import abs, clamp, exp, gelu, log, relu, sigmoid, sqrt, tanh  # noqa: A004

# torch's dtype aliases (core.float is float32, as torch.float).
half, float, double, long, int = float16, float32, float64, int64, int32  # noqa: A001
short = int16

# Last, because nn and optim build on everything above.
from shoal.core import nn
from shoal.core import optim  # noqa: E402
from shoal.core import data  # noqa: E402  (datasets and the DataLoader build on Tensor)
from shoal.core.serialization import SerializationError, load, save  # noqa: E402
from shoal.core import multiprocessing  # noqa: E402  (torch.multiprocessing.spawn)
from shoal.core import amp  # noqa: E402
from shoal.core.amp import autocast, get_autocast_dtype, is_autocast_enabled  # noqa: E402
from shoal.core import profiler  # noqa: E402  (torch.profiler: wraps ops and optimizers)
