"""torch's products and matrix helpers: dot, vdot, inner, outer, kron, einsum, trace, diag,
diagonal, tril, triu (and their index forms), addmm, addmv, baddbmm, addbmm, cdist, dist.

The fused forms (addmm and friends, outer, kron, dot) compose core's differentiable ops, so
their gradients are those ops'; einsum, trace, diagonal, tril/triu and cdist carry their own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.core.amp.autocast_mode import STATE as _AMP, autocast
from shoal.core.ops import _autocast, arith, derived, linalg, reduce, shape as _shape
from shoal.core.ops._opmath import narrow, widen
from shoal.core.ops._util import needs_grad, result, wrap, xp_of
from shoal.core.ops.indexing import dim_of
from shoal.core.tensor import Tensor

_TORCH_TYPE = {"float32": "Float", "float64": "Double", "float16": "Half",
               "bfloat16": "BFloat16", "int64": "Long", "int32": "Int"}


def _same_dtype(op: str, a: Tensor, b: Tensor) -> None:
    if a.array.dtype != b.array.dtype:
        na, nb = (_TORCH_TYPE.get(t.array.dtype.name, t.array.dtype.name) for t in (a, b))
        raise RuntimeError(f"{op} : expected both vectors to have same dtype, but found {na} "
                           f"and {nb}")


def dot(input: Tensor, tensor: Tensor) -> Tensor:  # noqa: A002
    """The inner product of two 1-D tensors of one dtype and size."""
    if input.ndim != 1 or tensor.ndim != 1:
        raise RuntimeError(f"1D tensors expected, but got {input.ndim}D and {tensor.ndim}D "
                           f"tensors")
    _same_dtype("dot", input, tensor)
    if input.shape[0] != tensor.shape[0]:
        raise RuntimeError(f"inconsistent tensor size, expected tensor [{input.shape[0]}] and "
                           f"src [{tensor.shape[0]}] to have the same number of elements, but "
                           f"got {input.shape[0]} and {tensor.shape[0]} elements respectively")
    a, b = input.array, tensor.array
    xp = xp_of(a)
    out = xp.asarray(xp.dot(a, b))

    def backward(g: Any) -> tuple:
        return (g * b if needs_grad(input) else None, g * a if needs_grad(tensor) else None)

    return result(out, "DotBackward", backward, (input, tensor))


def vdot(input: Tensor, other: Tensor) -> Tensor:  # noqa: A002
    """dot with the first argument conjugated (equal to dot for real tensors)."""
    if input.array.dtype.kind == "c":
        input = input.conj()  # noqa: A001 - torch's argument name
    return dot(input, other)


def inner(input: Tensor, other: Tensor) -> Tensor:  # noqa: A002
    """The sum of products over the last dims (a scalar times a tensor when either is 0-D)."""
    if input.ndim == 0 or other.ndim == 0:
        return arith.mul(input, other)
    if input.shape[-1] != other.shape[-1]:
        raise RuntimeError(f"inner() the last dimension must match on both input tensors but "
                           f"got shapes {list(input.shape)} and {list(other.shape)}")
    letters = "abcdefghijklmnopqrstuvwxy"
    a = letters[:input.ndim - 1]
    b = letters[input.ndim - 1:input.ndim + other.ndim - 2]
    return einsum(f"{a}z,{b}z->{a}{b}", input, other)


def outer(input: Tensor, vec2: Tensor) -> Tensor:  # noqa: A002
    """The outer product of two 1-D tensors."""
    if input.ndim != 1 or vec2.ndim != 1:
        raise RuntimeError("outer: expected 1-D tensors")
    return arith.mul(_shape.unsqueeze(input, 1), _shape.unsqueeze(vec2, 0))


ger = outer


def kron(input: Tensor, other: Tensor) -> Tensor:  # noqa: A002
    """The Kronecker product: every element of input times a block of other."""
    nd = max(input.ndim, other.ndim)
    a = _shape.reshape(input, (1,) * (nd - input.ndim) + tuple(input.shape))
    b = _shape.reshape(other, (1,) * (nd - other.ndim) + tuple(other.shape))
    # interleave: a's dims at even places, b's at odd ones, then merge each pair
    a_shape = sum(((n, 1) for n in a.shape), ())
    b_shape = sum(((1, n) for n in b.shape), ())
    prod = arith.mul(_shape.reshape(a, a_shape), _shape.reshape(b, b_shape))
    return _shape.reshape(prod, tuple(m * n for m, n in zip(a.shape, b.shape)))


def einsum(equation: str, *operands: Any) -> Tensor:
    """numpy's einsum over tensors, with the gradient of each operand by einsum again."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if _AMP.active and len(operands) > 1:  # torch contracts pairs with bmm: autocast's lower list
        operands = _autocast.cast("matmul", *operands)
    kinds = [t.array.dtype for t in operands]
    arrays = [widen(t.array) for t in operands]  # numpy's einsum has no bfloat16 loops
    xp = xp_of(arrays[0])
    eq = equation.replace(" ", "")
    try:
        out = xp.asarray(xp.einsum(eq, *arrays, optimize=len(arrays) > 2))
        out = narrow(out, kinds[0]) if all(k == kinds[0] for k in kinds) else out
    except ValueError as exc:
        raise RuntimeError(f"einsum(): {exc}") from exc
    inputs_spec, _, out_spec = eq.partition("->")
    specs = inputs_spec.split(",")
    if _ != "->":
        out_spec = "".join(sorted(c for c in set(inputs_spec) - {","}
                                  if inputs_spec.count(c) == 1 and c != "."))

    def backward(g: Any) -> tuple:
        return tuple(_einsum_grad(xp, widen(g), specs, out_spec, arrays, i).astype(kinds[i])
                     if needs_grad(t) else None for i, t in enumerate(operands))

    return result(out, "EinsumBackward", backward, tuple(operands))


