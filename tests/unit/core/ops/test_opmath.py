"""16-bit elementwise ops against torch's CPU kernels: float32 math, one rounding per op.

torch computes a bfloat16 or float16 elementwise op in float32 and rounds the result once (a
fused kernel, such as gelu or tanh_backward, at its end); core does the same
(core/ops/_opmath.py). Where both libraries' float32 result is exact or correctly rounded
(+ - * /, sqrt, relu, abs, clamp, x ** 2, comparisons, the gradients of these) the values
must equal torch's bit for bit. Transcendental functions (exp, log, tanh, sigmoid, gelu) use
each library's own float32 implementation, whose last bit may differ, and torch rounds some
composite backward formulas (div's and pow's) after each step: there the values may be a
step apart where that decides the rounding, so they are checked in units in the last place
of the 16-bit type: at most 1 ulp (2 for the composite gradients).

How many elements may differ from torch depends on the CPU: numpy and torch pick their float32
exp, tanh and erf kernels by instruction set (AVX2, AVX-512), and a last-bit difference in float32
changes the 16-bit rounding wherever the true value lies near a rounding boundary. So the libm
ops are not held to a measured share of differing elements (6.4% on one AVX-512 Xeon, 0% on an
AMD EPYC for the same gelu); each 16-bit result is instead checked against the property itself:
it must be the rounding of some float32 value within this CPU's float32 error of the float64
truth (`_ENVELOPE`). A 16-bit computation, or a second rounding, lands outside that envelope.
"""

import numpy as np
import pytest

from shoal import core
import shoal.core.nn.functional as F

torch = pytest.importorskip("torch")
tf = torch.nn.functional

_N = 4096
_DTYPES = {"bf16": (core.bfloat16, torch.bfloat16), "f16": (core.float16, torch.float16)}


def _ordered(bits: np.ndarray) -> np.ndarray:
    """16-bit float bit patterns as integers in the floats' order (sign-magnitude to linear)."""
    i = bits.astype(np.int32)
    return np.where(i & 0x8000, -(i & 0x7FFF), i)


def _ulps(ours, theirs) -> np.ndarray:
    """How many representable 16-bit values apart each element of the two results is."""
    assert str(ours.dtype).split(".")[-1] == str(theirs.dtype).split(".")[-1]
    a = ours.detach().numpy().view(np.uint16)
    b = theirs.detach().view(torch.int16).numpy().view(np.uint16)
    assert a.shape == b.shape
    return np.abs(_ordered(a) - _ordered(b))


def _pair(values: np.ndarray, kind: str, requires_grad: bool = True):
    """The same 16-bit values as a core tensor and a torch tensor (rounded once, by torch)."""
    t = torch.tensor(values, dtype=_DTYPES[kind][1])
    c = core.tensor(t.float().numpy(), dtype=_DTYPES[kind][0])  # exact: already representable
    return c.requires_grad_(requires_grad), t.requires_grad_(requires_grad)


