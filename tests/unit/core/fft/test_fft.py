"""core.fft against torch.fft: values, dtypes, shapes, gradients (complex ones included) and
errors, over n=/s=, dim= and every norm= mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal import core

# float64/complex128: pocketfft in both libraries (torch's CPU build may use MKL instead); an
# n-point transform's rounding error grows like log2(n) ulp of the largest magnitude, under 1e-13
# for these sizes (at most 12 points a dim, values of order 10).
RTOL, ATOL = 1e-10, 1e-11
# complex64: the same bound in float32 ulp (1.2e-7), with margin for another FFT algorithm.
RTOL32, ATOL32 = 1e-4, 1e-4

NORMS = [None, "backward", "forward", "ortho"]
ONE_D = ["fft", "ifft", "rfft", "irfft", "hfft", "ihfft"]
N_D = ["fft2", "ifft2", "rfft2", "irfft2", "hfft2", "ihfft2", "fftn", "ifftn", "rfftn",
       "irfftn", "hfftn", "ihfftn"]
REAL_INPUT = {"rfft", "ihfft", "rfft2", "ihfft2", "rfftn", "ihfftn"}


def _input(name: str, shape: tuple, seed: int, complex_ok: bool = True) -> np.ndarray:
    rng = np.random.default_rng(seed)
    data = rng.standard_normal(shape)
    if name not in REAL_INPUT and complex_ok:
        data = data + 1j * rng.standard_normal(shape)
    return data


def _same(mine, theirs, rtol=RTOL, atol=ATOL, what=""):
    theirs = theirs.detach().resolve_conj()
    assert mine.dtype.name == str(theirs.dtype).removeprefix("torch."), what
    assert tuple(mine.shape) == tuple(theirs.shape), what
    np.testing.assert_allclose(mine.numpy(force=True), theirs.numpy(), rtol=rtol, atol=atol,
                               err_msg=what)


def _check(name: str, data: np.ndarray, kwargs: dict) -> None:
    """Forward values and the gradient of a real loss that weighs every output element."""
    x, xt = core.tensor(data, requires_grad=True), torch.tensor(data, requires_grad=True)
    out, out_t = getattr(core.fft, name)(x, **kwargs), getattr(torch.fft, name)(xt, **kwargs)
    _same(out, out_t, what=f"{name}{kwargs}")
    rng = np.random.default_rng(1)
    w = rng.standard_normal(tuple(out_t.shape)) + 1j * rng.standard_normal(tuple(out_t.shape))
    if not out_t.is_complex():
        w = w.real
    loss = (out * core.tensor(w)).real.sum() if out.is_complex() else (out * core.tensor(w)).sum()
    loss_t = (out_t * torch.tensor(w)).real.sum()
    loss.backward()
    loss_t.backward()
    _same(x.grad, xt.grad, what=f"grad of {name}{kwargs}")


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("name", ONE_D)
@pytest.mark.parametrize("n,dim", [(None, -1), (5, 0), (12, 1), (3, -1), (8, 1)])
def test_one_dimensional_transforms_equal_torch(name, norm, n, dim):
    _check(name, _input(name, (4, 7), 0), {"n": n, "dim": dim, "norm": norm})


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("name", N_D)
@pytest.mark.parametrize("s,dim", [(None, None), ((6, 4), None), ((3, 9), (0, 2)),
                                   (None, (2, 0)), ((5,), (1,))])
def test_multi_dimensional_transforms_equal_torch(name, norm, s, dim):
    kwargs = {"s": s, "norm": norm}
    if dim is not None:
        kwargs["dim"] = dim
    if name.endswith("2") and s is not None and len(s) == 1:
        kwargs["dim"] = (1, 2)
        kwargs["s"] = (5, 3)
    _check(name, _input(name, (4, 3, 6), 2), kwargs)


@pytest.mark.parametrize("name", ["fft", "ifft", "fftn", "hfft", "irfft"])
def test_a_real_input_gets_a_real_gradient_as_in_torch(name):
    _check(name, _input(name, (3, 6), 3, complex_ok=False), {})


def test_the_seed_example_and_torch_dtypes():
    out = core.fft.fft(core.arange(4))
    assert out.dtype is core.complex64
    assert out.tolist() == [6 + 0j, -2 + 2j, -2 + 0j, -2 - 2j]
    assert repr(out) == repr(torch.fft.fft(torch.arange(4))).replace("torch.", "core.")
    seed_complex = [0.0 + 1.0j, 2.0 + 3.0j, 4.0 + 5.0j, 6.0 + 7.0j]  # the release notes' second
    assert repr(core.fft.fft(core.tensor(seed_complex))) == (
        "tensor([12.+16.j, -8.+0.j, -4.-4.j,  0.-8.j])")
    assert repr(torch.fft.fft(torch.tensor(seed_complex))) == (
        "tensor([12.+16.j, -8.+0.j, -4.-4.j,  0.-8.j])")
    for dt, want in [(core.float32, core.complex64), (core.float64, core.complex128),
                     (core.int32, core.complex64), (core.bool, core.complex64),
                     (core.complex128, core.complex128)]:
        assert core.fft.fft(core.ones(4, dtype=dt)).dtype is want
    assert core.fft.rfft(core.ones(4, dtype=core.int64)).dtype is core.complex64
    assert core.fft.irfft(core.ones(4, dtype=core.complex128)).dtype is core.float64
    assert core.fft.irfft(core.ones(4)).dtype is core.float32


@pytest.mark.parametrize("dtype", ["float32", "complex64"])
def test_single_precision_matches_torch(dtype):
    data = _input("fft", (3, 64), 4, complex_ok=dtype == "complex64").astype(dtype)
    x, xt = core.tensor(data), torch.tensor(data)
    for name in ("fft", "ifft", "fft2", "irfft", "hfft"):
        _same(getattr(core.fft, name)(x), getattr(torch.fft, name)(xt), RTOL32, ATOL32, name)
    if dtype == "float32":
        _same(core.fft.rfft(x), torch.fft.rfft(xt), RTOL32, ATOL32, "rfft")


@pytest.mark.parametrize("name", ["fftfreq", "rfftfreq"])
def test_frequencies_equal_torch(name):
    for n, d in [(1, 1.0), (5, 1.0), (8, 0.1), (9, 2.5)]:
        _same(getattr(core.fft, name)(n, d), getattr(torch.fft, name)(n, d))
    _same(getattr(core.fft, name)(6, dtype=core.float64),
          getattr(torch.fft, name)(6, dtype=torch.float64))
    assert getattr(core.fft, name)(4, requires_grad=True).requires_grad


@pytest.mark.parametrize("name", ["fftshift", "ifftshift"])
@pytest.mark.parametrize("dim", [None, 0, -1, (0, 1), (1,)])
def test_shifts_equal_torch_with_gradients(name, dim):
    data = np.arange(35.0).reshape(5, 7)
    x, xt = core.tensor(data, requires_grad=True), torch.tensor(data, requires_grad=True)
    out, out_t = getattr(core.fft, name)(x, dim), getattr(torch.fft, name)(xt, dim)
    _same(out, out_t)
    w = np.random.default_rng(5).standard_normal((5, 7))
    (out * core.tensor(w)).sum().backward()
    (out_t * torch.tensor(w)).sum().backward()
    _same(x.grad, xt.grad)
    assert getattr(core.fft, name)(core.arange(5)).tolist() == getattr(torch.fft, name)(
        torch.arange(5)).tolist()


def test_fftshift_undoes_ifftshift_and_centres_fftfreq():
    freq = core.fft.fftfreq(6)
    assert core.fft.fftshift(freq).tolist() == torch.fft.fftshift(torch.fft.fftfreq(6)).tolist()
    assert core.fft.ifftshift(core.fft.fftshift(freq)).tolist() == freq.tolist()


@pytest.mark.parametrize("call,exc,match", [
    (lambda L: L.fft.fft(L.ones(4), n=0), RuntimeError, r"Invalid number of data points \(0\)"),
    (lambda L: L.fft.fft(L.ones(4), norm="xyz"), RuntimeError, 'Invalid normalization mode: "xyz"'),
    (lambda L: L.fft.fft(L.ones(4), dim=3), IndexError, "Dimension out of range"),
    (lambda L: L.fft.fft(L.tensor(1.0)), IndexError, "tensor has no dimensions"),
    (lambda L: L.fft.rfft(L.ones(4) * 1j), RuntimeError, "rfft expects a real input tensor, but "
     "got ComplexFloat"),
    (lambda L: L.fft.ihfft(L.ones(4) * 1j), RuntimeError, "ihfft expects a real input tensor"),
    (lambda L: L.fft.irfft(L.ones(1)), RuntimeError, r"Invalid number of data points \(0\)"),
    (lambda L: L.fft.fft2(L.ones(4)), IndexError, "Dimension out of range"),
    (lambda L: L.fft.fftn(L.ones(4, 3), s=(2, 3), dim=(0,)), RuntimeError,
     "dim and shape arguments must have the same length"),
    (lambda L: L.fft.fftn(L.ones(4, 3), dim=(0, 0)), RuntimeError, "FFT dims must be unique"),
    (lambda L: L.fft.fft(L.ones(4, dtype=L.float16)), RuntimeError, "Unsupported dtype Half"),
    (lambda L: L.fft.fft(L.ones(4, dtype=L.bfloat16)), RuntimeError,
     "Unsupported dtype BFloat16"),
])
def test_errors_match_torch(call, exc, match):
    with pytest.raises(exc, match=match):
        call(torch)
    with pytest.raises(exc, match=match):
        call(core)


def test_spectral_filter_round_trip_trains_like_torch():
    """The spectral-layer pattern: rfft, a learnable complex filter, irfft; one SGD step each."""
    rng = np.random.default_rng(6)
    signal, filt = rng.standard_normal((4, 16)), rng.standard_normal((9,)) + 0j
    x, xt = core.tensor(signal), torch.tensor(signal)
    w, wt = core.tensor(filt, requires_grad=True), torch.tensor(filt, requires_grad=True)
    out = core.fft.irfft(core.fft.rfft(x) * w, n=16)
    out_t = torch.fft.irfft(torch.fft.rfft(xt) * wt, n=16)
    _same(out, out_t)
    (out ** 2).mean().backward()
    (out_t ** 2).mean().backward()
    _same(w.grad, wt.grad)
