"""Op table entries: core.fft (torch.fft), on real samples; the transforms' complex results are
compared with the table's complex tolerances. tests/unit/core/fft/ checks complex inputs, every
norm and n/s/dim combination, and complex gradients in depth."""

from __future__ import annotations

from tests.unit.core.optable.table import FLOATS, A, S, op

_M = (3, 4)
_EXACT_FFT = FLOATS + ("int64",)


def _fft(name: str, samples: tuple, error: tuple | None = None, **kw):
    """An entry for core.fft.<name>, called as lib.fft.<name>."""
    return op(f"fft.{name}", samples, forms=("call",),
              call=lambda lib, *a, **k: getattr(lib.fft, name)(*a, **k), error=error, **kw)


_ONE_D = (S(A(_M)), S(A(_M), n=6), S(A(_M), n=3, dim=0), S(A(_M), norm="ortho"),
          S(A((5,)), norm="forward"))
_N_D = (S(A((3, 4, 5))), S(A((3, 4, 5)), s=(2, 6)), S(A((3, 4, 5)), dim=(0, 2), norm="ortho"),
        S(A(_M), norm="forward"))
_BAD_N = (S(A(_M), n=0), RuntimeError)
_BAD_DIM = (S(A(_M), dim=5), IndexError)

FFT = [
    _fft("fft", _ONE_D, _BAD_N, dtypes=_EXACT_FFT),
    _fft("ifft", _ONE_D, _BAD_DIM, dtypes=_EXACT_FFT),
    _fft("rfft", _ONE_D, _BAD_N, dtypes=_EXACT_FFT),
    _fft("irfft", _ONE_D, _BAD_N),
    _fft("hfft", _ONE_D, _BAD_N),
    _fft("ihfft", _ONE_D, _BAD_DIM),
    _fft("fft2", _N_D[:3], (S(A((4,))), IndexError)),
    _fft("ifft2", _N_D[:3]),
    _fft("rfft2", _N_D[:3]),
    _fft("irfft2", _N_D[:3]),
    _fft("hfft2", _N_D[:3]),
    _fft("ihfft2", _N_D[:3]),
    _fft("fftn", _N_D, (S(A(_M), dim=(0, 0)), RuntimeError)),
    _fft("ifftn", _N_D),
    _fft("rfftn", _N_D),
    _fft("irfftn", _N_D),
    _fft("hfftn", _N_D),
    _fft("ihfftn", _N_D),
    _fft("fftshift", (S(A(_M)), S(A(_M), dim=0), S(A((5, 3)), dim=(0, 1))), dtypes=_EXACT_FFT,
         error=(S(A(_M), dim=3), IndexError)),
    _fft("ifftshift", (S(A(_M)), S(A(_M), dim=-1), S(A((5, 3)))), dtypes=_EXACT_FFT),
]

ENTRIES = FFT
