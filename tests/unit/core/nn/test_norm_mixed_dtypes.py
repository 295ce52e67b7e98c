"""Normalisation layers given an input of another dtype than their float32 parameters.

A float16/bfloat16 input keeps its dtype (torch's mixed-precision rule, tested with autocast
elsewhere). A float64 input with float32 parameters, which torch refuses ("mixed dtype (CPU)"),
promotes as arithmetic does in core (docs/coming-from-pytorch.md): the result is torch's float64
computation with the parameters upcast. It used to raise AttributeError from the dtype check.
"""

import numpy as np
import pytest
import torch

from shoal import core


@pytest.mark.parametrize("kind", ["batch_norm", "layer_norm"])
def test_a_float64_input_with_float32_parameters_promotes_to_float64(kind):
    x = np.random.default_rng(0).standard_normal((6, 3))
    if kind == "batch_norm":
        ours, theirs = core.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3).double()
    else:
        ours, theirs = core.nn.LayerNorm(3), torch.nn.LayerNorm(3).double()
    out = ours(core.tensor(x))
    assert out.dtype == core.float64
    expected = theirs(torch.tensor(x)).detach().numpy()
    # float64 throughout on both sides (parameters are 1 and 0, exact in float32): only the
    # order of the mean/variance sums differs, a few ulps of float64.
    np.testing.assert_allclose(out.detach().numpy(), expected, rtol=1e-12, atol=1e-12)
