"""torch.fft's discrete Fourier transforms, on pocketfft (scipy.fft) or cupy.fft, with gradients.

Every transform is built from three primitives, each with its own backward, and a resize (the
zero-padding or trimming `n=`/`s=` ask for):

- `_c2c`: a complex transform over some dims, forward or inverse,
- `_r2c`: a real-to-complex forward transform, one-sided in the last dim,
- `_c2r`: the complex-to-real inverse of a one-sided spectrum.

A transform is linear, so its gradient is its adjoint applied to the output's gradient, under
torch's complex convention (core/ops/complex.py): the adjoint of a forward transform with
normalisation `norm` is the inverse transform with the dual normalisation ("backward" and
"forward" swap, "ortho" stays), which scales by what the forward left out. `_c2r`'s backward is
torch's: the one-sided forward transform of the gradient with the bins that stand for two
(1 .. n - m) doubled, so `.grad` equals torch's even where the spectrum's edge bins are not real.

dtypes as torch: integer and bool inputs compute in float32 (complex64 results), float64 in
complex128; torch's CPU build refuses float16 and bfloat16, and so does this module.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import scipy.fft as _sfft

from shoal.core import backend
from shoal.core import dtypes
from shoal.core.ops._util import result, xp_of
from shoal.core.ops.complex import _scalar_name
from shoal.core.ops.complex import conj as _conj
from shoal.core.tensor import Tensor

__all__ = [
    "fft", "ifft", "rfft", "irfft", "hfft", "ihfft", "fft2", "ifft2", "rfft2", "irfft2", "hfft2",
    "ihfft2", "fftn", "ifftn", "rfftn", "irfftn", "hfftn", "ihfftn", "fftfreq", "rfftfreq",
    "fftshift", "ifftshift",
]

_DUAL = {"backward": "forward", "forward": "backward", "ortho": "ortho"}
_REAL_OF = {np.dtype(np.complex64): np.dtype(np.float32),
            np.dtype(np.complex128): np.dtype(np.float64)}


def _lib(arr: Any) -> Any:
    """scipy.fft for numpy arrays (pocketfft, keeps float32 in single precision), cupy.fft else."""
    if isinstance(arr, np.ndarray):
        return _sfft
    import cupy  # noqa: PLC0415 - cuda only

    return cupy.fft


def _cfft(lib: Any, a: Any, dims: tuple, norm: str, forward: bool) -> Any:
    """A complex transform over dims. pocketfft's inverse is about 1.5x slower than its forward
    transform (2**20 points, complex64), so on the cpu the inverse is taken as
    conj(fft(conj(a))) with the dual normalisation: the same values but for the sign of zeros
    (+0.0 here)."""
    if lib is not _sfft:
        return lib.fftn(a, axes=dims, norm=norm) if forward else lib.ifftn(a, axes=dims, norm=norm)
    if forward:
        return _forward_cpu(a, dims, norm, own=False)
    if a.dtype.kind == "c":
        # the conjugate is a fresh copy, so pocketfft may transform it in place
        out = _forward_cpu(a.conj(), dims, _DUAL[norm], own=True)
    else:
        out = _forward_cpu(a, dims, _DUAL[norm], own=False)
    # conj in one pass over the imaginary half; 0 - x rather than -x so that exact zeros come
    # out +0.0 (negation would print them "-0.j")
    np.subtract(0, out.imag, out=out.imag)
    return out


# One long complex transform is taken in two passes (below) from this length on; shorter ones,
# and batches of transforms (which pocketfft already runs several at a time), go to it whole.
_SPLIT = 8
_SPLIT_FROM = 1 << 15
_TWIDDLES: dict = {}


def _forward_cpu(a: Any, dims: tuple, norm: str, own: bool) -> Any:
    """pocketfft's forward transform over dims (in place when `own`: a is a scratch copy)."""
    n = a.shape[dims[0]] if len(dims) == 1 else 0
    if a.dtype.kind == "c" and n == a.size and n >= _SPLIT_FROM and n % _SPLIT == 0:
        return _two_pass(a.reshape(n), norm).reshape(a.shape)
    return _sfft.fftn(a, axes=dims, norm=norm, overwrite_x=own)


