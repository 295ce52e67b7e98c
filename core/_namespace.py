"""The torch-like namespace of `shoal.core` (Tensor, the ops, nn, optim, ...), built on first use.

core/__init__.py imports this module the first time a name of it is asked for (PEP 562), so that
a process that needs only core's settings, errors, timeouts or auth (the launcher, a standalone
store) never loads numpy. Everything below is copied onto the `shoal.core` package at the end.
fft, linalg, special, func, jit, vision and utils are not imported here: core/__init__.py loads
each on its own first use (fft, linalg and special import scipy, func imports linalg).
"""

import sys as _sys

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
from shoal.core.dtypes import complex64, complex128
from shoal.core.dtypes import bool_ as bool  # noqa: A004 - torch's name
from shoal.core.errors import DeviceError, ShapeError, ShoalError
from shoal.core.ops.arith import add, div, mul, pow, sub  # noqa: A004 - torch's names
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
from shoal.core.ops.creation import DoubleTensor, FloatTensor, IntTensor, LongTensor, Size
from shoal.core.ops.conv import conv1d, conv2d
from shoal.core.ops.conv_nd import conv3d
from shoal.core.ops.conv_transpose import conv_transpose1d, conv_transpose2d, conv_transpose3d
from shoal.core.ops.arith import eq, ge, gt, le, lt, ne, neg
from shoal.core.dtypes import get_default_dtype, set_default_dtype
from shoal.core.ops.aten_losses import (
    binary_cross_entropy_with_logits, cosine_embedding_loss, hinge_embedding_loss,
    margin_ranking_loss, poisson_nll_loss, prelu, triplet_margin_loss,
)
from shoal.core.ops.complex import complex  # noqa: A004 - torch's name
from shoal.core.ops.complex import (
    angle, conj, conj_physical, imag, is_complex, polar, real, resolve_conj, resolve_neg, sgn,
    view_as_complex, view_as_real,
)
from shoal.core.ops.derived import bmm, cos, mm, narrow, norm, sin, tan
from shoal.core.ops.interop import DLPackError, from_dlpack, to_dlpack
from shoal.core.ops.alloc import retain_freed_memory
from shoal.core.ops.linalg import matmul
from shoal.core.ops.logical import all, allclose, any, equal, isclose, nonzero  # noqa: A004 - torch's
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
    max,  # noqa: A004 - torch's name
    mean,
    min,  # noqa: A004 - torch's name
    prod,
    softmax,
    sum,  # noqa: A004 - torch's name
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
from shoal.core.ops.unary import abs, clamp, exp, gelu, log, relu, sigmoid, sqrt, tanh  # noqa: A004 - torch's

# Last, because nn and optim build on everything above.
from shoal.core import nn
from shoal.core import optim
from shoal.core import data  # datasets and the DataLoader build on Tensor
from shoal.core.serialization import SerializationError, load, save
from shoal.core import multiprocessing  # torch.multiprocessing.spawn
from shoal.core import amp
from shoal.core.amp import autocast, get_autocast_dtype, is_autocast_enabled
from shoal.core import profiler  # torch.profiler: wraps ops and optimizers
from shoal.core import backends, cuda, testing  # torch.backends, .cuda, .testing
from shoal.core import autograd, autograd_function, autograd_profiler, double_backward
from shoal.core.autograd_function import Function
from shoal.core.generator import Generator

# torch's dtype aliases (core.float is float32, as torch.float), below the imports so that every
# import stays at the top of the module.
half, float, double, long, int = float16, float32, float64, int64, int32  # noqa: A001 - torch's
short = int16
cfloat, cdouble = complex64, complex128

# torch.autograd.Function and the torch.autograd.function module: core.autograd (the engine) is
# a module that the ops import, and these build on the ops, so they are bound onto it here.
# double_backward registered the create_graph engine with autograd when it was imported.
autograd.Function = Function
autograd.function = autograd_function
_sys.modules["shoal.core.autograd.function"] = autograd_function
# torch.autograd.profiler, the legacy profiler: it builds on core.profiler, which imports
# autograd, so it too is bound here rather than imported by autograd.
autograd.profiler = autograd_profiler
_sys.modules["shoal.core.autograd.profiler"] = autograd_profiler
del double_backward

