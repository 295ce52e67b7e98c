"""Complex numbers: complex, polar, real, imag, conj, angle, sgn, view_as_real/view_as_complex.

Gradients follow torch's convention for complex autograd: a tensor's `.grad` is the conjugate
Wirtinger derivative scaled by two, dL/dRe + i dL/dIm for a real loss L. So a backward closure
multiplies the incoming gradient by the conjugate of the local derivative (core/ops/_util.py's
`cj`), a real input of a complex output gets the real part of that product, and a complex input
of a real output gets the real gradient times dRe + i dIm of the output.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.core.ops._util import broadcast_error, needs_grad, result, unbroadcast, xp_of
from shoal.core.tensor import Tensor

_COMPLEX_OF = {np.dtype(np.float16): np.dtype(np.complex64),  # numpy has no complex32
               np.dtype(np.float32): np.dtype(np.complex64),
               np.dtype(np.float64): np.dtype(np.complex128)}
_SCALAR_NAME = {"float16": "Half", "float32": "Float", "float64": "Double", "int64": "Long",
                "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte", "bool": "Bool",
                "bfloat16": "BFloat16", "complex64": "ComplexFloat",
                "complex128": "ComplexDouble"}


def _scalar_name(dt: np.dtype) -> str:
    """torch's ScalarType name of a numpy dtype, for error messages that match torch's."""
    return _SCALAR_NAME.get(dt.name, "BFloat16" if dt.kind == "V" else dt.name)


def is_complex(x: Tensor) -> bool:
    """True when x holds complex64 or complex128 values."""
    return x.array.dtype.kind == "c"


def _check_pair(a: Tensor, b: Tensor) -> np.dtype:
    """The complex dtype for two real parts, refusing what torch refuses."""
    da, db = a.array.dtype, b.array.dtype
    if da != db:
        raise RuntimeError(
            f"Expected object of scalar type {_scalar_name(da)} but got scalar type "
            f"{_scalar_name(db)} for second argument"
        )
    if da not in _COMPLEX_OF:
        raise RuntimeError(
            f"Expected both inputs to be Half, Float or Double tensors but got "
            f"{_scalar_name(da)} and {_scalar_name(db)}"
        )
    return _COMPLEX_OF[da]


def complex(real: Tensor, imag: Tensor) -> Tensor:  # noqa: A001 - torch's name
    """real + i * imag, broadcast; both parts must share a floating dtype."""
    dt = _check_pair(real, imag)
    rd, idt = real.array, imag.array
    try:
        out = (rd + 1j * idt.astype(dt)).astype(dt)
    except ValueError as exc:
        raise broadcast_error("complex", rd, idt, exc) from exc

    def backward(g: Any) -> tuple:
        return (
            unbroadcast(g.real, rd.shape).astype(rd.dtype) if needs_grad(real) else None,
            unbroadcast(g.imag, idt.shape).astype(idt.dtype) if needs_grad(imag) else None,
        )

    return result(out, "ComplexBackward", backward, (real, imag), exact_dtype=True)


def polar(abs: Tensor, angle: Tensor) -> Tensor:  # noqa: A002 - torch's names
    """abs * (cos(angle) + i sin(angle)), broadcast."""
    dt = _check_pair(abs, angle)
    r, theta = abs.array, angle.array
    xp = xp_of(r)
    try:
        unit = (xp.cos(theta) + 1j * xp.sin(theta)).astype(dt)
        out = (r * unit).astype(dt)
    except ValueError as exc:
        raise broadcast_error("polar", r, theta, exc) from exc

    def backward(g: Any) -> tuple:
        # d out / d abs = unit, d out / d angle = i * out: each real input gets Re(g * conj(d)).
        ga = gt = None
        if needs_grad(abs):
            ga = unbroadcast((g * unit.conj()).real, r.shape).astype(r.dtype)
        if needs_grad(angle):
            gt = unbroadcast((g * (1j * out).conj()).real, theta.shape).astype(theta.dtype)
        return ga, gt

    return result(out, "PolarBackward", backward, (abs, angle), exact_dtype=True)


def real(x: Tensor) -> Tensor:
    """The real part (a view of a complex tensor's storage); a real tensor itself."""
    xd = x.array
    if xd.dtype.kind != "c":
        return x

    def backward(g: Any) -> tuple:
        return (g.astype(xd.dtype),)

    return result(xd.real, "RealBackward", backward, (x,), exact_dtype=True)


def imag(x: Tensor) -> Tensor:
    """The imaginary part (a view of a complex tensor's storage)."""
    xd = x.array
    if xd.dtype.kind != "c":
        raise RuntimeError("imag is not implemented for tensors with non-complex dtypes.")

    def backward(g: Any) -> tuple:
        return ((1j * g).astype(xd.dtype),)

    return result(xd.imag, "ImagBackward", backward, (x,), exact_dtype=True)


def conj(x: Tensor) -> Tensor:
    """The complex conjugate; a real tensor itself, as in torch."""
    xd = x.array
    if xd.dtype.kind != "c":
        return x

    def backward(g: Any) -> tuple:
        return (g.conj(),)

    return result(xd.conj(), "ConjBackward", backward, (x,), exact_dtype=True)


def conj_physical(x: Tensor) -> Tensor:
    """The complex conjugate, computed (shoal's conj always is); a real tensor itself."""
    return conj(x)


def resolve_conj(x: Tensor) -> Tensor:
    """x itself: shoal never defers a conjugation, so there is none to resolve."""
    return x


def resolve_neg(x: Tensor) -> Tensor:
    """x itself: shoal never defers a negation, so there is none to resolve."""
    return x


def angle(x: Tensor) -> Tensor:
    """The argument of each element: atan2(imag, real); 0 or pi for real values."""
    xd = x.array
    xp = xp_of(xd)
    if xd.dtype.kind != "c":
        src = xd if xd.dtype.kind == "f" or xd.dtype.kind == "V" else xd.astype(np.float32)
        out = xp.where(src < 0, np.pi, 0).astype(src.dtype)
        out = xp.where(xp.isnan(src), src, out)

        def backward_real(g: Any) -> tuple:
            return (xp.zeros_like(g),)

        return result(out, "AngleBackward", backward_real, (x,), exact_dtype=True)
    out = xp.angle(xd)

    def backward(g: Any) -> tuple:
        # d angle = (x dy - y dx) / |z|^2, so the gradient is g * i z / |z|^2 (0 at z = 0).
        mag2 = (xd * xd.conj()).real
        safe = xp.where(mag2 == 0, 1, mag2)
        return (xp.where(mag2 == 0, 0, g * (1j * xd) / safe).astype(xd.dtype),)

    return result(out, "AngleBackward", backward, (x,), exact_dtype=True)


def sgn(x: Tensor) -> Tensor:
    """z / |z| for complex values (0 at 0); the sign of real ones, as torch.sgn."""
    xd = x.array
    xp = xp_of(xd)
    if xd.dtype.kind != "c":
        out = xp.sign(xd)

        def backward_real(g: Any) -> tuple:
            return (xp.zeros_like(g),)

        return result(out, "SgnBackward", backward_real, (x,), exact_dtype=True)
    mag = xp.abs(xd)
    safe = xp.where(mag == 0, 1, mag)
    out = xp.where(mag == 0, 0, xd / safe).astype(xd.dtype)

    def backward(g: Any) -> tuple:
        # torch's sgn_backward: (g - Re(g * conj(sgn)) * sgn) / |z|, 0 at z = 0.
        proj = (g * out.conj()).real * out
        return (xp.where(mag == 0, 0, (g - proj) / safe).astype(xd.dtype),)

    return result(out, "SgnBackward", backward, (x,), exact_dtype=True)


def view_as_real(x: Tensor) -> Tensor:
    """A complex tensor as real pairs: shape (..., 2), sharing storage."""
    xd = x.array
    if xd.dtype.kind != "c":
        raise RuntimeError("view_as_real is only supported for complex tensors")
    real_dt = xd.real.dtype
    out = xd.reshape(xd.shape + (1,)).view(real_dt)

    def backward(g: Any) -> tuple:
        return (_pairs_to_complex(g, xd.dtype),)

    return result(out, "ViewAsRealBackward", backward, (x,), exact_dtype=True)


def view_as_complex(x: Tensor) -> Tensor:
    """A (..., 2) float tensor as complex values, sharing storage."""
    xd = x.array
    if xd.dtype not in _COMPLEX_OF:
        raise RuntimeError(
            "view_as_complex is only supported for half, float and double tensors, but got a "
            f"tensor of scalar type: {_scalar_name(xd.dtype)}"
        )
    if xd.ndim == 0 or xd.shape[-1] != 2:
        raise RuntimeError("Tensor must have a last dimension of size 2")
    if xd.dtype == np.float16:
        raise RuntimeError("view_as_complex: shoal has no complex32 (numpy lacks it); "
                           "cast the float16 tensor to float32 first.")
    out = _pairs_to_complex(xd, _COMPLEX_OF[xd.dtype])

    def backward(g: Any) -> tuple:
        return (g.reshape(g.shape + (1,)).view(xd.dtype),)

    return result(out, "ViewAsComplexBackward", backward, (x,), exact_dtype=True)


def _pairs_to_complex(a: Any, dt: np.dtype) -> Any:
    """(..., 2) real pairs as complex values: a view when the pairs are contiguous."""
    if not a.flags.c_contiguous:
        a = xp_of(a).ascontiguousarray(a)
    return a.view(dt).reshape(a.shape[:-1])


# Tensor methods and properties of this module (core/ops/bind.py installs them).
METHODS = {
    "conj": conj, "conj_physical": conj_physical,
    "resolve_conj": resolve_conj, "resolve_neg": resolve_neg, "angle": angle, "sgn": sgn,
}
def _part_setter(part: Any) -> Any:
    def setter(x: Tensor, value: Any) -> None:
        part(x).copy_(value)  # the part is a view: the copy lands in x's storage, as in torch

    return setter


PROPERTIES = {
    "real": property(real, _part_setter(real), doc=real.__doc__),
    "imag": property(imag, _part_setter(imag), doc=imag.__doc__),
}