def _einsum_grad(xp: Any, g: Any, specs: list, out_spec: str, arrays: list, i: int) -> Any:
    """d(einsum)/d operand i: g and the other operands contracted back to operand i's spec."""
    if "." in "".join(specs) or len(set(specs[i])) != len(specs[i]):
        raise RuntimeError("einsum backward: ellipses and repeated indices within one operand "
                           "are not supported for gradients in shoal")
    target = specs[i]
    others = [s for j, s in enumerate(specs) if j != i]
    available = set(out_spec).union(*others) if others else set(out_spec)
    kept = "".join(c for c in target if c in available)
    eq = ",".join([out_spec] + others) + "->" + kept
    part = xp.einsum(eq, g, *[a for j, a in enumerate(arrays) if j != i])
    if kept != target:  # letters summed only inside operand i: broadcast back over them
        shape = [arrays[i].shape[target.index(c)] if c in kept else 1 for c in target]
        part = xp.broadcast_to(part.reshape(shape), arrays[i].shape)
    return xp.ascontiguousarray(part).astype(arrays[i].dtype, copy=False)


def trace(input: Tensor) -> Tensor:  # noqa: A002
    """The sum of a 2-D tensor's main diagonal."""
    if input.ndim != 2:
        raise RuntimeError("trace: expected a matrix, but got tensor with dim "
                           f"{input.ndim}")
    return reduce.sum(diagonal(input))


