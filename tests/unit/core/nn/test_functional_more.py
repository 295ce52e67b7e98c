"""torch.nn.functional's activations, losses, distances, padding and normalisations that core
gained, each against torch: values and the gradient of every input in float64, and torch's
error for one bad input where it has one.

The bound, 1e-7 relative: both sides compute in double, but some of torch's CPU kernels keep a
constant in float even for double tensors (hardsigmoid's backward multiplies by a float 1/6, 6e-9
away from the analytic gradient, where core is exact), so double's 1e-15 would fail on torch's
rounding, not core's; a wrong formula is off by far more than 1e-7."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as tf

from shoal import core
from shoal.core.nn import functional as F

_R = np.random.default_rng(0)
X = _R.standard_normal((4, 6)) * 2
Y = _R.standard_normal((4, 6))
P = _R.random((4, 6)) * 0.9 + 0.05          # probabilities in (0.05, 0.95)
T01 = (_R.random((4, 6)) > 0.5).astype(np.float64)
SIGN = np.where(_R.random(4) > 0.5, 1.0, -1.0)
IMG = _R.standard_normal((2, 4, 5, 6))
POS = _R.random((4, 6)) + 0.5

# name: (function name, args builder -> list of arrays or values, kwargs)
CASES = {
    "leaky_relu": ("leaky_relu", [X], {"negative_slope": 0.2}),
    "elu": ("elu", [X], {"alpha": 0.7}),
    "selu": ("selu", [X], {}),
    "celu": ("celu", [X], {"alpha": 1.3}),
    "silu": ("silu", [X], {}),
    "mish": ("mish", [X], {}),
    "softplus": ("softplus", [X], {"beta": 2.0, "threshold": 3.0}),
    "softsign": ("softsign", [X], {}),
    "softshrink": ("softshrink", [X], {"lambd": 0.7}),
    "hardshrink": ("hardshrink", [X], {"lambd": 0.7}),
    "tanhshrink": ("tanhshrink", [X], {}),
    "hardtanh": ("hardtanh", [X], {"min_val": -0.5, "max_val": 1.5}),
    "relu6": ("relu6", [X * 3], {}),
    "hardsigmoid": ("hardsigmoid", [X * 2], {}),
    "hardswish": ("hardswish", [X * 2], {}),
    "logsigmoid": ("logsigmoid", [X * 20], {}),
    "threshold": ("threshold", [X, 0.3, -2.0], {}),
    "glu": ("glu", [X], {"dim": 1}),
    "prelu": ("prelu", [IMG, POS[0, :4]], {}),
    "softmin": ("softmin", [X], {"dim": 1}),
    "normalize": ("normalize", [X], {"p": 3.0, "dim": 0}),
    "cosine_similarity": ("cosine_similarity", [X, Y], {"dim": 1}),
    "pairwise_distance": ("pairwise_distance", [X, Y], {"p": 1.5}),
    "pad_constant": ("pad", [IMG, (1, 2, 0, 1)], {"value": 0.5}),
    "pad_reflect": ("pad", [IMG, (2, 1, 1, 3)], {"mode": "reflect"}),
    "pad_replicate": ("pad", [IMG, (2, 1, 1, 3)], {"mode": "replicate"}),
    "pad_circular": ("pad", [IMG, (2, 1, 1, 3)], {"mode": "circular"}),
    "pad_crop": ("pad", [IMG, (-1, 2)], {}),
    "pixel_shuffle": ("pixel_shuffle", [IMG[:, :4, :2, :3]], {"upscale_factor": 2}),
    "pixel_unshuffle": ("pixel_unshuffle", [IMG[:, :, :4, :6]], {"downscale_factor": 2}),
    "bce": ("binary_cross_entropy", [P, T01], {}),
    "bce_weighted": ("binary_cross_entropy", [P, T01], {"weight": POS, "reduction": "sum"}),
    "bce_logits": ("binary_cross_entropy_with_logits", [X * 10, T01], {}),
    "bce_logits_pos": ("binary_cross_entropy_with_logits", [X, P],
                       {"pos_weight": POS[0], "reduction": "none"}),
    "kl_div": ("kl_div", [np.log(P), P[::-1].copy()], {"reduction": "batchmean"}),
    "kl_div_log": ("kl_div", [np.log(P), np.log(P[::-1].copy())],
                   {"log_target": True, "reduction": "sum"}),
    "huber": ("huber_loss", [X, Y], {"delta": 0.8}),
    "soft_margin": ("soft_margin_loss", [X], {"target": np.sign(Y)}),
    "margin_ranking": ("margin_ranking_loss", [X[:, 0], Y[:, 0], SIGN], {"margin": 0.3}),
    "hinge_embedding": ("hinge_embedding_loss", [X, np.sign(Y)], {"margin": 0.5}),
    "cosine_embedding": ("cosine_embedding_loss", [X, Y, SIGN], {"margin": 0.1}),
    "gaussian_nll": ("gaussian_nll_loss", [X, Y, POS], {"full": True}),
    "poisson_nll": ("poisson_nll_loss", [X, POS], {}),
    "poisson_nll_full": ("poisson_nll_loss", [POS, POS * 3], {"log_input": False, "full": True}),
    "triplet": ("triplet_margin_loss", [X, Y, X[::-1].copy()], {"swap": True}),
    "group_norm": ("group_norm", [IMG, 2, POS[0, :4], Y[0, :4]], {}),
    "instance_norm": ("instance_norm", [IMG], {}),
    "rms_norm": ("rms_norm", [IMG, (5, 6), _R.random((5, 6)) + 0.5], {"eps": 1e-6}),
    "local_response_norm": ("local_response_norm", [IMG, 3], {}),
}


def _to(lib, value, grad: bool = True):
    if isinstance(value, np.ndarray):
        t = core.tensor(value) if lib is core else torch.tensor(value)
        return t.requires_grad_(grad)
    return value


@pytest.mark.parametrize("case", sorted(CASES))
def test_functional_matches_torch(case):
    name, args, kwargs = CASES[case]
    mine_args = [_to(core, a) for a in args]
    their_args = [_to(torch, a) for a in args]
    # keyword tensors are weights torch does not differentiate (pos_weight, weight)
    kw_mine = {k: _to(core, v, grad=False) for k, v in kwargs.items()}
    kw_theirs = {k: _to(torch, v, grad=False) for k, v in kwargs.items()}
    mine = getattr(F, name)(*mine_args, **kw_mine)
    theirs = getattr(tf, name)(*their_args, **kw_theirs)
    np.testing.assert_allclose(mine.numpy() if not mine.requires_grad else mine.detach().numpy(),
                               theirs.detach().numpy(), rtol=1e-7, atol=1e-9)
    weights = _R.standard_normal(tuple(theirs.shape))
    (mine * core.tensor(weights)).sum().backward()
    (theirs * torch.tensor(weights)).sum().backward()
    for i, (m, t) in enumerate(zip(mine_args + list(kw_mine.values()),
                                   their_args + list(kw_theirs.values()))):
        if isinstance(t, torch.Tensor) and t.grad is not None:
            assert m.grad is not None, f"{case}: argument {i} has no gradient in core"
            np.testing.assert_allclose(m.grad.numpy(), t.grad.numpy(), rtol=1e-7, atol=1e-9,
                                       err_msg=f"{case}: gradient of argument {i}")


@pytest.mark.parametrize("call, error", [
    (lambda lib, f: f.binary_cross_entropy(lib.tensor([1.5]), lib.tensor([1.0])), RuntimeError),
    (lambda lib, f: f.binary_cross_entropy(lib.tensor([0.5, 0.5]), lib.tensor([1.0])), ValueError),
    (lambda lib, f: f.glu(lib.ones(3)), RuntimeError),
    (lambda lib, f: f.pad(lib.ones(2, 3), (1,)), RuntimeError),
    (lambda lib, f: f.pad(lib.ones(1, 2, 3), (3, 0), mode="reflect"), RuntimeError),
    (lambda lib, f: f.group_norm(lib.ones(2, 3, 4), 2), RuntimeError),
])
def test_bad_input_raises_torchs_error(call, error):
    with pytest.raises(error):
        call(torch, tf)
    with pytest.raises(error):
        call(core, F)


def test_modules_wrap_the_functionals_with_torchs_state_dict_keys():
    pairs = [(core.nn.PReLU(4), torch.nn.PReLU(4)), (core.nn.GroupNorm(2, 4), torch.nn.GroupNorm(2, 4)),
             (core.nn.RMSNorm((5, 6)), torch.nn.RMSNorm((5, 6))),
             (core.nn.BCEWithLogitsLoss(pos_weight=core.ones(3)),
              torch.nn.BCEWithLogitsLoss(pos_weight=torch.ones(3))),
             (core.nn.ParameterList([core.ones(2)]), torch.nn.ParameterList([torch.ones(2)])),
             (core.nn.ModuleDict({"a": core.nn.Linear(2, 2)}),
              torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2)}))]
    for mine, theirs in pairs:
        assert list(mine.state_dict()) == list(theirs.state_dict()), type(theirs).__name__
    x = IMG.astype(np.float32)
    for mine, theirs in [(core.nn.ReflectionPad2d(1), torch.nn.ReflectionPad2d(1)),
                         (core.nn.Softmax(dim=1), torch.nn.Softmax(dim=1)),
                         (core.nn.LeakyReLU(0.1), torch.nn.LeakyReLU(0.1)),
                         (core.nn.Hardswish(), torch.nn.Hardswish()),
                         (core.nn.InstanceNorm2d(4), torch.nn.InstanceNorm2d(4)),
                         (core.nn.PixelUnshuffle(2), torch.nn.PixelUnshuffle(2))]:
        arr = x[:, :, :4, :6]
        # float32 through composed ops on both sides: within a few float32 ulp (1e-5 relative)
        np.testing.assert_allclose(mine(core.tensor(arr)).numpy(),
                                   theirs(torch.tensor(arr)).detach().numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=type(theirs).__name__)