def _two_pass(x: Any, norm: str) -> Any:
    """One complex transform of length n = 8m as eight interleaved transforms of length m (one
    pocketfft call, which runs them side by side in SIMD lanes: a single transform has none to
    fill), a twiddle, then m transforms of length 8, read out transposed (the "four-step" FFT).
    2**20 points, complex64: 5.6 ms against 9.5-12 ms for one call here, torch's MKL 7.8 ms.
    Each pass takes the same `norm`, so the scales multiply to the whole transform's."""
    m = x.size // _SPLIT
    key = (x.size, x.dtype)
    twiddle = _TWIDDLES.get(key)
    if twiddle is None:
        angle = np.outer(np.arange(m), np.arange(_SPLIT)) * (-2.0 * np.pi / x.size)
        twiddle = np.exp(1j * angle).astype(x.dtype)  # computed in float64, rounded once
        if len(_TWIDDLES) >= 4:  # a few lengths in use at a time; each table is n elements
            _TWIDDLES.pop(next(iter(_TWIDDLES)))
        _TWIDDLES[key] = twiddle
    columns = _sfft.fft(x.reshape(m, _SPLIT), axis=0, norm=norm)
    columns *= twiddle
    rows = _sfft.fft(columns, axis=1, norm=norm, overwrite_x=True)
    return np.ascontiguousarray(rows.T).reshape(x.size)


def _norm(norm: str | None) -> str:
    if norm is None:
        return "backward"
    if norm not in _DUAL:
        raise RuntimeError(f'Invalid normalization mode: "{norm}"')
    return norm


def _compute_dtype(arr: Any, want_complex: bool) -> Any:
    """The dtype a transform computes in: float32/float64, or their complex types."""
    dt = arr.dtype
    if dt.kind == "c":
        return dt
    if dt.kind == "f" and dt.itemsize == 2 or dt == dtypes.bfloat16.np:
        raise RuntimeError(f"Unsupported dtype {_scalar_name(dt)}")
    real = dt if dt.kind == "f" else np.dtype(np.float32)  # ints and bools: the default float
    if not want_complex:
        return real
    return np.dtype(np.complex128) if real == np.float64 else np.dtype(np.complex64)


def _require_real(x: Tensor, op: str) -> None:
    if x.array.dtype.kind == "c":
        raise RuntimeError(
            f"{op} expects a real input tensor, but got {_scalar_name(x.array.dtype)}")


def _dim_error(d: int, ndim: int) -> IndexError:
    if ndim == 0:
        return IndexError(f"Dimension specified as {d} but tensor has no dimensions")
    return IndexError(
        f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {d})")


def _dims_sizes(x: Tensor, s: Sequence[int] | None, dim: Any) -> tuple:
    """(dims, sizes) for an n-d transform: torch's rules for s= and dim= together."""
    ndim, shape = x.array.ndim, x.array.shape
    if isinstance(dim, int):
        dim = (dim,)
    if dim is None:
        dim = tuple(range(ndim - len(s), ndim)) if s is not None else tuple(range(ndim))
    elif s is not None and len(s) != len(dim):
        raise RuntimeError("When given, dim and shape arguments must have the same length")
    dims = []
    for d in dim:
        if not -ndim <= d < ndim:
            raise _dim_error(d, ndim)
        dims.append(d % ndim)
    if len(set(dims)) != len(dims):
        raise RuntimeError("FFT dims must be unique")
    sizes = [shape[d] for d in dims] if s is None else [
        shape[d] if n == -1 else n for d, n in zip(dims, s)]
    for n in sizes:
        if n < 1:
            raise RuntimeError(f"Invalid number of data points ({n}) specified")
    return tuple(dims), tuple(sizes)


def _resize_array(a: Any, dims: tuple, sizes: tuple) -> Any:
    """a trimmed or zero-padded to `sizes` along `dims` (a at once when nothing changes)."""
    if all(a.shape[d] == n for d, n in zip(dims, sizes)):
        return a
    index = [slice(None)] * a.ndim
    shape = list(a.shape)
    for d, n in zip(dims, sizes):
        index[d] = slice(0, min(n, a.shape[d]))
        shape[d] = n
    out = xp_of(a).zeros(shape, dtype=a.dtype)
    out[tuple(index)] = a[tuple(index)]
    return out


