"""Complex tensors against torch: creation, arithmetic, reductions, parts, and complex autograd
(torch's conjugate Wirtinger convention: `.grad` of a complex leaf is dL/dRe + i dL/dIm)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal import core

# complex128 throughout the gradient checks: both libraries apply the same chain rule and differ
# by reassociation only, a few ulp of double per term.
RTOL, ATOL = 1e-10, 1e-12
# complex64 forward values: numpy's and torch's float32 kernels differ by a few ulp (1e-7).
RTOL32, ATOL32 = 1e-5, 1e-6


def _pair(arr: np.ndarray, grad: bool = True) -> tuple:
    return (core.tensor(arr, requires_grad=grad), torch.tensor(arr, requires_grad=grad))


def _data(shape: tuple, seed: int = 0, dtype: type = np.complex128) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)


def _same(mine: core.Tensor, theirs: torch.Tensor, rtol: float = RTOL, atol: float = ATOL):
    assert mine.dtype.name == str(theirs.dtype).removeprefix("torch."), (mine.dtype, theirs.dtype)
    assert tuple(mine.shape) == tuple(theirs.shape)
    np.testing.assert_allclose(mine.numpy(force=True), theirs.detach().resolve_conj().resolve_neg().numpy(),
                               rtol=rtol, atol=atol)


def test_the_complex_dtypes_follow_torch():
    assert core.complex64 is core.cfloat and core.complex128 is core.cdouble
    assert core.complex64.is_complex and not core.complex64.is_floating_point
    assert core.complex64.to_real() is core.float32
    assert core.float64.to_complex() is core.complex128
    z = core.zeros(2, 3, dtype=core.complex128)
    assert z.is_complex() and not z.is_floating_point() and z.dtype is core.complex128
    assert core.ones(2, dtype=core.cfloat).tolist() == [1 + 0j, 1 + 0j]
    assert core.tensor([1 + 2j, 3]).dtype is core.complex64  # torch's default complex dtype
    assert core.tensor(np.array([1j])).dtype is core.complex128  # an array keeps its dtype
    assert core.full((2,), 1 + 2j).dtype is core.complex64
    assert not core.is_complex(core.ones(2)) and core.is_complex(core.tensor([1j]))
    assert repr(core.tensor([1 + 2j])) == "tensor([1.+2.j])"


@pytest.mark.parametrize("kind", ["randn", "rand"])
def test_random_complex_tensors_equal_torch_for_a_seed(kind):
    """torch draws 2n real values and pairs them (randn's scaled by 1/sqrt(2))."""
    gen, tgen = core.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    mine = getattr(core, kind)(4, 5, dtype=core.complex64, generator=gen)
    theirs = getattr(torch, kind)(4, 5, dtype=torch.complex64, generator=tgen)
    _same(mine, theirs, RTOL32, ATOL32)
    unseeded = core.randn(10000, dtype=core.complex128).numpy()
    # Each part has variance 1/2, so |z|^2 has mean 1; 10000 samples: 5 sigma is 0.05.
    assert abs(np.mean(np.abs(unseeded) ** 2) - 1) < 0.05


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_arithmetic_values_and_gradients_equal_torch(op):
    a, b = _data((3, 4), 1), _data((4,), 2)
    (x, xt), (y, yt) = _pair(a), _pair(b)
    out, out_t = getattr(core, op)(x, y), getattr(torch, op)(xt, yt)
    _same(out, out_t)
    (out.abs() ** 2).sum().backward()
    (out_t.abs() ** 2).sum().backward()
    _same(x.grad, xt.grad)
    _same(y.grad, yt.grad)


def test_mixing_real_and_complex_promotes_and_gives_the_real_part_to_the_real_operand():
    r = np.random.default_rng(4).standard_normal((2, 3)).astype(np.float32)
    (x, xt), (z, zt) = _pair(r), _pair(_data((2, 3), 5, np.complex64))
    out, out_t = x * z + 1.5j, xt * zt + 1.5j
    _same(out, out_t, RTOL32, ATOL32)
    out.abs().sum().backward()
    out_t.abs().sum().backward()
    assert x.grad.dtype is core.float32 and z.grad.dtype is core.complex64
    _same(x.grad, xt.grad, RTOL32, ATOL32)
    _same(z.grad, zt.grad, RTOL32, ATOL32)
    assert (core.ones(2, dtype=core.float64) * 1j).dtype is core.complex128
    assert (core.arange(3) * 1j).dtype is core.complex64  # an int tensor with a complex number


@pytest.mark.parametrize("fn", ["exp", "log", "sqrt", "tanh", "sigmoid", "sin", "cos", "tan",
                                "abs", "angle", "sgn", "conj", "real", "imag", "neg"])
def test_unary_values_and_gradients_equal_torch(fn):
    (z, zt) = _pair(_data((3, 5), 6))
    call = (lambda t: getattr(t, fn)) if fn in ("real", "imag") else (
        lambda t: getattr(t, fn)())
    out, out_t = call(z), call(zt)
    _same(out, out_t)
    # A real loss that sees both parts of a complex result (torch's .grad convention).
    weight = _data(out_t.shape, 7)
    w, wt = core.tensor(weight), torch.tensor(weight)
    loss = (out * w).real.sum() if out.is_complex() else (out * out).sum()
    loss_t = (out_t * wt).real.sum() if out_t.is_complex() else (out_t * out_t).sum()
    loss.backward()
    loss_t.backward()
    _same(z.grad, zt.grad)


def test_matmul_and_pow_gradients_equal_torch():
    (a, at), (b, bt) = _pair(_data((3, 4), 8)), _pair(_data((4, 2), 9))
    out, out_t = (a @ b) ** 2, (at @ bt) ** 2
    _same(out, out_t)
    ((out * out.conj()).real.sum() + (a ** b[0, 0]).abs().sum()).backward()
    ((out_t * out_t.conj()).real.sum() + (at ** bt[0, 0]).abs().sum()).backward()
    _same(a.grad, at.grad)
    _same(b.grad, bt.grad)


@pytest.mark.parametrize("reduce,kwargs", [("sum", {}), ("sum", {"dim": 1}), ("mean", {}),
                                           ("mean", {"dim": 0, "keepdim": True}), ("prod", {}),
                                           ("prod", {"dim": 1}),
                                           ("prod", {"dim": 0, "keepdim": True})])
def test_reductions_values_and_gradients_equal_torch(reduce, kwargs):
    (z, zt) = _pair(_data((3, 4), 10))
    out, out_t = getattr(core, reduce)(z, **kwargs), getattr(torch, reduce)(zt, **kwargs)
    _same(out, out_t)
    out.abs().sum().backward()
    out_t.abs().sum().backward()
    _same(z.grad, zt.grad)


def test_prod_of_real_tensors_with_zeros_and_integers_equals_torch():
    arr = np.array([[1.5, 0.0, 2.0], [0.0, 0.0, 3.0], [2.0, -1.0, 0.5]])
    for kwargs in ({}, {"dim": 0}, {"dim": 1}, {"dim": -1, "keepdim": True}):
        (x, xt) = _pair(arr)
        out, out_t = core.prod(x, **kwargs), torch.prod(xt, **kwargs)
        _same(out, out_t)
        out.sum().backward()
        out_t.sum().backward()
        _same(x.grad, xt.grad)
    ints = np.array([1, 2, 3], dtype=np.int32)
    assert core.prod(core.tensor(ints)).dtype is core.int64
    assert core.tensor(ints).prod().item() == 6
    with pytest.raises(TypeError, match="dim must be an int"):
        core.prod(core.ones(2, 3), (0, 1))


def test_complex_polar_and_the_views_equal_torch_with_gradients():
    rng = np.random.default_rng(11)
    re, im = rng.standard_normal((2, 3)), rng.standard_normal((3,))
    (r, rt), (i, it) = _pair(re), _pair(im)
    z, zt = core.complex(r, i), torch.complex(rt, it)
    _same(z, zt)
    p, pt = core.polar(r.abs() + 0.1, i), torch.polar(rt.abs() + 0.1, it)
    _same(p, pt)
    v, vt = core.view_as_real(z * p), torch.view_as_real(zt * pt)
    _same(v, vt)
    back, back_t = core.view_as_complex(v * 2), torch.view_as_complex(vt * 2)
    _same(back, back_t)
    (v.sum() + back.angle().sum()).backward()
    (vt.sum() + back_t.angle().sum()).backward()
    _same(r.grad, rt.grad)
    _same(i.grad, it.grad)


def test_real_and_imag_are_views_and_conj_of_a_real_tensor_is_itself():
    z = core.tensor([1 + 2j, 3 - 4j])
    z.real[0] = 9.0
    assert z.tolist() == [9 + 2j, 3 - 4j]
    view = core.view_as_real(z)
    view[1, 1] = 7.0
    assert z.tolist()[1] == 3 + 7j
    x = core.ones(2)
    assert x.conj() is x and x.real is x and core.resolve_conj(z) is z
    _same(core.angle(core.tensor([-1.0, 2.0, 0.0])), torch.angle(torch.tensor([-1.0, 2.0, 0.0])))
    assert core.angle(core.tensor([-1, 2])).dtype is core.float32


def test_errors_match_torch():
    with pytest.raises(RuntimeError, match="imag is not implemented"):
        core.imag(core.ones(2))
    with pytest.raises(RuntimeError, match="view_as_real is only supported for complex"):
        core.view_as_real(core.ones(2))
    with pytest.raises(RuntimeError, match="last dimension of size 2"):
        core.view_as_complex(core.ones(3))
    with pytest.raises(RuntimeError, match="scalar type: Long"):
        core.view_as_complex(core.ones(3, 2, dtype=core.int64))
    with pytest.raises(RuntimeError, match="scalar type Float but got scalar type Double"):
        core.complex(core.ones(2), core.ones(2, dtype=core.float64))
    with pytest.raises(RuntimeError, match="Half, Float or Double tensors but got Long and Long"):
        core.complex(core.ones(2, dtype=core.int64), core.ones(2, dtype=core.int64))
    z = core.tensor([1 + 1j], requires_grad=True)
    with pytest.raises(core.AutogradError, match="only for real scalar outputs"):
        (z * 2).sum().backward()
    with pytest.raises(core.AutogradError, match="only floating point tensors"):
        core.ones(2, dtype=core.int64).requires_grad_()


def test_casting_a_real_leaf_to_complex_gives_it_the_real_part_of_the_gradient():
    x, xt = _pair(np.array([1.0, -2.0]))
    y, yt = x.to(core.complex128) * (1 + 2j), xt.to(torch.complex128) * (1 + 2j)
    y.abs().sum().backward()
    yt.abs().sum().backward()
    assert x.grad.dtype is core.float64
    _same(x.grad, xt.grad)


def test_variance_of_a_complex_tensor_is_real_with_torchs_gradient():
    (z, zt) = _pair(_data((3, 4), 12))
    for kwargs in ({}, {"dim": 1}, {"dim": 0, "correction": 0}):
        out, out_t = z.var(**kwargs), zt.var(**kwargs)
        _same(out, out_t)
    z.var(dim=1).sum().backward()
    zt.var(dim=1).sum().backward()
    _same(z.grad, zt.grad)


def test_assert_close_compares_complex_values_as_complex():
    a = core.tensor([1 + 2j, 3 - 1j])
    core.testing.assert_close(a, core.tensor([1 + 2.000001j, 3 - 1j]))  # within complex64's
    with pytest.raises(AssertionError, match="not close"):
        core.testing.assert_close(a, core.tensor([1 + 3j, 3 - 1j]))  # differs in imag only


def test_create_graph_through_complex_ops_is_refused_rather_than_wrong():
    """core/double_backward.py's formulas are real ones: a complex double backward raises."""
    w = core.tensor([1 + 2j, -0.5 + 0.25j], requires_grad=True)
    y = (w * w * core.tensor([0.3 - 1j, 2 + 0.5j])).sum()
    with pytest.raises(NotImplementedError, match="complex gradient"):
        core.autograd.grad(y, w, grad_outputs=core.tensor(1 + 0j), create_graph=True)
    x = core.tensor([1.0, 2.0], requires_grad=True)  # real graphs keep their double backward
    (g,) = core.autograd.grad((x * x * x).sum(), x, create_graph=True)
    (h,) = core.autograd.grad(g.sum(), x)
    assert h.tolist() == [6.0, 12.0]


def test_linear_with_complex_weights_equals_torch():
    x_np, w_np, b_np = _data((5, 3), 13), _data((4, 3), 14), _data((4,), 15)
    (x, xt), (w, wt), (b, bt) = _pair(x_np), _pair(w_np), _pair(b_np)
    out = core.nn.functional.linear(x, w, b)
    out_t = torch.nn.functional.linear(xt, wt, bt)
    _same(out, out_t)
    out.abs().sum().backward()
    out_t.abs().sum().backward()
    for mine, theirs in ((x, xt), (w, wt), (b, bt)):
        _same(mine.grad, theirs.grad)
    real_x = np.random.default_rng(16).standard_normal((5, 3))
    (r, rt), (w2, w2t) = _pair(real_x), _pair(w_np)
    core.nn.functional.linear(r, w2).abs().sum().backward()
    torch.nn.functional.linear(rt.to(torch.complex128), w2t).abs().sum().backward()
    assert r.grad.dtype is core.float64
    _same(r.grad, rt.grad)


@pytest.mark.parametrize("kwargs", [{}, {"stride": 2, "padding": 1}, {"groups": 2}])
def test_conv2d_with_complex_tensors_equals_torch(kwargs):
    x_np, w_np, b_np = _data((2, 4, 6, 7), 17), _data((4, 4 // kwargs.get("groups", 1), 3, 3), 18), (
        _data((4,), 19))
    (x, xt), (w, wt), (b, bt) = _pair(x_np), _pair(w_np), _pair(b_np)
    out = core.nn.functional.conv2d(x, w, b, **kwargs)
    out_t = torch.nn.functional.conv2d(xt, wt, bt, **kwargs)
    _same(out, out_t)
    out.abs().sum().backward()
    out_t.abs().sum().backward()
    for mine, theirs in ((x, xt), (w, wt), (b, bt)):
        _same(mine.grad, theirs.grad)


def test_setting_real_and_imag_writes_into_the_tensor_as_in_torch():
    z, zt = core.tensor([1 + 2j, 3 - 1j]), torch.tensor([1 + 2j, 3 - 1j])
    z.real, zt.real = core.tensor([9.0, 8.0]), torch.tensor([9.0, 8.0])
    z.imag, zt.imag = core.tensor([0.5, 0.25]), torch.tensor([0.5, 0.25])
    _same(z, zt)
    with pytest.raises(RuntimeError, match="imag is not implemented"):
        core.ones(2).imag = core.ones(2)
