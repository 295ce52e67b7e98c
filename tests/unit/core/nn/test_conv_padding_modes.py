"""nn.Conv1d/2d/3d with padding_mode 'reflect', 'replicate' and 'circular' against torch 2.13:
float64 values and gradients of the input, weight and bias, repr, and the refusals.

Bounds: in float64 every output is a sum of at most a few hundred products of O(1) normals, so
both libraries' results carry rounding of ~1e-14; 1e-10 leaves four orders of margin on any
x86-64 CPU whatever the summation order of either BLAS.
"""

import numpy as np
import pytest

from shoal import core
from shoal.core import nn
from tests.support.gradcheck import compare_module_with_torch, load_torch_weights

torch = pytest.importorskip("torch")

SETTINGS = [
    # spatial dims, kernel, stride, padding, dilation, groups
    (1, 3, 2, 2, 1, 1),
    (1, 4, 1, "same", 1, 2),
    (2, 3, 2, 2, 1, 1),
    (2, (3, 2), 1, (1, 2), (1, 2), 2),
    (2, 3, 1, "same", 2, 1),
    (3, 3, 2, 1, 1, 1),
    (3, (2, 3, 2), 1, "valid", 1, 2),
]


def _pair(spatial, **kw):
    """The same torch and shoal module (torch's weights copied into shoal's)."""
    theirs = getattr(torch.nn, f"Conv{spatial}d")(4, 6, **kw).double()
    ours = getattr(nn, f"Conv{spatial}d")(4, 6, **kw, dtype=core.float64)
    load_torch_weights(ours, theirs)
    return theirs, ours


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular", "zeros"])
@pytest.mark.parametrize("spatial, kernel, stride, padding, dilation, groups", SETTINGS)
def test_padding_mode_matches_torch(mode, spatial, kernel, stride, padding, dilation, groups):
    torch.manual_seed(spatial)
    theirs, ours = _pair(spatial, kernel_size=kernel, stride=stride, padding=padding,
                         dilation=dilation, groups=groups, padding_mode=mode)
    assert repr(ours) == repr(theirs)
    x = np.random.default_rng(spatial).standard_normal((2, 4) + (6,) * spatial)
    compare_module_with_torch(ours, theirs, x, atol=1e-10, seed=0)


def test_padding_mode_on_an_unbatched_input_matches_torch():
    torch.manual_seed(0)
    theirs, ours = _pair(2, kernel_size=3, padding=1, padding_mode="circular")
    x = np.random.default_rng(0).standard_normal((4, 5, 5))
    expected = theirs(torch.tensor(x)).detach().numpy()
    np.testing.assert_allclose(ours(core.tensor(x)).detach().numpy(), expected, atol=1e-10)


def test_padding_modes_refuse_what_torch_refuses():
    for lib in (torch, core):
        with pytest.raises(ValueError, match="padding_mode must be one of"):
            lib.nn.Conv2d(2, 2, 3, padding_mode="mirror")
    # reflect needs padding smaller than the input: torch refuses at the call.
    x = np.zeros((1, 2, 2, 2))
    with pytest.raises(RuntimeError):
        torch.nn.Conv2d(2, 2, 1, padding=2, padding_mode="reflect")(torch.tensor(x))
    with pytest.raises(RuntimeError):
        nn.Conv2d(2, 2, 1, padding=2, padding_mode="reflect", dtype=core.float64)(core.tensor(x))