def _resize(x: Tensor, dims: tuple, sizes: tuple) -> Tensor:
    """x trimmed or zero-padded along dims, with the gradient trimmed or padded back."""
    xd = x.array
    out = _resize_array(xd, dims, sizes)
    if out is xd:
        return x
    original = tuple(xd.shape[d] for d in dims)

    def backward(g: Any) -> tuple:
        return (_resize_array(g, dims, original),)

    return result(out, "FftResizeBackward", backward, (x,), exact_dtype=True)


def _c2c(x: Tensor, dims: tuple, norm: str, forward: bool) -> Tensor:
    """A complex transform over dims (a real input is taken as complex; its gradient is real)."""
    xd = x.array
    cdt = _compute_dtype(xd, True)
    lib = _lib(xd)
    src = xd if xd.dtype.kind == "c" or not isinstance(xd, np.ndarray) else xd.astype(
        _REAL_OF[cdt], copy=False)
    out = _cfft(lib, src, dims, norm, forward).astype(cdt, copy=False)
    real_input = xd.dtype.kind != "c"
    if real_input and (forward or lib is not _sfft):  # (_cfft's inverse has made them +0.0)
        # pocketfft fills the mirrored half of a real input's spectrum by conjugation, leaving
        # -0.0 imaginary parts on the real bins (DC, Nyquist); adding +0.0 makes them +0.0 as
        # torch prints them ([6.+0.j, -2.+2.j, -2.+0.j, -2.-2.j] for arange(4)), values unchanged.
        out += 0

    def backward(g: Any) -> tuple:
        gi = _cfft(lib, g, dims, _DUAL[norm], not forward).astype(cdt, copy=False)
        return ((gi.real.astype(xd.dtype) if real_input else gi),)

    return result(out, "FftC2CBackward", backward, (x,), exact_dtype=True)


def _r2c(x: Tensor, dims: tuple, norm: str) -> Tensor:
    """The one-sided forward transform of a real input over dims (halved in the last)."""
    xd = x.array
    rdt = _compute_dtype(xd, False)
    lib = _lib(xd)
    src = xd.astype(rdt, copy=False)
    out = lib.rfftn(src, axes=dims, norm=norm)
    cdt = out.dtype
    n_last = xd.shape[dims[-1]]

    def backward(g: Any) -> tuple:
        # The adjoint of "full transform, keep the first m bins": zero-pad, inverse, real part.
        full = _resize_array(g, (dims[-1],), (n_last,))
        gi = _cfft(lib, full, dims, _DUAL[norm], False).astype(cdt, copy=False)
        return (gi.real.astype(xd.dtype),)

    return result(out, "FftR2CBackward", backward, (x,), exact_dtype=True)


def _c2r(x: Tensor, dims: tuple, n_last: int, norm: str) -> Tensor:
    """The real inverse of a one-sided spectrum over dims, n_last points in the last dim."""
    xd = x.array
    cdt = _compute_dtype(xd, True)
    lib = _lib(xd)
    src = xd.astype(cdt, copy=False)
    sizes = tuple(xd.shape[d] for d in dims[:-1]) + (n_last,)
    out = lib.irfftn(src, s=sizes, axes=dims, norm=norm).astype(_REAL_OF[cdt], copy=False)
    m = xd.shape[dims[-1]]

    def backward(g: Any) -> tuple:
        gi = lib.rfftn(g, axes=dims, norm=_DUAL[norm]).astype(cdt, copy=False)
        double = n_last - m
        if double > 0:  # bins 1 .. n - m stand for themselves and their mirror image
            index = [slice(None)] * gi.ndim
            index[dims[-1]] = slice(1, 1 + double)
            gi[tuple(index)] *= 2
        return (gi if xd.dtype.kind == "c" else gi.real.astype(xd.dtype),)

    return result(out, "FftC2RBackward", backward, (x,), exact_dtype=True)


# -- the public transforms ------------------------------------------------------------------
def fftn(input: Tensor, s: Sequence[int] | None = None, dim: Any = None,  # noqa: A002
         norm: str | None = None) -> Tensor:
    """The n-dimensional discrete Fourier transform (all dims by default)."""
    dims, sizes = _dims_sizes(input, s, dim)
    return _c2c(_resize(input, dims, sizes), dims, _norm(norm), True)