# torch's everyday ops (sorting, indexing, scans, products, elementwise math, ...): one registry
# in core/ops/everyday.py; a name imported above keeps its binding.
from shoal.core.ops.everyday import FUNCTIONS as _EVERYDAY  # noqa: E402 - after the bindings above

globals().update({name: fn for name, fn in _EVERYDAY.items() if name not in globals()})

__all__ = [
    # modules
    "dtypes", "nn", "optim", "data", "multiprocessing", "amp", "profiler", "backends", "cuda",
    "testing", "autograd",
    # tensors, autograd and devices
    "Tensor", "AutogradError", "RemovableHandle", "enable_grad", "is_grad_enabled", "no_grad",
    "set_grad_enabled", "Device", "device",
    # dtypes
    "DType", "DTypeError", "bfloat16", "float16", "float32", "float64", "int8", "int16", "int32",
    "int64", "uint8", "bool", "half", "float", "double", "long", "int", "short",
    "complex64", "complex128", "cfloat", "cdouble",
    # errors
    "DeviceError", "ShapeError", "ShoalError", "DLPackError", "NondeterministicError",
    "SerializationError",
    # ops
    "add", "div", "mul", "pow", "sub", "arange", "as_tensor", "empty", "empty_like", "eye",
    "from_numpy", "full", "full_like", "linspace", "ones", "ones_like", "rand", "randint", "randn",
    "randperm", "tensor", "zeros", "zeros_like", "from_dlpack", "to_dlpack", "retain_freed_memory",
    "matmul", "all", "allclose", "any", "equal", "isclose", "nonzero", "amax", "amin", "argmax",
    "argmin", "log_softmax", "logsumexp", "max", "mean", "min", "prod", "softmax", "sum",
    "cat", "chunk",
    "clone", "flatten", "maximum", "minimum", "permute", "reshape", "split", "squeeze", "stack",
    "transpose", "unsqueeze", "where", "abs", "clamp", "exp", "gelu", "log", "relu", "sigmoid",
    "sqrt", "tanh", "bmm", "cos", "mm", "narrow", "norm", "sin", "tan", "conv1d", "conv2d",
    "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "eq", "ne", "lt", "le", "gt", "ge", "neg", "prelu", "binary_cross_entropy_with_logits",
    "cosine_embedding_loss", "hinge_embedding_loss", "margin_ranking_loss", "poisson_nll_loss",
    "triplet_margin_loss", "get_default_dtype", "set_default_dtype",
    "Size", "FloatTensor", "DoubleTensor", "LongTensor", "IntTensor",
    "angle", "complex", "conj", "conj_physical", "imag", "is_complex", "polar", "real",
    "resolve_conj", "resolve_neg", "sgn", "view_as_complex", "view_as_real",
    # random numbers, determinism, serialization, autocast
    "Generator", "get_rng_state", "initial_seed", "manual_seed", "set_rng_state",
    "are_deterministic_algorithms_enabled", "is_deterministic_algorithms_warn_only_enabled",
    "use_deterministic_algorithms", "load", "save", "autocast", "get_autocast_dtype",
    "is_autocast_enabled",
]
__all__ += sorted(name for name in _EVERYDAY if name not in __all__)

# Publish: every public name above becomes an attribute of the package, as if core/__init__.py
# had imported it (the package's __getattr__ is not asked again for any of them).
_core = _sys.modules["shoal.core"]
for _name, _value in list(globals().items()):
    if not _name.startswith("_"):
        setattr(_core, _name, _value)
# The package's __all__ names the submodules that load on their own first use too, so that
# `from shoal.core import *` imports them, as it always did.
_core.__all__ = __all__ + ["linalg", "utils", "func", "jit", "fft", "special"]
