"""examples/fft_filter.py: torch.fft's release example and a complex spectral filter trained
with SGD, against torch running the same training."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[4]


def _example():
    spec = importlib.util.spec_from_file_location("fft_filter", ROOT / "examples" / "fft_filter.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_prints_torchs_output_and_its_filter_learns(capsys):
    example = _example()
    assert example.main(["--steps", "30"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == repr(torch.fft.fft(torch.arange(4)))
    assert out[1] == repr(torch.fft.fft(torch.tensor([0.0 + 1.0j, 2.0 + 3.0j, 4.0 + 5.0j,
                                                       6.0 + 7.0j])))
    assert out[2].startswith("spectral filter: mean squared error 0.6427 ->")


def test_the_filters_training_follows_torchs():
    """The same data, parameter and SGD steps in torch: the complex gradient convention makes
    the trajectories agree (float32 FFTs from two libraries: 1e-4 after 10 steps)."""
    example = _example()
    rng = np.random.default_rng(0)
    noisy, clean = example.make_signals(64, 128, rng)
    noisy_t, clean_t = torch.tensor(noisy.numpy()), torch.tensor(clean.numpy())
    w = torch.ones(65, dtype=torch.complex64, requires_grad=True)
    for _ in range(10):  # torch.optim.SGD's plain step, by hand (its first call imports dynamo)
        w.grad = None
        out = torch.fft.irfft(torch.fft.rfft(noisy_t) * w, n=128)
        loss = ((out - clean_t) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            w -= 3.0 * w.grad
    first, last = example.train(10, 3.0, 128, 0)
    assert abs(last - loss.item()) < 1e-4 * max(1.0, loss.item())