def ifftn(input: Tensor, s: Sequence[int] | None = None, dim: Any = None,  # noqa: A002
          norm: str | None = None) -> Tensor:
    """The n-dimensional inverse discrete Fourier transform."""
    dims, sizes = _dims_sizes(input, s, dim)
    return _c2c(_resize(input, dims, sizes), dims, _norm(norm), False)


def rfftn(input: Tensor, s: Sequence[int] | None = None, dim: Any = None,  # noqa: A002
          norm: str | None = None) -> Tensor:
    """The n-dimensional transform of a real input, one-sided in the last dim."""
    _require_real(input, "rfftn")
    dims, sizes = _dims_sizes(input, s, dim)
    return _r2c(_resize(input, dims, sizes), dims, _norm(norm))


def irfftn(input: Tensor, s: Sequence[int] | None = None, dim: Any = None,  # noqa: A002
           norm: str | None = None) -> Tensor:
    """The inverse of rfftn: a real output, 2 * (m - 1) points in the last dim by default."""
    dims, sizes = _c2r_dims(input, s, dim)
    half = sizes[:-1] + (sizes[-1] // 2 + 1,)
    return _c2r(_resize(input, dims, half), dims, sizes[-1], _norm(norm))


def hfftn(input: Tensor, s: Sequence[int] | None = None, dim: Any = None,  # noqa: A002
          norm: str | None = None) -> Tensor:
    """The n-dimensional transform of a Hermitian-symmetric signal given one-sided: real out."""
    dims, sizes = _c2r_dims(input, s, dim)
    half = sizes[:-1] + (sizes[-1] // 2 + 1,)
    return _c2r(_conj(_resize(input, dims, half)), dims, sizes[-1], _DUAL[_norm(norm)])


def ihfftn(input: Tensor, s: Sequence[int] | None = None, dim: Any = None,  # noqa: A002
           norm: str | None = None) -> Tensor:
    """The inverse of hfftn: a real input's one-sided inverse transform."""
    _require_real(input, "ihfftn")
    dims, sizes = _dims_sizes(input, s, dim)
    return _conj(_r2c(_resize(input, dims, sizes), dims, _DUAL[_norm(norm)]))


def _c2r_dims(x: Tensor, s: Sequence[int] | None, dim: Any) -> tuple:
    """dims and output sizes of a complex-to-real transform: the last size defaults to
    2 * (m - 1) for an input of m points there."""
    dims, sizes = _dims_sizes(x, s, dim)
    if s is None:
        last = 2 * (x.array.shape[dims[-1]] - 1)
    else:
        last = s[-1] if s[-1] != -1 else 2 * (x.array.shape[dims[-1]] - 1)
    if last < 1:
        raise RuntimeError(f"Invalid number of data points ({last}) specified")
    return dims, sizes[:-1] + (last,)


def _one(n: int | None, dim: int) -> tuple:
    return (None if n is None else (n,)), (dim,)


def fft(input: Tensor, n: int | None = None, dim: int = -1,  # noqa: A002 - torch's names
        norm: str | None = None) -> Tensor:
    """The one-dimensional discrete Fourier transform along dim, of n points (pad or trim)."""
    return fftn(input, *_one(n, dim), norm)


def ifft(input: Tensor, n: int | None = None, dim: int = -1,  # noqa: A002
         norm: str | None = None) -> Tensor:
    """The one-dimensional inverse discrete Fourier transform."""
    return ifftn(input, *_one(n, dim), norm)


def rfft(input: Tensor, n: int | None = None, dim: int = -1,  # noqa: A002
         norm: str | None = None) -> Tensor:
    """The transform of a real input: the n // 2 + 1 non-negative frequencies."""
    _require_real(input, "rfft")
    return rfftn(input, *_one(n, dim), norm)


def irfft(input: Tensor, n: int | None = None, dim: int = -1,  # noqa: A002
          norm: str | None = None) -> Tensor:
    """The inverse of rfft: n real points (2 * (m - 1) by default)."""
    return irfftn(input, *_one(n, dim), norm)


def hfft(input: Tensor, n: int | None = None, dim: int = -1,  # noqa: A002
         norm: str | None = None) -> Tensor:
    """The transform of a Hermitian-symmetric signal given by its first half: real output."""
    return hfftn(input, *_one(n, dim), norm)


def ihfft(input: Tensor, n: int | None = None, dim: int = -1,  # noqa: A002
          norm: str | None = None) -> Tensor:
    """The inverse of hfft: the one-sided inverse transform of a real input."""
    _require_real(input, "ihfft")
    return ihfftn(input, *_one(n, dim), norm)


def fft2(input: Tensor, s: Sequence[int] | None = None, dim: Any = (-2, -1),  # noqa: A002
         norm: str | None = None) -> Tensor:
    """The two-dimensional transform (the last two dims by default)."""
    return fftn(input, s, dim, norm)


def ifft2(input: Tensor, s: Sequence[int] | None = None, dim: Any = (-2, -1),  # noqa: A002
          norm: str | None = None) -> Tensor:
    """The two-dimensional inverse transform."""
    return ifftn(input, s, dim, norm)


def rfft2(input: Tensor, s: Sequence[int] | None = None, dim: Any = (-2, -1),  # noqa: A002
          norm: str | None = None) -> Tensor:
    """The two-dimensional transform of a real input, one-sided in the last dim."""
    _require_real(input, "rfft2")
    return rfftn(input, s, dim, norm)


def irfft2(input: Tensor, s: Sequence[int] | None = None, dim: Any = (-2, -1),  # noqa: A002
           norm: str | None = None) -> Tensor:
    """The inverse of rfft2."""
    return irfftn(input, s, dim, norm)


def hfft2(input: Tensor, s: Sequence[int] | None = None, dim: Any = (-2, -1),  # noqa: A002
          norm: str | None = None) -> Tensor:
    """The two-dimensional hfft."""
    return hfftn(input, s, dim, norm)


def ihfft2(input: Tensor, s: Sequence[int] | None = None, dim: Any = (-2, -1),  # noqa: A002
           norm: str | None = None) -> Tensor:
    """The two-dimensional ihfft."""
    _require_real(input, "ihfft2")
    return ihfftn(input, s, dim, norm)


# -- frequencies and shifts -----------------------------------------------------------------
def _freq_tensor(values: np.ndarray, dtype: Any, device: Any, requires_grad: bool) -> Tensor:
    dev = backend.device(device)
    dt = dtypes.to_np(dtypes.float32 if dtype is None else dtype, dev.type)
    arr = backend.to_device(values.astype(dt), dev)
    return Tensor(arr, requires_grad=requires_grad)


def fftfreq(n: int, d: float = 1.0, *, dtype: Any = None, device: Any = None,
            requires_grad: bool = False) -> Tensor:
    """The sample frequencies of an n-point transform with sample spacing d."""
    return _freq_tensor(_sfft.fftfreq(n, d), dtype, device, requires_grad)


def rfftfreq(n: int, d: float = 1.0, *, dtype: Any = None, device: Any = None,
             requires_grad: bool = False) -> Tensor:
    """The non-negative sample frequencies of an n-point rfft with sample spacing d."""
    return _freq_tensor(_sfft.rfftfreq(n, d), dtype, device, requires_grad)


def _roll(x: Tensor, dim: Any, inverse: bool) -> Tensor:
    xd = x.array
    ndim = xd.ndim
    if dim is None:
        dims = tuple(range(ndim))
    else:
        dims = []
        for d in ((dim,) if isinstance(dim, int) else tuple(dim)):
            if not -ndim <= d < ndim:
                raise _dim_error(d, ndim)
            dims.append(d % ndim)
        dims = tuple(dims)
    shifts = tuple(-(xd.shape[d] // 2) if inverse else xd.shape[d] // 2 for d in dims)
    xp = xp_of(xd)
    out = xp.roll(xd, shifts, axis=dims) if dims else xd.copy()

    def backward(g: Any) -> tuple:
        return (xp.roll(g, tuple(-k for k in shifts), axis=dims) if dims else g,)

    name = "IfftshiftBackward" if inverse else "FftshiftBackward"
    return result(out, name, backward, (x,), exact_dtype=True)


def fftshift(input: Tensor, dim: Any = None) -> Tensor:  # noqa: A002 - torch's name
    """Move the zero frequency to the centre (rolls each dim by half its length)."""
    return _roll(input, dim, False)


def ifftshift(input: Tensor, dim: Any = None) -> Tensor:  # noqa: A002 - torch's name
    """The inverse of fftshift."""
    return _roll(input, dim, True)
