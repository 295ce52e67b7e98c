"""core.distributions against torch.distributions: values, gradients, shapes, dtypes, errors,
and sample statistics within bounds that hold for the sample size."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributions as TD

from shoal import core
from shoal.core import distributions as D

# float32 results of the same formulas, evaluated in a different order: a few ulp apart
RTOL, ATOL = 1e-5, 1e-6


def _pair(values, requires_grad=True, dtype=np.float32):
    a = np.asarray(values, dtype=dtype)
    return (core.tensor(a, requires_grad=requires_grad),
            torch.tensor(a, requires_grad=requires_grad))


def _close(ours, theirs, rtol=RTOL, atol=ATOL):
    assert tuple(ours.shape) == tuple(theirs.shape)
    np.testing.assert_allclose(ours.detach().numpy(), theirs.detach().numpy(),
                               rtol=rtol, atol=atol)


def _grads_close(ours_params, theirs_params, rtol=RTOL, atol=ATOL):
    for o, t in zip(ours_params, theirs_params):
        np.testing.assert_allclose(o.grad.numpy(), t.grad.numpy(), rtol=rtol, atol=atol)


def test_normal_log_prob_entropy_and_moments_match_torch_with_gradients():
    loc, tloc = _pair([0.5, -1.0, 2.0])
    scale, tscale = _pair([1.0, 0.3, 2.5])
    x, tx = _pair([[0.1, -0.7, 4.0], [2.0, -1.0, 1.0]])
    ours, theirs = D.Normal(loc, scale), TD.Normal(tloc, tscale)
    lp, tlp = ours.log_prob(x), theirs.log_prob(tx)
    _close(lp, tlp)
    (lp.sum() + ours.entropy().sum()).backward()
    (tlp.sum() + theirs.entropy().sum()).backward()
    _grads_close([loc, scale, x], [tloc, tscale, tx])
    for name in ("mean", "mode", "stddev", "variance"):
        _close(getattr(ours, name), getattr(theirs, name))
    assert ours.batch_shape == tuple(theirs.batch_shape) == (3,)
    assert ours.event_shape == tuple(theirs.event_shape) == ()
    assert ours.has_rsample and theirs.has_rsample
    # torch's repr with core's Size in place of torch.Size
    assert repr(D.Normal(core.zeros(2), 1.0)) == "Normal(loc: core.Size([2]), scale: core.Size([2]))"
    assert isinstance(ours.batch_shape, core.Size) and isinstance(ours.sample().shape, tuple)


def test_normal_from_numbers_is_float32_and_broadcasts_like_torch():
    ours, theirs = D.Normal(0.0, core.ones(2, 1)), TD.Normal(0.0, torch.ones(2, 1))
    assert ours.loc.dtype == core.float32 and theirs.loc.dtype == torch.float32
    assert ours.batch_shape == tuple(theirs.batch_shape) == (2, 1)
    assert ours.sample((5,)).shape == tuple(theirs.sample((5,)).shape) == (5, 2, 1)
    assert D.Normal(0.0, 1.0).sample().shape == ()


def test_normal_rsample_gradients_are_torchs_reparameterization():
    loc, tloc = _pair([1.0, -2.0])
    scale, tscale = _pair([0.5, 3.0])
    x = D.Normal(loc, scale).rsample((4,))
    x.sum().backward()
    eps = (x.detach().numpy() - loc.detach().numpy()) / scale.detach().numpy()
    # torch's rsample is loc + eps * scale too: with our eps its gradients are these
    (tloc + torch.tensor(eps) * tscale).sum().backward()
    _grads_close([loc, scale], [tloc, tscale])
    assert D.Normal(loc, scale).sample((2,)).requires_grad is False


def test_normal_sample_statistics():
    core.manual_seed(0)
    x = D.Normal(2.0, 3.0).sample((20000,)).numpy()
    # standard errors: sigma/sqrt(n) = 0.021 for the mean, sigma^2 sqrt(2/n) = 0.09 for the
    # variance; 6 of them hold with probability 1 - 2e-9 for any seed
    assert abs(x.mean() - 2.0) < 6 * 3.0 / math.sqrt(20000)
    assert abs(x.var() - 9.0) < 6 * 9.0 * math.sqrt(2 / 20000)


def test_uniform_log_prob_cdf_icdf_entropy_and_moments_match_torch():
    low, tlow = _pair([0.0, -1.0])
    high, thigh = _pair([2.0, 3.0])
    x, tx = _pair([[0.5, 2.9], [1.999, -1.0]])
    ours, theirs = D.Uniform(low, high), TD.Uniform(tlow, thigh)
    lp, tlp = ours.log_prob(x), theirs.log_prob(tx)
    _close(lp, tlp)
    (lp.sum() + ours.entropy().sum() + ours.cdf(x).sum()).backward()
    (tlp.sum() + theirs.entropy().sum() + theirs.cdf(tx).sum()).backward()
    _grads_close([low, high, x], [tlow, thigh, tx])
    q, tq = _pair([0.25, 0.75], requires_grad=False)
    _close(ours.icdf(q), theirs.icdf(tq))
    for name in ("mean", "stddev", "variance"):
        _close(getattr(ours, name), getattr(theirs, name))
    assert np.isnan(ours.mode.detach().numpy()).all() and theirs.mode.isnan().all()


def test_uniform_outside_the_support_is_minus_inf_with_torchs_gradient():
    low, tlow = _pair([0.0, 0.0])
    high, thigh = _pair([1.0, 1.0])
    x, tx = _pair([-1.0, 1.0], requires_grad=False)
    lp = D.Uniform(low, high, validate_args=False).log_prob(x)
    tlp = TD.Uniform(tlow, thigh, validate_args=False).log_prob(tx)
    _close(lp, tlp)
    lp.sum().backward()
    tlp.sum().backward()
    _grads_close([low, high], [tlow, thigh])


def test_uniform_rsample_gradients_and_statistics():
    low, tlow = _pair([1.0])
    high, thigh = _pair([4.0])
    x = D.Uniform(low, high).rsample((3,))
    x.sum().backward()
    u = (x.detach().numpy() - 1.0) / 3.0
    (tlow + torch.tensor(u) * (thigh - tlow)).sum().backward()
    _grads_close([low, high], [tlow, thigh])
    core.manual_seed(1)
    s = D.Uniform(-1.0, 3.0).sample((20000,)).numpy()
    assert s.min() >= -1.0 and s.max() < 3.0
    # the mean's standard error is (b - a)/sqrt(12 n) = 0.008; 6 of them hold for any seed
    assert abs(s.mean() - 1.0) < 6 * 4.0 / math.sqrt(12 * 20000)


@pytest.mark.parametrize("by", ["probs", "logits"])
def test_bernoulli_log_prob_entropy_and_moments_match_torch(by):
    values = [0.1, 0.5, 0.85] if by == "probs" else [-2.0, 0.0, 1.5]
    p, tp = _pair(values)
    x, tx = _pair([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]], requires_grad=False)
    ours, theirs = D.Bernoulli(**{by: p}), TD.Bernoulli(**{by: tp})
    lp, tlp = ours.log_prob(x), theirs.log_prob(tx)
    # logits from probs: core has no log1p, log(1 - p) is off by up to half an ulp of 1
    # relative to 1 - p (6e-8 / 0.15 here), well inside 1e-5
    _close(lp, tlp)
    (lp.sum() + ours.entropy().sum()).backward()
    (tlp.sum() + theirs.entropy().sum()).backward()
    _grads_close([p], [tp])
    for name in ("mean", "variance", "stddev", "probs", "logits"):
        _close(getattr(ours, name), getattr(theirs, name))
    np.testing.assert_array_equal(ours.mode.numpy(), theirs.mode.numpy())
    assert ours.batch_shape == tuple(theirs.batch_shape) == (3,)
    _close(ours.enumerate_support(), theirs.enumerate_support())
    _close(ours.enumerate_support(expand=False), theirs.enumerate_support(expand=False))


def test_bernoulli_samples_are_floats_with_the_right_frequency_and_no_rsample():
    core.manual_seed(2)
    s = D.Bernoulli(core.tensor([0.2, 0.7])).sample((20000,))
    ts = TD.Bernoulli(torch.tensor([0.2, 0.7])).sample((3,))
    assert s.dtype == core.float32 and ts.dtype == torch.float32
    assert set(np.unique(s.numpy())) <= {0.0, 1.0}
    # frequency standard error sqrt(p(1-p)/n) <= 0.0035; 6 of them hold for any seed
    np.testing.assert_allclose(s.numpy().mean(0), [0.2, 0.7], atol=6 * math.sqrt(0.25 / 20000))
    with pytest.raises(NotImplementedError):
        D.Bernoulli(0.5).rsample()
    with pytest.raises(NotImplementedError):
        TD.Bernoulli(0.5).rsample()


@pytest.mark.parametrize("by", ["probs", "logits"])
def test_categorical_log_prob_and_entropy_match_torch_with_gradients(by):
    values = [[0.2, 0.3, 0.5], [0.6, 0.1, 0.3]] if by == "probs" else \
        [[0.1, -1.0, 2.0], [3.0, 0.0, -0.5]]
    p, tp = _pair(values)
    ours, theirs = D.Categorical(**{by: p}), TD.Categorical(**{by: tp})
    # a value batch that broadcasts against the distribution's (2,): torch's gather rules
    v = [[0, 2], [1, 1], [2, 0]]
    lp = ours.log_prob(core.tensor(v))
    tlp = theirs.log_prob(torch.tensor(v))
    _close(lp, tlp)
    col = ours.log_prob(core.tensor([[0], [2]]))
    tcol = theirs.log_prob(torch.tensor([[0], [2]]))
    _close(col, tcol)
    (lp.sum() + col.sum() + ours.entropy().sum()).backward()
    (tlp.sum() + tcol.sum() + theirs.entropy().sum()).backward()
    _grads_close([p], [tp])
    _close(ours.probs, theirs.probs)
    _close(ours.logits, theirs.logits)
    np.testing.assert_array_equal(ours.mode.numpy(), theirs.mode.numpy())
    assert ours.batch_shape == tuple(theirs.batch_shape) == (2,)
    assert ours.param_shape == tuple(theirs.param_shape) == (2, 3)
    assert np.isnan(ours.mean.numpy()).all() and theirs.mean.isnan().all()
    assert np.isnan(ours.variance.numpy()).all() and theirs.variance.isnan().all()
    np.testing.assert_array_equal(ours.enumerate_support().numpy(),
                                  theirs.enumerate_support().numpy())


def test_categorical_entropy_with_a_zero_probability_is_finite_as_torchs():
    ours = D.Categorical(core.tensor([0.0, 0.5, 0.5]))
    theirs = TD.Categorical(torch.tensor([0.0, 0.5, 0.5]))
    _close(ours.entropy(), theirs.entropy())
    ours = D.Categorical(logits=core.tensor([-math.inf, 0.0]))
    theirs = TD.Categorical(logits=torch.tensor([-math.inf, 0.0]))
    _close(ours.entropy(), theirs.entropy())
    _close(ours.log_prob(core.tensor(0)), theirs.log_prob(torch.tensor(0)))


def test_categorical_samples_are_int64_with_the_right_frequencies():
    core.manual_seed(3)
    probs = [0.1, 0.2, 0.7]
    s = D.Categorical(core.tensor(probs)).sample((30000,))
    ts = TD.Categorical(torch.tensor(probs)).sample((3,))
    assert s.dtype == core.int64 and ts.dtype == torch.int64 and s.shape == (30000,)
    freq = np.bincount(s.numpy(), minlength=3) / 30000
    # frequency standard error sqrt(p(1-p)/n) <= 0.0029; 6 of them hold for any seed
    np.testing.assert_allclose(freq, probs, atol=6 * math.sqrt(0.25 / 30000))
    assert D.Categorical(core.ones(4, 3)).sample((2,)).shape == (2, 4)


def _raises_like_torch(ours, theirs, match):
    with pytest.raises(ValueError, match=match):
        theirs()
    with pytest.raises(ValueError, match=match):
        ours()


@pytest.mark.parametrize("make,match", [
    (lambda m, t: m.Normal(t([0.0, 1.0]), t([1.0, -1.0])),
     r"^Expected parameter scale \(Tensor of shape \(2,\)\) of distribution Normal\(loc: "
     r".*\) to satisfy the constraint GreaterThan\(lower_bound=0\.0\), but found invalid"),
    (lambda m, t: m.Normal(t(math.nan), 1.0),
     r"^Expected parameter loc \(Tensor of shape \(\)\) of distribution Normal\(loc: nan, "
     r"scale: 1\.0\) to satisfy the constraint Real\(\)"),
    (lambda m, t: m.Uniform(1.0, 0.0),
     r"^Expected parameter low \(Tensor of shape \(\)\) of distribution Uniform\(low: 1\.0, "
     r"high: 0\.0\) to satisfy the constraint LessThan\(upper_bound=0\.0\)"),
    (lambda m, t: m.Bernoulli(t(1.5)),
     r"^Expected parameter probs .* Bernoulli\(probs: 1\.5\) to satisfy the constraint "
     r"Interval\(lower_bound=0\.0, upper_bound=1\.0\)"),
    (lambda m, t: m.Categorical(t([-0.5, 1.5])),
     r"^Expected parameter probs \(Tensor of shape \(2,\)\) .* Simplex\(\)"),
    (lambda m, t: m.Categorical(t([0.5, 0.5]), t([0.0, 0.0])),
     r"^Either `probs` or `logits` must be specified, but not both\.$"),
    (lambda m, t: m.Bernoulli(),
     r"^Either `probs` or `logits` must be specified, but not both\.$"),
    (lambda m, t: m.Categorical(t(0.5)),
     r"^`probs` parameter must be at least one-dimensional\.$"),
    (lambda m, t: m.Normal(0.0, 1.0).log_prob(1.0),
     r"^The value argument to log_prob must be a Tensor$"),
    (lambda m, t: m.Normal(t([0.0, 0.0]), 1.0).log_prob(t([0.0, 0.0, 0.0])),
     r"^Value is not broadcastable with batch_shape\+event_shape: "),
    (lambda m, t: m.Uniform(0.0, 1.0).log_prob(t(2.0)),
     r"^Expected value argument \(Tensor of shape \(\)\) to be within the support "
     r"\(Interval\(lower_bound=0\.0, upper_bound=1\.0\)\) of the distribution Uniform\(low: "
     r"0\.0, high: 1\.0\), but found invalid values"),
    (lambda m, t: m.Bernoulli(t(0.5)).log_prob(t(0.5)),
     r"^Expected value argument .* support \(Boolean\(\)\) of the distribution "
     r"Bernoulli\(probs: 0\.5\)"),
    (lambda m, t: m.Categorical(t([0.5, 0.5])).log_prob(t(2)),
     r"^Expected value argument .* support \(IntegerInterval\(lower_bound=0, "
     r"upper_bound=1\)\) of the distribution Categorical\(probs: "
     r"(core|torch)\.Size\(\[2\]\)\)"),
])
def test_invalid_arguments_raise_torchs_value_errors(make, match):
    _raises_like_torch(lambda: make(D, core.tensor), lambda: make(TD, torch.tensor), match)


def test_validate_args_false_skips_the_checks_as_torchs():
    assert D.Normal(0.0, -1.0, validate_args=False).scale.item() == -1.0
    assert TD.Normal(0.0, -1.0, validate_args=False).scale.item() == -1.0
    lp = D.Normal(0.0, 1.0, validate_args=False).log_prob(core.tensor(math.nan))
    assert math.isnan(lp.item())
    D.Distribution.set_default_validate_args(False)
    try:
        assert D.Normal(0.0, -1.0).scale.item() == -1.0
    finally:
        D.Distribution.set_default_validate_args(True)
    with pytest.raises(ValueError, match="positive|GreaterThan"):
        D.Normal(0.0, -1.0)