def diagonal(input: Tensor, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Tensor:  # noqa: A002
    """The diagonal of the (dim1, dim2) planes, moved to the last dim."""
    xd = input.array
    d1, d2 = dim_of(dim1, xd.ndim), dim_of(dim2, xd.ndim)
    if d1 == d2:
        raise RuntimeError(f"diagonal dimensions cannot be identical {dim1}, {dim2}")
    xp = xp_of(xd)
    out = xp.diagonal(xd, offset, d1, d2).copy()

    def backward(g: Any) -> tuple:
        grad = xp.zeros(xd.shape, g.dtype)
        view = xp.moveaxis(grad, (d1, d2), (-2, -1))
        n = g.shape[-1]
        rows = xp.arange(n) + max(-offset, 0)
        cols = xp.arange(n) + max(offset, 0)
        view[..., rows, cols] = g
        return (grad,)

    return result(out, "DiagonalBackward", backward, (input,))


def diag(input: Tensor, diagonal: int = 0) -> Tensor:  # noqa: A002
    """A 1-D tensor's square matrix with it on a diagonal, or a 2-D tensor's diagonal."""
    if input.ndim == 2:
        return globals()["diagonal"](input, diagonal)
    if input.ndim != 1:
        raise RuntimeError("diag(): Supports 1D or 2D tensors. Got " f"{input.ndim}D")
    xd = input.array
    xp = xp_of(xd)
    out = xp.diag(xd, diagonal)

    def backward(g: Any) -> tuple:
        return (xp.diagonal(g, diagonal).copy(),)

    return result(out, "DiagBackward", backward, (input,))


def diag_embed(input: Tensor, offset: int = 0, dim1: int = -2, dim2: int = -1) -> Tensor:  # noqa: A002
    """Matrices with input's last dim on their diagonal (the inverse of diagonal)."""
    if (dim1, dim2) != (-2, -1):
        raise NotImplementedError("diag_embed: shoal places the diagonal in the last two dims")
    xd = input.array
    xp = xp_of(xd)
    n = xd.shape[-1] + abs(offset)
    out = xp.zeros(xd.shape[:-1] + (n, n), xd.dtype)
    rows = xp.arange(xd.shape[-1]) + max(-offset, 0)
    cols = xp.arange(xd.shape[-1]) + max(offset, 0)
    out[..., rows, cols] = xd

    def backward(g: Any) -> tuple:
        return (g[..., rows, cols],)

    return result(out, "DiagEmbedBackward", backward, (input,))


def _triangle(input: Tensor, diagonal: int, lower: bool) -> Tensor:  # noqa: A002
    if input.ndim < 2:
        raise RuntimeError(f"{'tril' if lower else 'triu'}: input tensor must have at least 2 "
                           f"dimensions")
    xd = input.array
    xp = xp_of(xd)
    fn = xp.tril if lower else xp.triu
    out = fn(xd, diagonal)
    return result(out, "TrilBackward" if lower else "TriuBackward",
                  lambda g: (fn(g, diagonal),), (input,))


def tril(input: Tensor, diagonal: int = 0) -> Tensor:  # noqa: A002
    """The lower triangle of the last two dims (the rest zeroed)."""
    return _triangle(input, diagonal, True)


def triu(input: Tensor, diagonal: int = 0) -> Tensor:  # noqa: A002
    """The upper triangle of the last two dims (the rest zeroed)."""
    return _triangle(input, diagonal, False)


def tril_indices(row: int, col: int, offset: int = 0, *, dtype: Any = None, **_: Any) -> Tensor:
    """The (2, n) int64 positions of a row x col matrix's lower triangle."""
    return wrap(np.stack(np.tril_indices(row, offset, col)).astype(np.int64))


def triu_indices(row: int, col: int, offset: int = 0, *, dtype: Any = None, **_: Any) -> Tensor:
    """The (2, n) int64 positions of a row x col matrix's upper triangle."""
    return wrap(np.stack(np.triu_indices(row, offset, col)).astype(np.int64))


def _fused(input: Tensor, product: Tensor, beta: Any, alpha: Any) -> Tensor:  # noqa: A002
    """beta * input + alpha * product; beta 0 ignores input (NaN included), as torch does."""
    scaled = product if alpha == 1 else arith.mul(product, alpha)
    if beta == 0:
        return scaled
    return arith.add(input if beta == 1 else arith.mul(input, beta), scaled)


def _lower(*inputs: Any) -> tuple:
    """The fused matrix products are on torch's autocast lower-precision list: every input."""
    return _autocast.cast("matmul", *inputs) if _AMP.active else inputs


def addmm(input: Tensor, mat1: Tensor, mat2: Tensor, *, beta: Any = 1, alpha: Any = 1) -> Tensor:  # noqa: A002
    """beta * input + alpha * (mat1 @ mat2)."""
    input, mat1, mat2 = _lower(input, mat1, mat2)  # noqa: A001 - torch's argument name
    return _fused(input, derived.mm(mat1, mat2), beta, alpha)


def addmv(input: Tensor, mat: Tensor, vec: Tensor, *, beta: Any = 1, alpha: Any = 1) -> Tensor:  # noqa: A002
    """beta * input + alpha * (mat @ vec)."""
    if mat.ndim != 2 or vec.ndim != 1:
        raise RuntimeError(f"vector + matrix @ vector expected, got {input.ndim}, {mat.ndim}, "
                           f"{vec.ndim}")
    with autocast("cpu", enabled=False), autocast("cuda", enabled=False):
        # torch's autocast leaves addmv in float32 on the CPU (it is not on the lower list)
        return _fused(input, linalg.matmul(mat, vec), beta, alpha)


def baddbmm(input: Tensor, batch1: Tensor, batch2: Tensor, *, beta: Any = 1,  # noqa: A002
            alpha: Any = 1) -> Tensor:
    """beta * input + alpha * (batch1 @ batch2), batch by batch."""
    input, batch1, batch2 = _lower(input, batch1, batch2)  # noqa: A001 - torch's argument name
    return _fused(input, derived.bmm(batch1, batch2), beta, alpha)


def addbmm(input: Tensor, batch1: Tensor, batch2: Tensor, *, beta: Any = 1,  # noqa: A002
           alpha: Any = 1) -> Tensor:
    """beta * input + alpha * the sum over batches of batch1 @ batch2."""
    input, batch1, batch2 = _lower(input, batch1, batch2)  # noqa: A001 - torch's argument name
    return _fused(input, reduce.sum(derived.bmm(batch1, batch2), 0), beta, alpha)


def cdist(x1: Tensor, x2: Tensor, p: float = 2.0, compute_mode: Any = None) -> Tensor:
    """The p-norm distance between each row of x1 and each row of x2 (batched)."""
    if x1.ndim < 2 or x2.ndim < 2:
        raise RuntimeError(f"cdist only supports at least 2D tensors, X1 got: {x1.ndim}D")
    if x1.shape[-1] != x2.shape[-1]:
        raise RuntimeError(f"X1 and X2 must have the same number of columns. X1: "
                           f"{x1.shape[-1]} X2: {x2.shape[-1]}")
    if p < 0:
        raise RuntimeError(f"cdist only supports non-negative p values, got {p}")
    a, b = x1.array, x2.array
    xp = xp_of(a)
    diff = a[..., :, None, :] - b[..., None, :, :]
    ad = xp.abs(diff)
    if p == np.inf:
        out = ad.max(axis=-1)
    elif p == 0:
        out = (ad != 0).sum(axis=-1).astype(a.dtype)
    else:
        out = (ad ** p).sum(axis=-1) ** (1.0 / p)

    def backward(g: Any) -> tuple:
        with np.errstate(all="ignore"):
            if p == np.inf:
                w = (ad == out[..., None]) * xp.sign(diff)
            elif p == 0:
                w = xp.zeros_like(diff)
            else:  # d||d||_p / d d_k = sign(d_k) |d_k|^(p-1) / ||d||^(p-1); 0 at distance 0
                w = xp.sign(diff) * ad ** (p - 1) / out[..., None] ** (p - 1)
                w = xp.where(out[..., None] == 0, 0, w)
        gd = g[..., None] * w
        g1 = gd.sum(axis=-2) if needs_grad(x1) else None
        g2 = -gd.sum(axis=-3) if needs_grad(x2) else None
        return (_sum_to(g1, a.shape), _sum_to(g2, b.shape))

    return result(out.astype(a.dtype, copy=False), "CdistBackward", backward, (x1, x2))


def _sum_to(g: Any, shape: tuple) -> Any:
    if g is None or g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    g = g.sum(axis=tuple(range(lead))) if lead else g
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


def dist(input: Tensor, other: Tensor, p: float = 2) -> Tensor:  # noqa: A002
    """The p-norm of input - other."""
    return derived.norm(arith.sub(input, other), p)
