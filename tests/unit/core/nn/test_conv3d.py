"""conv3d and nn.Conv3d against torch 2.13: float64 values and gradients, the empty batch,
dtypes, autocast and errors.

Bounds: in float64 every output is a sum of at most a few hundred products of O(1) normals, so
both libraries' results carry rounding of ~1e-14; 1e-10 leaves four orders of margin on any
x86-64 CPU whatever the summation order of either BLAS.
"""

import numpy as np
import pytest

from shoal import core
from shoal.core import nn
from shoal.core.nn import functional as F
from tests.support.gradcheck import (compare_module_with_torch, compare_with_torch, gradcheck,
                                     load_torch_weights)

torch = pytest.importorskip("torch")
TF = torch.nn.functional

CASES = [
    # (N, C, D, H, W), (O, C/G, kd, kh, kw), stride, padding, dilation, groups
    ((2, 3, 4, 5, 4), (4, 3, 3, 3, 3), 1, 0, 1, 1),
    ((2, 3, 5, 6, 5), (2, 3, 2, 3, 2), (2, 1, 2), (1, 0, 1), 1, 1),
    ((1, 4, 5, 5, 6), (6, 2, 3, 2, 3), 1, 1, (2, 1, 1), 2),
    ((2, 4, 4, 4, 4), (4, 1, 3, 3, 3), 1, "same", 1, 4),
    ((1, 2, 6, 5, 5), (3, 2, 2, 3, 2), 1, "same", (2, 1, 2), 1),
    ((2, 2, 4, 4, 4), (3, 2, 2, 2, 2), 1, "valid", 1, 1),
    ((2, 4, 5, 4), (3, 2, 3, 3, 3), 1, 1, 1, 1),  # unbatched
    ((1, 2, 3, 3, 3), (2, 2, 1, 1, 1), 1, 0, 1, 1),  # 1x1x1
]


@pytest.mark.parametrize("xs, ws, stride, padding, dilation, groups", CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_conv3d_matches_torch(xs, ws, stride, padding, dilation, groups, bias):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(xs), rng.standard_normal(ws)]
    if bias:
        arrays.append(rng.standard_normal(ws[0]))
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    compare_with_torch(lambda x, w, *b: F.conv3d(x, w, *b, **kw),
                       lambda x, w, *b: TF.conv3d(x, w, *b, **kw), *arrays, atol=1e-10,
                       rtol=1e-10)


def test_conv3d_is_the_top_level_name():
    assert core.conv3d is F.conv3d


def test_conv3d_gradients_match_finite_differences():
    rng = np.random.default_rng(2)
    # eps 1e-6 central differences of a bilinear function: the error is rounding only
    # (~1e-10 relative), well inside gradcheck's 1e-6 / 1e-5.
    gradcheck(lambda x, w, b: F.conv3d(x, w, b, stride=(1, 2, 1), padding=1, groups=2),
              rng.standard_normal((1, 4, 3, 4, 3)), rng.standard_normal((2, 2, 2, 2, 2)),
              rng.standard_normal(2))


def test_conv3d_of_an_empty_batch_is_empty_with_zero_weight_gradient():
    w = core.randn(4, 3, 2, 2, 2, dtype=core.float64, requires_grad=True)
    x = core.zeros(0, 3, 4, 4, 4, dtype=core.float64, requires_grad=True)
    out = F.conv3d(x, w)
    assert tuple(out.shape) == tuple(TF.conv3d(torch.zeros(0, 3, 4, 4, 4),
                                               torch.zeros(4, 3, 2, 2, 2)).shape)
    out.sum().backward()
    assert tuple(x.grad.shape) == (0, 3, 4, 4, 4)
    assert not w.grad.numpy().any()


def test_conv3d_module_matches_torch():
    torch.manual_seed(0)
    theirs = torch.nn.Conv3d(4, 6, (2, 3, 2), stride=2, padding=1, groups=2).double()
    ours = nn.Conv3d(4, 6, (2, 3, 2), stride=2, padding=1, groups=2, dtype=core.float64)
    assert repr(ours) == repr(theirs)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    load_torch_weights(ours, theirs)
    x = np.random.default_rng(1).standard_normal((2, 4, 5, 6, 5))
    compare_module_with_torch(ours, theirs, x, atol=1e-10, seed=2)


def test_conv3d_keeps_float32_and_runs_low_under_autocast():
    x, w = core.randn(1, 2, 3, 3, 3), core.randn(2, 2, 2, 2, 2)
    assert F.conv3d(x, w).dtype == core.float32
    with core.autocast("cpu", dtype=core.bfloat16):
        out = F.conv3d(x, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = TF.conv3d(torch.randn(1, 2, 3, 3, 3), torch.randn(2, 2, 2, 2, 2))
    assert out.dtype == core.bfloat16 and expected.dtype == torch.bfloat16


@pytest.mark.parametrize("xs, ws, kwargs", [
    ((2, 4, 5, 5, 5), (6, 2, 3, 3, 3), {}),  # 4 channels, the weight wants 2
    ((2, 4, 5, 5, 5), (6, 2, 3, 3, 3), {"groups": 3}),
    ((2, 4, 5, 5, 5), (6, 2, 3, 3, 3), {"groups": 2, "stride": 2, "padding": "same"}),
    ((2, 4, 5, 5, 5), (6, 2, 3, 3, 3), {"groups": 2, "padding": -1}),
    ((2, 4, 5, 5, 5), (6, 2, 3, 3, 3), {"groups": 2, "stride": 0}),
    ((2, 4, 1, 5, 5), (6, 2, 3, 3, 3), {"groups": 2}),  # kernel deeper than the input
    ((2, 4, 5, 5, 5), (6, 2, 3, 3, 3), {"groups": 2, "padding": "full"}),
    ((2, 4, 5, 5, 5), (6, 2, 3, 3, 3), {"groups": 2, "padding": (1, 1)}),
    ((4, 5, 5), (6, 4, 3, 3, 3), {}),  # a 3-d input
])
def test_conv3d_refuses_what_torch_refuses(xs, ws, kwargs):
    with pytest.raises(RuntimeError):
        TF.conv3d(torch.zeros(xs), torch.zeros(ws), **kwargs)
    with pytest.raises(RuntimeError):
        F.conv3d(core.zeros(*xs), core.zeros(*ws), **kwargs)
