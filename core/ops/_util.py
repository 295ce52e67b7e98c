"""Helpers every op uses: wrapping results (and recording the graph), broadcasting, scalars."""

from __future__ import annotations

from typing import Any, Callable

import ml_dtypes
import numpy as np

from shoal.core import backend
from shoal.core.autograd import Node
from shoal.core.grad_mode import grad_mode
from shoal.core.errors import DimError, ShapeError
from shoal.core.ops._promote import is_reduced_float
from shoal.core.tensor import Tensor, wrap

_F32 = np.dtype(np.float32)
_BF16 = np.dtype(ml_dtypes.bfloat16)


def result(
    data: Any, name: str, backward: Callable, inputs: tuple, exact_dtype: bool = False
) -> Tensor:
    """Wrap an op's output; record a Node when grad mode is on and an input requires grad.

    `inputs` may hold non-tensors (Python scalars, arrays): they become None in the node, and
    the backward closure returns None (or anything; it is ignored) in their place.
    `exact_dtype`: the op chose its output dtype on purpose (a cast), so keep it as it is.
    """
    out = wrap(data)  # numpy ufuncs turn 0-d results into scalars; wrap keeps arrays
    if name in _VIEW_NODES:
        _share_version(out, inputs[0])
    if out.array.dtype is _F32 and not exact_dtype:
        out.array = _keep_bfloat16(out.array, inputs)
    if grad_mode.enabled:
        for t in inputs:
            if t.__class__ is not Tensor and not isinstance(t, Tensor):
                continue
            if t.requires_grad:
                out.requires_grad = True
                node = out.grad_fn = Node(
                    name,
                    backward,
                    tuple(i if isinstance(i, Tensor) else None for i in inputs),
                )
                if name not in _SAVES_NO_TENSOR:
                    node.versions = _saved_versions(name, inputs, out)
                break
    return out


# Nodes whose backward needs no tensor's values (shapes at most): an in-place update of their
# inputs or output is harmless, as in torch, so they record no versions.
_SAVES_NO_TENSOR = frozenset((
    "AddBackward", "SubBackward", "NegBackward", "SumBackward", "MeanBackward", "ReshapeBackward",
    "TransposeBackward", "PermuteBackward", "ExpandBackward", "CloneBackward", "IndexBackward",
    "CatBackward", "StackBackward", "ToCopyBackward",
))
# Nodes whose backward reads their output, not their input (torch saves `result` for these).
_SAVES_RESULT = frozenset((
    "ExpBackward", "SqrtBackward", "TanhBackward", "SigmoidBackward", "ReluBackward",
    "SoftmaxBackward", "LogSoftmaxBackward",
))


def _saved_versions(name: str, inputs: tuple, out: Tensor) -> tuple:
    """(counter, value) pairs for the tensors a node's closure saved (core/autograd.py checks)."""
    if name in _SAVES_RESULT:
        counter = out._vc = [0]  # noqa: SLF001 - the version counter is ops' business
        return ((counter, 0),)
    saved = []
    for t in inputs:
        if isinstance(t, Tensor):
            counter = t._vc  # noqa: SLF001
            if counter is None:
                counter = t._vc = [0]  # noqa: SLF001
            saved.append((counter, counter[0]))
    return tuple(saved)


# Nodes of ops that may return a view of their first input: a view shares its base's version
# counter, as in torch, so an in-place write through either is seen by nodes that saved the other.
_VIEW_NODES = frozenset((
    "ReshapeBackward", "TransposeBackward", "PermuteBackward", "ExpandBackward", "IndexBackward",
))


def _share_version(out: Tensor, base: Any) -> None:
    """Give `out` its base's version counter when out's array is a view of base's."""
    if not isinstance(base, Tensor):
        return
    view, src = out.array, base.array
    owner = getattr(view, "base", None)
    if owner is None or not (owner is src or (owner is getattr(src, "base", None))):
        return
    counter = base._vc  # noqa: SLF001 - the version counter is ops' business
    if counter is None:
        counter = base._vc = [0]  # noqa: SLF001
    out._vc = counter  # noqa: SLF001


class UnsupportedOperand(TypeError):
    """An operand a tensor op cannot take; operators turn it into NotImplemented."""