def _inputs(kind: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(_N) * 3
    y = rng.standard_normal(_N) * 3
    y = np.where(np.abs(y) < 0.05, 0.5, y)  # a divisor clear of 0
    g = rng.standard_normal(_N)
    return _pair(x, kind), _pair(y, kind), _pair(g, kind, requires_grad=False)


# A tolerance is (ulps, share, atol): elements at most `ulps` apart (or, beyond that, at most
# `atol` apart), and at most `share` of them apart at all; a dict holds one per dtype; 0 is
# bit for bit.
# numpy's float32 exp/log/tanh and torch's (Sleef) differ in a last bit: 1 ulp apart at most,
# on as many elements as the CPU's kernels make (see the module docstring), each inside the
# float32 envelope.
_LIBM = (1, None, 0)
# A gradient computed from the op's rounded 16-bit result (exp, tanh, sigmoid: g * out, ...) is
# exact arithmetic on 16-bit values, so it equals torch's bit for bit wherever the two forward
# results are equal, and is 1 ulp apart at most where they are not.
_FROM_OUTPUT = (1, "forward", 0)
_COMPOSITE = (2, 0.4, 0)  # torch rounds after each step of the formula, core once at its end
# torch's pow backward uses x ** (1.3 - 1) with 0.3 rounded to the 16-bit type, and rounds
# after each of its three products; core uses the rounded exponent 1.3 throughout.
_POW_BACKWARD = (6, 0.8, 0)
# gelu's float32 1 + erf(x/sqrt 2) (or 1 + tanh) cancels in the negative tail in both
# libraries, each ~1e-6 from the truth there: the results agree to that absolute size.
_GELU = (1, None, 2e-5)

# name: (shoal fn, torch fn, forward, x-gradient, y-gradient tolerance; None: no gradient).
_ELEMENTWISE = {
    "add": (lambda x, y: x + y, lambda x, y: x + y, 0, 0, 0),
    "sub": (lambda x, y: x - y, lambda x, y: x - y, 0, 0, 0),
    "mul": (lambda x, y: x * y, lambda x, y: x * y, 0, 0, 0),
    "div": (lambda x, y: x / y, lambda x, y: x / y, 0, 0, _COMPOSITE),  # -g * ((x / y) / y)
    "add_python_scalar": (lambda x, y: x + 0.1, lambda x, y: x + 0.1, 0, 0, None),
    "mul_python_scalar": (lambda x, y: x * 0.1, lambda x, y: x * 0.1, 0, 0, None),
    "rsub_python_scalar": (lambda x, y: 0.3 - x, lambda x, y: 0.3 - x, 0, 0, None),
    "pow_python_exponent": (lambda x, y: x.abs() ** 1.3, lambda x, y: x.abs() ** 1.3, 0,
                            _POW_BACKWARD, None),
    "square": (lambda x, y: x**2, lambda x, y: x**2, 0, 0, None),
    # torch's bfloat16 x ** 3 rounds x * x before the second product.
    "cube": (lambda x, y: x**3, lambda x, y: x**3, {"bf16": _COMPOSITE, "f16": 0}, _COMPOSITE,
             None),
    "neg": (lambda x, y: -x, lambda x, y: -x, 0, 0, None),
    "abs": (lambda x, y: x.abs(), lambda x, y: x.abs(), 0, 0, None),
    "relu": (lambda x, y: x.relu(), lambda x, y: x.relu(), 0, 0, None),
    "clamp": (lambda x, y: x.clamp(-0.1, 0.7), lambda x, y: x.clamp(-0.1, 0.7), 0, 0, None),
    "sqrt": (lambda x, y: (x.abs() + 0.1).sqrt(), lambda x, y: (x.abs() + 0.1).sqrt(), 0, 0,
             None),
    "exp": (lambda x, y: x.exp(), lambda x, y: x.exp(), _LIBM, _FROM_OUTPUT, None),
    # log of |y| (|y| >= 0.05, abs is exact), so the float32 envelope starts from the same input.
    "log": (lambda x, y: y.abs().log(), lambda x, y: y.abs().log(), _LIBM, None, 0),
    "tanh": (lambda x, y: x.tanh(), lambda x, y: x.tanh(), _LIBM, _FROM_OUTPUT, None),
    # torch's float16 sigmoid_backward rounds after each product (c10::Half arithmetic), so
    # its gradient may be up to 4 ulps from core's anywhere, whatever the forward results.
    "sigmoid": (lambda x, y: (x * 8).sigmoid(), lambda x, y: (x * 8).sigmoid(), _LIBM,
                {"bf16": _FROM_OUTPUT, "f16": (4, 1.0, 0)}, None),
    "gelu": (lambda x, y: F.gelu(x), lambda x, y: tf.gelu(x), _GELU, _GELU, None),
    "gelu_tanh": (lambda x, y: F.gelu(x, approximate="tanh"),
                  lambda x, y: tf.gelu(x, approximate="tanh"), _GELU, _GELU, None),
}


def _check(ours, theirs, tolerance, kind: str, what: str, envelope=None, forwards=None) -> None:
    """ours equals theirs within `tolerance` (see _LIBM), in the same 16-bit dtype; a share of
    None (the libm ops) checks each element against `envelope` (see `_within_envelope`), and
    "forward" checks equality wherever the `forwards` (ours, torch's) are equal."""
    assert ours.dtype == _DTYPES[kind][0], what  # computed in float32, rounded to its dtype
    if isinstance(tolerance, dict):
        tolerance = tolerance[kind]
    ulps, share, atol = (tolerance, 0.0, 0.0) if isinstance(tolerance, int) else tolerance
    diff = _ulps(ours, theirs)
    apart = np.abs(ours.detach().numpy().astype(np.float64) - theirs.detach().double().numpy())
    beyond = diff > ulps
    assert not beyond.any() or apart[beyond].max() <= atol, (what, int(diff.max()), apart.max())
    if share == "forward":
        same = _ulps(*forwards) == 0
        assert (diff[same] == 0).all(), (what, int((diff[same] > 0).sum()), "differ where the "
                                         "forward results are equal")
    elif share is None:
        outside = ~_within_envelope(ours.detach().numpy(), *envelope)
        assert not outside.any(), (what, int(outside.sum()), "elements outside the envelope")
    else:
        assert (diff > 0).mean() <= share, (what, float((diff > 0).mean()))


def _within_envelope(ours16: np.ndarray, truth: np.ndarray, err: np.ndarray) -> np.ndarray:
    """Whether each 16-bit result is the rounding of some value within `err` of `truth`.

    `err` is this CPU's float32 error of the op, measured: twice the larger of core's and
    torch's float32 distance from the float64 truth, plus a float32 ulp of the truth. Rounding is
    monotonic, so the roundings of [truth - err, truth + err] are exactly the 16-bit values from
    round(truth - err) to round(truth + err).
    """
    dt = ours16.dtype
    lo = (truth - err).astype(np.float32).astype(dt).astype(np.float64)
    hi = (truth + err).astype(np.float32).astype(dt).astype(np.float64)
    value = ours16.astype(np.float64)
    return (value >= lo) & (value <= hi)


def _run_at(fn_c, fn_t, x16, y16, g16, core_dt, torch_dt):
    """The op and its input gradients at another precision, from the same 16-bit values."""
    def widen(c, t, requires_grad=True):
        values = t.detach().double().numpy()
        return (core.tensor(values, dtype=core_dt).requires_grad_(requires_grad),
                torch.tensor(values, dtype=torch_dt).requires_grad_(requires_grad))
    (x, tx), (y, ty), (g, tg) = widen(*x16), widen(*y16), widen(*g16, requires_grad=False)
    out, tout = fn_c(x, y), fn_t(tx, ty)
    out.backward(g)
    tout.backward(tg)
    return {"forward": (out, tout), "x": (x.grad, tx.grad), "y": (y.grad, ty.grad)}


def _envelopes(fn_c, fn_t, kind):
    """(truth, err) for the forward and the x gradient: see `_within_envelope`."""
    inputs = _inputs(kind)
    exact = _run_at(fn_c, fn_t, *inputs, core.float64, torch.float64)
    single = _run_at(fn_c, fn_t, *inputs, core.float32, torch.float32)
    envelopes = {}
    for key, (truth_c, _) in exact.items():
        if truth_c is None:
            continue
        truth = truth_c.detach().numpy()
        ours32, theirs32 = (t.detach().numpy().astype(np.float64) for t in single[key])
        err = 2 * np.maximum(np.abs(ours32 - truth), np.abs(theirs32 - truth))
        envelopes[key] = (truth, err + np.abs(np.spacing(truth.astype(np.float32))))
    return envelopes


@pytest.mark.parametrize("kind", sorted(_DTYPES))
@pytest.mark.parametrize("name", sorted(_ELEMENTWISE))
def test_forward_and_backward_match_torch_in_16_bits(name, kind):
    fn_c, fn_t, fwd, gx, gy = _ELEMENTWISE[name]
    (x, tx), (y, ty), (g, tg) = _inputs(kind)
    libm = any(t in (_LIBM, _GELU) for t in (fwd, gx, gy))
    envelopes = _envelopes(fn_c, fn_t, kind) if libm else {}
    out, tout = fn_c(x, y), fn_t(tx, ty)
    _check(out, tout, fwd, kind, f"{name} forward", envelopes.get("forward"))
    out.backward(g)
    tout.backward(tg)
    for ours, theirs, tolerance, what in ((x.grad, tx.grad, gx, "x"), (y.grad, ty.grad, gy, "y")):
        if tolerance is None:
            assert ours is None and theirs is None
        else:
            _check(ours, theirs, tolerance, kind, f"{name} gradient of {what}",
                   envelopes.get(what), (out, tout))


def test_sigmoid_is_accurate_in_both_tails_as_torch():
    x = np.array([-200.0, -88.0, -40.0, -20.0, -9.0, 0.0, 9.0, 20.0, 200.0])
    for dt in (np.float32, np.float64):
        ours = core.tensor(x, dtype=dt).sigmoid().numpy()
        theirs = torch.tensor(x.astype(dt)).sigmoid().numpy()
        np.testing.assert_allclose(ours, theirs, rtol=4e-7 if dt == np.float32 else 1e-15,
                                   atol=0)
    assert 0 < core.tensor([-20.0]).sigmoid().item() < 3e-9  # not 1 + tanh(-10) = 0 in float32


def test_16_bit_linear_matches_torch():
    """float32 accumulation then one rounding: equal up to the order of the sums."""
    rng = np.random.default_rng(1)
    for kind in sorted(_DTYPES):
        x, tx = _pair(rng.standard_normal((64, 48)), kind)
        w, tw = _pair(rng.standard_normal((32, 48)) * 0.2, kind)
        b, tb = _pair(rng.standard_normal(32), kind)
        g, tg = _pair(rng.standard_normal((64, 32)), kind, requires_grad=False)
        out, tout = F.linear(x, w, b), tf.linear(tx, tw, tb)
        out.backward(g)
        tout.backward(tg)
        for ours, theirs in ((out, tout), (x.grad, tx.grad), (w.grad, tw.grad), (b.grad, tb.grad)):
            assert ours.dtype == _DTYPES[kind][0]
            np.testing.assert_allclose(ours.detach().numpy().astype(np.float32),
                                       theirs.detach().float().numpy(), rtol=8e-3, atol=2e-2)


@pytest.mark.parametrize("kind", sorted(_DTYPES))
def test_16_bit_gradient_sums_accumulate_in_float32(kind):
    """4096 gradients of 1 summed into a bias: 4096, as torch. Summed in bfloat16, the total
    stopped growing at 256 (256 + 1 rounds back to 256)."""
    dt, tdt = _DTYPES[kind]
    ones = np.ones((_N, 3))
    x = core.tensor(np.ones((_N, 2)), dtype=dt)
    w = core.tensor(np.ones((3, 2)), dtype=dt, requires_grad=True)
    b = core.tensor(np.zeros(3), dtype=dt, requires_grad=True)
    F.linear(x, w, b).backward(core.tensor(ones, dtype=dt))
    shift = core.tensor(np.zeros(3), dtype=dt, requires_grad=True)
    scale = core.tensor(np.ones(3), dtype=dt, requires_grad=True)
    (core.tensor(ones, dtype=dt) * scale + shift).backward(core.tensor(ones, dtype=dt))
    tb = torch.zeros(3, dtype=tdt, requires_grad=True)
    tf.linear(torch.ones(_N, 2, dtype=tdt), torch.ones(3, 2, dtype=tdt), tb).backward(
        torch.ones(_N, 3, dtype=tdt))
    for grad in (b.grad, shift.grad, scale.grad):
        assert grad.dtype == dt
        np.testing.assert_array_equal(grad.numpy().astype(np.float32), tb.grad.float().numpy())
    assert tb.grad.float().tolist() == [4096.0] * 3


@pytest.mark.parametrize("kind", sorted(_DTYPES))
def test_a_broadcast_operand_of_where_sums_its_16_bit_gradient_in_float32(kind):
    """The shared unbroadcast (where, maximum, the shape ops): a (1,) operand broadcast over
    4096 elements gets 4096, as torch's, not a 16-bit running sum stuck at 256 (or 2048)."""
    dt, tdt = _DTYPES[kind]
    c = core.tensor(np.ones(1), dtype=dt, requires_grad=True)
    core.where(core.tensor(np.ones(_N, dtype=bool)), c,
               core.tensor(np.zeros(_N), dtype=dt)).sum().backward()
    tc = torch.ones(1, dtype=tdt, requires_grad=True)
    torch.where(torch.ones(_N, dtype=torch.bool), tc, torch.zeros(_N, dtype=tdt)).sum().backward()
    assert c.grad.dtype == dt
    assert c.grad.numpy().astype(np.float32).tolist() == tc.grad.float().tolist() == [4096.0]


def test_bfloat16_losses_are_the_float64_truth_rounded_once():
    """mse_loss, cross_entropy and nll_loss on bfloat16 inputs compute in float32 and round
    once: the loss and its gradient equal torch's float64 result on the same values, rounded
    to bfloat16. (torch's own bfloat16 nll_loss and cross_entropy round intermediate results:
    a few ulps from that here.)"""
    rng = np.random.default_rng(2)
    x, tx = _pair(rng.standard_normal((256, 10)), "bf16")
    y, ty = _pair(rng.standard_normal((256, 10)), "bf16", requires_grad=False)
    labels = rng.integers(0, 10, 256)
    ci, ti = core.tensor(labels), torch.tensor(labels)
    for name, fn_c, fn_t in (
        ("mse_loss", lambda a: F.mse_loss(a, y), lambda a: tf.mse_loss(a, ty.double())),
        ("mse_loss none", lambda a: F.mse_loss(a, y, reduction="none"),
         lambda a: tf.mse_loss(a, ty.double(), reduction="none")),
        ("cross_entropy", lambda a: F.cross_entropy(a, ci), lambda a: tf.cross_entropy(a, ti)),
        ("cross_entropy none", lambda a: F.cross_entropy(a, ci, reduction="none"),
         lambda a: tf.cross_entropy(a, ti, reduction="none")),
        ("cross_entropy smoothed", lambda a: F.cross_entropy(a, ci, label_smoothing=0.1),
         lambda a: tf.cross_entropy(a, ti, label_smoothing=0.1)),
        ("nll_loss", lambda a: F.nll_loss(a, ci), lambda a: tf.nll_loss(a, ti)),
    ):
        x.grad = None
        t64 = tx.detach().double().requires_grad_(True)
        out, want = fn_c(x), fn_t(t64)
        out.sum().backward()
        want.sum().backward()
        _check(out, want.bfloat16(), (1, 0.01, 0), "bf16", f"{name} forward")
        _check(x.grad, t64.grad.bfloat16(), (1, 0.01, 0), "bf16", f"{name} gradient")


def test_bfloat16_attention_matches_torch():
    rng = np.random.default_rng(3)
    q, tq = _pair(rng.standard_normal((2, 4, 16, 8)), "bf16")
    k, tk = _pair(rng.standard_normal((2, 4, 16, 8)), "bf16")
    v, tv = _pair(rng.standard_normal((2, 4, 16, 8)), "bf16")
    g, tg = _pair(rng.standard_normal((2, 4, 16, 8)), "bf16", requires_grad=False)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    tout = tf.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    out.backward(g)
    tout.backward(tg)
    for ours, theirs in ((out, tout), (q.grad, tq.grad), (k.grad, tk.grad), (v.grad, tv.grad)):
        assert ours.dtype == core.bfloat16
        np.testing.assert_allclose(ours.detach().numpy().astype(np.float32),
                                   theirs.detach().float().numpy(), rtol=2e-2, atol=2e-2)


def test_bfloat16_dropout_scales_by_the_rounded_factor_as_torch():
    """torch's mask holds 1/(1-p) rounded to bfloat16 (1/0.7 -> 1.4296875); kept elements are
    x times that, rounded once, and the gradient is g times the same mask."""
    x, _ = _pair(np.linspace(-3, 3, _N), "bf16")
    g, _ = _pair(np.linspace(1, 2, _N), "bf16", requires_grad=False)
    core.manual_seed(0)
    out = F.dropout(x, 0.3)
    out.backward(g)
    kept = out.detach().numpy().astype(np.float32) != 0
    assert 0.6 < kept.mean() < 0.8
    factor = torch.tensor(1 / 0.7, dtype=torch.bfloat16).float()
    tx = torch.tensor(x.detach().numpy().astype(np.float32)).bfloat16()
    want = (tx.float() * factor).bfloat16().float().numpy()
    np.testing.assert_array_equal(out.detach().numpy().astype(np.float32)[kept], want[kept])
    tgrad = (torch.tensor(g.numpy().astype(np.float32)).float() * factor).bfloat16().float()
    np.testing.assert_array_equal(x.grad.numpy().astype(np.float32)[kept], tgrad.numpy()[kept])
    assert not x.grad.numpy().astype(np.float32)[~kept].any()


def test_bfloat16_comparisons_round_a_python_number_to_bfloat16_as_torch():
    values = [0.1, 256.0, 3.0, -0.3, 1e-3]
    x, tx = _pair(np.array(values), "bf16", requires_grad=False)
    ints = [0, 257, 3, -1, 0]
    for other in (0.1, 257, -0.3, 1e-3, core.tensor(ints), core.tensor(values),
                  core.tensor(values, dtype=core.float64)):
        t_other = torch.tensor(other.numpy()) if isinstance(other, core.Tensor) else other
        for op in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"):
            got = getattr(x, op)(other)
            want = getattr(tx, op)(t_other)
            assert got.dtype == core.bool
            assert got.numpy().tolist() == want.numpy().tolist(), (op, other)


def test_float32_and_float64_results_are_unchanged_by_widening():
    """widen/narrow touch 16-bit floats only: other dtypes keep numpy's own results."""
    rng = np.random.default_rng(5)
    for dt in (np.float32, np.float64):
        a = rng.standard_normal(100).astype(dt)
        x = core.tensor(a, requires_grad=True)
        out = (x.tanh() * 3 + x.exp() / 2) ** 2
        assert out.dtype == core.tensor(a).dtype
        np.testing.assert_array_equal(out.detach().numpy(), (np.tanh(a) * 3 + np.exp(a) / 2) ** 2)
    # integer input: the default floating dtype, as torch (numpy's rule would give float64)
    assert core.tensor([1, 2]).exp().dtype == core.float32


@pytest.mark.parametrize("dtype", [core.int64, core.int32, core.uint8, core.bool])
@pytest.mark.parametrize("exponent", [-1, -2])
def test_integer_tensor_to_a_negative_python_power_is_refused_as_torch(dtype, exponent):
    base = core.tensor([2, 1, 0, 3]).to(dtype)
    tbase = torch.tensor([2, 1, 0, 3]).to(getattr(torch, str(dtype).split(".")[-1]))
    with pytest.raises(RuntimeError, match="Integers to negative integer powers are not allowed"):
        tbase**exponent
    message = (r"pow: Integers to negative integer powers are not allowed \(an integer tensor "
               rf"to the power {exponent}\); make the base or the exponent a float\.")
    with pytest.raises(RuntimeError, match=message):
        base**exponent
    with pytest.raises(RuntimeError, match="Integers to negative integer powers"):
        base.pow(exponent)


def test_integer_tensor_exponents_follow_torch_integer_pow():
    base = [2, 1, -1, -1, 0, 3, -2, 5]
    exps = [-1, -3, -3, -2, 2, -2, 3, 0]
    cases = [
        (core.tensor(base) ** core.tensor(exps), torch.tensor(base) ** torch.tensor(exps)),
        (core.tensor(base) ** core.tensor(-1), torch.tensor(base) ** torch.tensor(-1)),
        (2 ** core.tensor(exps), 2 ** torch.tensor(exps)),
        (core.tensor(base) ** 3, torch.tensor(base) ** 3),
    ]
    with np.errstate(divide="ignore"):  # 0 ** -1.0 is inf, as in torch
        cases.append((core.tensor(base) ** -1.0, torch.tensor(base) ** -1.0))
    for ours, theirs in cases:
        assert str(ours.dtype).split(".")[-1] == str(theirs.dtype).split(".")[-1]
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
