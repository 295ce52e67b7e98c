"""Long single complex transforms, which core.fft takes in two passes (eight interleaved
transforms, a twiddle, transforms of length 8), against torch: values for every norm and
direction, both precisions, lengths that are and are not powers of two, and the gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal import core
from shoal.core import fft as core_fft

# relative to the largest output: pocketfft's and MKL's roundings differ by ~2e-7 (complex64)
# and ~4e-16 (complex128) at these lengths; the bounds leave 5x room
_BOUND = {np.complex64: 1e-6, np.complex128: 2e-15}


@pytest.mark.parametrize("n", [core_fft._SPLIT_FROM, 3 * core_fft._SPLIT_FROM,
                               core_fft._SPLIT_FROM + 8, 2 * core_fft._SPLIT_FROM + 4])
@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
@pytest.mark.parametrize("name", ["fft", "ifft"])
@pytest.mark.parametrize("norm", [None, "ortho", "forward"])
def test_long_transform_matches_torch(n, dtype, name, norm) -> None:
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype)
    mine = getattr(core.fft, name)(core.tensor(x), norm=norm).numpy()
    theirs = getattr(torch.fft, name)(torch.tensor(x), norm=norm).numpy()
    assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
    assert np.abs(mine - theirs).max() <= _BOUND[dtype] * np.abs(theirs).max()


def test_long_transform_gradient_matches_torch() -> None:
    n = 2 * core_fft._SPLIT_FROM
    rng = np.random.default_rng(1)
    x = rng.standard_normal(n) + 1j * rng.standard_normal(n)
    w = rng.standard_normal(n)
    tx = torch.tensor(x, requires_grad=True)
    (torch.fft.fft(tx).abs() * torch.tensor(w)).sum().backward()
    cx = core.tensor(x).requires_grad_(True)
    (core.fft.fft(cx).abs() * core.tensor(w)).sum().backward()
    np.testing.assert_allclose(cx.grad.numpy(), tx.grad.numpy(), rtol=0, atol=1e-9)  # float64
