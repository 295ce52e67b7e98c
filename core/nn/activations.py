"""torch.nn's activation, distance, padding and reshaping modules that core lacked, each a thin
Module over core/nn/activations_functional.py with torch's constructor arguments and repr."""

from __future__ import annotations

from typing import Any, Sequence

from shoal.core.nn import activations_functional as A
from shoal.core.nn.module import Module
from shoal.core.nn.parameter import Parameter
from shoal.core.ops import creation, reduce, shape


def _module(name: str, fn: Any, params: Sequence[tuple[str, Any]], doc: str) -> type:
    """A Module class whose forward is fn(input, *its constructor arguments, in order)."""
    names = [p for p, _ in params]
    defaults = dict(params)

    def __init__(self: Module, *args: Any, **kwargs: Any) -> None:
        Module.__init__(self)
        if len(args) > len(names):
            raise TypeError(f"{name}() takes at most {len(names)} arguments ({len(args)} given)")
        values = {**defaults, **dict(zip(names, args)), **kwargs}
        unknown = set(values) - set(names) - {"inplace"}
        if unknown:
            raise TypeError(f"{name}() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        for key in names:
            setattr(self, key, values[key])
        self.inplace = values.get("inplace", False)

    def forward(self: Module, input: Any) -> Any:  # noqa: A002
        return fn(input, *[getattr(self, key) for key in names if key != "inplace"])

    def extra_repr(self: Module) -> str:
        return ", ".join(f"{key}={getattr(self, key)}" for key in names if key != "inplace")

    return type(name, (Module,), {"__init__": __init__, "forward": forward,
                                  "extra_repr": extra_repr, "__doc__": doc,
                                  "__module__": __name__})


LeakyReLU = _module("LeakyReLU", A.leaky_relu, [("negative_slope", 0.01)], "leaky_relu.")
ELU = _module("ELU", A.elu, [("alpha", 1.0)], "elu.")


class RReLU(Module):
    """Randomized leaky ReLU: random negative slopes in [lower, upper] in training, their mean
    in eval."""

    def __init__(self, lower: float = 1.0 / 8, upper: float = 1.0 / 3,
                 inplace: bool = False) -> None:
        super().__init__()
        self.lower = lower
        self.upper = upper
        self.inplace = inplace

    def forward(self, input: Any) -> Any:  # noqa: A002
        """rrelu(input) with this module's bounds and training flag."""
        return A.rrelu(input, self.lower, self.upper, self.training)

    def extra_repr(self) -> str:
        """The bounds (and inplace when set), as torch prints them."""
        return f"lower={self.lower}, upper={self.upper}" + (", inplace=True" if self.inplace
                                                            else "")

SELU = _module("SELU", A.selu, [], "selu.")
CELU = _module("CELU", A.celu, [("alpha", 1.0)], "celu.")
SiLU = _module("SiLU", A.silu, [], "x * sigmoid(x).")
Mish = _module("Mish", A.mish, [], "x * tanh(softplus(x)).")
Softplus = _module("Softplus", A.softplus, [("beta", 1.0), ("threshold", 20.0)], "softplus.")
Softsign = _module("Softsign", A.softsign, [], "x / (1 + |x|).")
Softshrink = _module("Softshrink", A.softshrink, [("lambd", 0.5)], "softshrink.")
Hardshrink = _module("Hardshrink", A.hardshrink, [("lambd", 0.5)], "hardshrink.")
Tanhshrink = _module("Tanhshrink", A.tanhshrink, [], "x - tanh(x).")
Hardtanh = _module("Hardtanh", A.hardtanh, [("min_val", -1.0), ("max_val", 1.0)], "hardtanh.")
ReLU6 = _module("ReLU6", A.relu6, [], "min(max(x, 0), 6).")
Hardsigmoid = _module("Hardsigmoid", A.hardsigmoid, [], "relu6(x + 3) / 6.")
Hardswish = _module("Hardswish", A.hardswish, [], "x * relu6(x + 3) / 6.")
LogSigmoid = _module("LogSigmoid", A.logsigmoid, [], "log(sigmoid(x)).")
Threshold = _module("Threshold", A.threshold, [("threshold", 0.0), ("value", 0.0)], "threshold.")
GLU = _module("GLU", A.glu, [("dim", -1)], "a * sigmoid(b) for the halves of dim.")
Softmin = _module("Softmin", A.softmin, [("dim", None)], "softmax(-x) along dim.")
PixelShuffle = _module("PixelShuffle", A.pixel_shuffle, [("upscale_factor", 2)], "pixel_shuffle.")
PixelUnshuffle = _module("PixelUnshuffle", A.pixel_unshuffle, [("downscale_factor", 2)],
                         "pixel_unshuffle.")


def _softmax(input: Any, dim: Any) -> Any:  # noqa: A002
    return reduce.softmax(input, -1 if dim is None else dim)


def _log_softmax(input: Any, dim: Any) -> Any:  # noqa: A002
    return reduce.log_softmax(input, -1 if dim is None else dim)


Softmax = _module("Softmax", _softmax, [("dim", None)], "softmax along dim.")
LogSoftmax = _module("LogSoftmax", _log_softmax, [("dim", None)], "log_softmax along dim.")
Softmax2d = _module("Softmax2d", lambda x: reduce.softmax(x, -3), [], "softmax over channels.")


class CosineSimilarity(Module):
    """cosine_similarity(x1, x2) along dim."""

    def __init__(self, dim: int = 1, eps: float = 1e-8) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps

    def forward(self, x1: Any, x2: Any) -> Any:
        return A.cosine_similarity(x1, x2, self.dim, self.eps)


class PairwiseDistance(Module):
    """pairwise_distance(x1, x2) over the last dim."""

    def __init__(self, p: float = 2.0, eps: float = 1e-6, keepdim: bool = False) -> None:
        super().__init__()
        self.norm, self.eps, self.keepdim = p, eps, keepdim

    def forward(self, x1: Any, x2: Any) -> Any:
        return A.pairwise_distance(x1, x2, self.norm, self.eps, self.keepdim)


class PReLU(Module):
    """x where x > 0, a * x elsewhere, with a learned a (one, or one per channel)."""

    def __init__(self, num_parameters: int = 1, init: float = 0.25, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__()
        self.num_parameters = num_parameters
        self.init = init
        self.weight = Parameter(creation.full((num_parameters,), init, dtype=dtype,
                                              device=device))

    def forward(self, input: Any) -> Any:  # noqa: A002
        return A.prelu(input, self.weight)

    def extra_repr(self) -> str:
        return f"num_parameters={self.num_parameters}"


class Unflatten(Module):
    """Split dim into unflattened_size."""

    def __init__(self, dim: int, unflattened_size: Sequence[int]) -> None:
        super().__init__()
        self.dim, self.unflattened_size = dim, tuple(unflattened_size)

    def forward(self, input: Any) -> Any:  # noqa: A002
        size = tuple(input.shape)
        d = self.dim % len(size)
        return shape.reshape(input, size[:d] + self.unflattened_size + size[d + 1:])


def _pad_module(name: str, mode: str, dims: int) -> type:
    """A padding module of `dims` trailing dims (torch's ZeroPad2d, ReflectionPad1d, ...)."""

    def __init__(self: Module, padding: Any, value: float = 0.0) -> None:
        Module.__init__(self)
        self.padding = (padding,) * (2 * dims) if isinstance(padding, int) else tuple(padding)
        if len(self.padding) != 2 * dims:
            raise ValueError(f"{name}: padding must be an int or {2 * dims} ints")
        self.value = value

    def forward(self: Module, input: Any) -> Any:  # noqa: A002
        return A.pad(input, self.padding, mode, self.value if mode == "constant" else None)

    def extra_repr(self: Module) -> str:
        return f"{self.padding}"

    return type(name, (Module,), {"__init__": __init__, "forward": forward,
                                  "extra_repr": extra_repr, "__module__": __name__,
                                  "__doc__": f"{mode} padding of the last {dims} dim(s)."})


ConstantPad1d, ConstantPad2d, ConstantPad3d = (_pad_module(f"ConstantPad{d}d", "constant", d)
                                               for d in (1, 2, 3))
ZeroPad1d, ZeroPad2d, ZeroPad3d = (_pad_module(f"ZeroPad{d}d", "constant", d) for d in (1, 2, 3))
ReflectionPad1d, ReflectionPad2d, ReflectionPad3d = (
    _pad_module(f"ReflectionPad{d}d", "reflect", d) for d in (1, 2, 3))
ReplicationPad1d, ReplicationPad2d, ReplicationPad3d = (
    _pad_module(f"ReplicationPad{d}d", "replicate", d) for d in (1, 2, 3))
CircularPad1d, CircularPad2d, CircularPad3d = (
    _pad_module(f"CircularPad{d}d", "circular", d) for d in (1, 2, 3))

__all__ = [
    "LeakyReLU", "ELU", "RReLU", "SELU", "CELU", "SiLU", "Mish", "Softplus", "Softsign", "Softshrink",
    "Hardshrink", "Tanhshrink", "Hardtanh", "ReLU6", "Hardsigmoid", "Hardswish", "LogSigmoid",
    "Threshold", "GLU", "Softmin", "Softmax", "LogSoftmax", "Softmax2d", "PixelShuffle",
    "PixelUnshuffle", "CosineSimilarity", "PairwiseDistance", "PReLU", "Unflatten",
    "ConstantPad1d", "ConstantPad2d", "ConstantPad3d", "ZeroPad1d", "ZeroPad2d", "ZeroPad3d",
    "ReflectionPad1d", "ReflectionPad2d", "ReflectionPad3d", "ReplicationPad1d",
    "ReplicationPad2d", "ReplicationPad3d", "CircularPad1d", "CircularPad2d", "CircularPad3d",
]