def _keep_bfloat16(data: Any, inputs: tuple) -> Any:
    """Undo ml_dtypes' promotion of bfloat16 with Python floats to float32.

    numpy keeps float32 with a Python float (NEP 50), but ml_dtypes' bfloat16 promotes it, and
    ops multiply by Python constants all the time; torch keeps bfloat16, so cast back unless a
    float32/float64 tensor took part (then float32 is the right result, as in torch).
    """
    saw_bf16 = False
    for t in inputs:
        if isinstance(t, Tensor):
            dt = t.array.dtype
            if dt is _BF16:
                saw_bf16 = True
            elif dt.kind == "f" and dt.itemsize >= 4:
                return data
    return data.astype(_BF16) if saw_bf16 else data


def needs_grad(x: Any) -> bool:
    """True when x is a tensor that requires grad (so its gradient is worth computing)."""
    return isinstance(x, Tensor) and x.requires_grad


def val(x: Any) -> Any:
    """An operand as the op sees it: a tensor's array, a Python scalar as is.

    numpy scalars become Python scalars so that, as in torch, they do not promote a float32
    tensor to float64 (numpy treats np.float64(2.0) as a strong type, 2.0 as a weak one).
    """
    if isinstance(x, Tensor):
        return x.array
    if isinstance(x, np.generic):  # before float: np.float64 subclasses float
        return x.item()
    if isinstance(x, (int, float, bool, complex)):
        return x
    if backend.is_array(x):
        return x
    if isinstance(x, (list, tuple)):
        return np.asarray(x)
    raise UnsupportedOperand(f"unsupported operand of type {type(x).__name__!r} for a tensor op")


def cj(a: Any) -> Any:
    """The complex conjugate of a complex array or number; anything real as it is.

    Backward closures multiply the incoming gradient by the conjugate of the local derivative:
    torch's convention for complex autograd (the conjugate Wirtinger derivative), which on real
    data is the plain chain rule.
    """
    dt = getattr(a, "dtype", None)
    if dt is not None:
        return a.conj() if dt.kind == "c" else a
    return a.conjugate() if isinstance(a, complex) else a


def real_grad(g: Any, like: Any) -> Any:
    """A gradient for a real input: the real part of a complex `g` (torch's engine drops the
    imaginary part of a gradient flowing into a real tensor)."""
    if g.dtype.kind == "c" and like.dtype.kind != "c":
        return g.real
    return g


def shape_of(x: Any) -> tuple:
    """The shape of an operand (() for a Python scalar)."""
    return getattr(x, "shape", ())


def unbroadcast(g: Any, shape: tuple) -> Any:
    """Sum a broadcast gradient back down to `shape` (the inverse of numpy broadcasting)."""
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1
    )
    if not axes:
        return g.reshape(shape)
    if is_reduced_float(g.dtype):
        # A bfloat16/float16 running sum stops growing once it reaches 2**8 (2**11) times the
        # addend: add up in float32 and round once, as torch's reductions do.
        return g.sum(axis=axes, keepdims=True, dtype=np.float32).astype(g.dtype).reshape(shape)
    return g.sum(axis=axes, keepdims=True).reshape(shape)


def broadcast_error(op: str, a: Any, b: Any, exc: Exception) -> ShapeError:
    """The ShapeError for operands that do not broadcast."""
    return ShapeError(
        f"{op}: cannot broadcast shapes {tuple(shape_of(a))} and {tuple(shape_of(b))} "
        f"(trailing dimensions must match or be 1)."
    )


def norm_dims(dim: Any, ndim: int, op: str) -> tuple | None:
    """Normalise a dim argument (int, tuple, None) to a tuple of non-negative axes."""
    if dim is None:
        return None
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    out = []
    for d in dims:
        if not -max(ndim, 1) <= d < max(ndim, 1):
            raise DimError(
                f"{op}: dimension {d} is out of range for a tensor of {ndim} dimensions."
            )
        out.append(d % max(ndim, 1))
    return tuple(out)


def xp_of(arr: Any) -> Any:
    """numpy or cupy, whichever `arr` belongs to."""
    return np if isinstance(arr, np.ndarray) else backend.array_module(arr)
