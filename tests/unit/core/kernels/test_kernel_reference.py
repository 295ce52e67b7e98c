"""The numpy references of core.kernels (the CPU path) against torch and finite differences."""

from __future__ import annotations


import numpy as np
import pytest

from shoal.core.errors import ShapeError
from shoal.core.kernels import (
    TargetError,
    adam_step_reference,
    compress_reference,
    cross_entropy_backward_reference,
    cross_entropy_forward_reference,
    decompress_reference,
    flatten_reference,
    gelu_backward_reference,
    gelu_forward_reference,
    sgd_step_reference,
    unflatten_reference,
)

torch = pytest.importorskip("torch")

SGD_CASES = [
    dict(momentum=0.0),
    dict(momentum=0.9),
    dict(momentum=0.9, nesterov=True),
    dict(momentum=0.9, nesterov=True, weight_decay=0.01),
    dict(momentum=0.9, dampening=0.3, weight_decay=0.05),
    dict(momentum=0.8, dampening=0.1, nesterov=False, maximize=True),
    dict(momentum=0.0, weight_decay=0.1, maximize=True),
    dict(momentum=0.5, weight_decay=0.1, maximize=True, nesterov=True),
]


@pytest.mark.parametrize("case", SGD_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sgd_reference_matches_torch_sgd_over_steps(case):
    rng = np.random.default_rng(0)
    param = rng.standard_normal((7, 5))
    tparam = torch.tensor(param.copy(), requires_grad=True)
    opt = torch.optim.SGD([tparam], lr=0.05, foreach=False, **case)
    buf = np.zeros_like(param) if case["momentum"] else None
    scratch = np.empty_like(param)
    for step in range(4):
        grad = rng.standard_normal(param.shape)
        tparam.grad = torch.tensor(grad)
        opt.step()
        sgd_step_reference(param, grad, buf, lr=0.05, first=step == 0, scratch=scratch, **case)
        np.testing.assert_allclose(param, tparam.detach().numpy(), rtol=1e-13, atol=1e-13)
    if buf is not None:
        np.testing.assert_allclose(buf, opt.state[tparam]["momentum_buffer"].numpy(), rtol=1e-13)


def test_sgd_reference_float32_stays_in_place_without_scratch():
    param = np.ones(4, dtype=np.float32)
    before = param.ctypes.data
    buf = np.zeros(4, dtype=np.float32)
    sgd_step_reference(param, np.full(4, 2, np.float32), buf, lr=0.5, momentum=0.9, first=True)
    assert param.dtype == np.float32 and param.ctypes.data == before
    np.testing.assert_array_equal(param, np.zeros(4, np.float32))
    np.testing.assert_array_equal(buf, np.full(4, 2, np.float32))


ADAM_CASES = [
    dict(),
    dict(weight_decay=0.1),
    dict(amsgrad=True),
    dict(weight_decay=0.05, amsgrad=True, maximize=True),
    dict(maximize=True),
]


@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
@pytest.mark.parametrize("case", ADAM_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "plain")
def test_adam_reference_matches_torch_over_steps(case, decoupled):
    rng = np.random.default_rng(1)
    param = rng.standard_normal((6, 3))
    tparam = torch.tensor(param.copy(), requires_grad=True)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    kwargs = dict(lr=0.01, betas=(0.8, 0.95), eps=1e-6, foreach=False, **case)
    if decoupled and "weight_decay" not in case:
        kwargs["weight_decay"] = 0.0
    opt = cls([tparam], **kwargs)
    exp_avg, exp_avg_sq = np.zeros_like(param), np.zeros_like(param)
    max_sq = np.zeros_like(param) if case.get("amsgrad") else None
    scratch = np.empty(2 * param.size)
    for step in range(1, 5):
        grad = rng.standard_normal(param.shape)
        tparam.grad = torch.tensor(grad)
        opt.step()
        adam_step_reference(
            param, grad, exp_avg, exp_avg_sq, max_sq, step=step, lr=0.01, beta1=0.8, beta2=0.95,
            eps=1e-6, weight_decay=kwargs.get("weight_decay", 0.0), decoupled=decoupled,
            maximize=case.get("maximize", False), scratch=scratch,
        )
        np.testing.assert_allclose(param, tparam.detach().numpy(), rtol=1e-12, atol=1e-14)
    state = opt.state[tparam]
    np.testing.assert_allclose(exp_avg, state["exp_avg"].numpy(), rtol=1e-12)
    np.testing.assert_allclose(exp_avg_sq, state["exp_avg_sq"].numpy(), rtol=1e-12)


@pytest.mark.parametrize("ignore", [False, True])
def test_cross_entropy_reference_matches_torch_forward_and_backward(ignore):
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((9, 6)) * 4
    target = rng.integers(0, 6, size=9)
    if ignore:
        target[[1, 4]] = -100
    loss, lse = cross_entropy_forward_reference(logits, target)
    tl = torch.tensor(logits, requires_grad=True)
    tloss = torch.nn.functional.cross_entropy(tl, torch.tensor(target), reduction="none")
    np.testing.assert_allclose(loss, tloss.detach().numpy(), rtol=1e-13, atol=1e-14)
    weights = rng.standard_normal(9)
    (tloss * torch.tensor(weights)).sum().backward()
    grad = cross_entropy_backward_reference(logits, target, lse, weights)
    np.testing.assert_allclose(grad, tl.grad.numpy(), rtol=1e-12, atol=1e-14)


def test_cross_entropy_reference_mean_reduction_gradient_matches_finite_differences():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 5))
    target = np.array([0, 4, 2, 2])

    def mean_loss(x):
        return cross_entropy_forward_reference(x, target)[0].mean()

    _, lse = cross_entropy_forward_reference(logits, target)
    grad = cross_entropy_backward_reference(logits, target, lse, 1.0 / 4)
    eps = 1e-6
    numeric = np.zeros_like(logits)
    for index in np.ndindex(logits.shape):
        plus, minus = logits.copy(), logits.copy()
        plus[index] += eps
        minus[index] -= eps
        numeric[index] = (mean_loss(plus) - mean_loss(minus)) / (2 * eps)
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-9)


def test_cross_entropy_reference_is_stable_for_huge_logits():
    logits = np.array([[1e4, 0.0, -1e4]], dtype=np.float32)
    loss, lse = cross_entropy_forward_reference(logits, np.array([1]))
    assert np.isfinite(loss).all() and loss[0] == pytest.approx(1e4)
    assert lse.dtype == np.float32


def test_cross_entropy_reference_rejects_bad_targets_and_shapes():
    logits = np.zeros((3, 4))
    with pytest.raises(TargetError, match=r"target 4 at row 2 is out of range for 4 classes"):
        cross_entropy_forward_reference(logits, np.array([0, 1, 4]))
    with pytest.raises(ShapeError, match=r"logits \(3, 4\) and target \(2,\)"):
        cross_entropy_forward_reference(logits, np.array([0, 1]))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_reference_matches_torch_forward_and_backward(approximate):
    x = np.linspace(-8, 8, 401)
    gout = np.cos(x)
    tx = torch.tensor(x, requires_grad=True)
    ty = torch.nn.functional.gelu(tx, approximate=approximate)
    (ty * torch.tensor(gout)).sum().backward()
    # 1 + tanh(...) cancels for large negative x, so compare at absolute 1e-13 there.
    np.testing.assert_allclose(gelu_forward_reference(x, approximate), ty.detach().numpy(),
                               rtol=1e-14, atol=1e-13)
    np.testing.assert_allclose(gelu_backward_reference(x, gout, approximate), tx.grad.numpy(),
                               rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_backward_reference_matches_finite_differences(approximate):
    x = np.array([-3.1, -0.7, 0.0, 0.2, 1.3, 4.0])
    eps = 1e-6
    numeric = (gelu_forward_reference(x + eps, approximate)
               - gelu_forward_reference(x - eps, approximate)) / (2 * eps)
    np.testing.assert_allclose(gelu_backward_reference(x, np.ones_like(x), approximate), numeric,
                               rtol=1e-7, atol=1e-9)


def test_gelu_reference_keeps_float32_and_rejects_unknown_approximation():
    x = np.linspace(-2, 2, 9, dtype=np.float32)
    assert gelu_forward_reference(x).dtype == np.float32
    assert gelu_backward_reference(x, np.ones_like(x)).dtype == np.float32
    with pytest.raises(Exception, match=r"approximate='sigmoid' is not supported"):
        gelu_forward_reference(x, "sigmoid")


def test_flatten_and_unflatten_reference_round_trip_including_empty_arrays():
    rng = np.random.default_rng(4)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in [(3, 4), (0,), (5,), (2, 1, 2)]]
    flat = flatten_reference(arrays)
    np.testing.assert_array_equal(flat, np.concatenate([a.ravel() for a in arrays]))
    targets = [np.zeros_like(a) for a in arrays]
    unflatten_reference(flat * 2, targets)
    for a, t in zip(arrays, targets):
        np.testing.assert_array_equal(t, a * 2)
    with pytest.raises(ShapeError, match=r"at least 21 elements for 4 arrays"):
        flatten_reference(arrays, out=np.empty(20, np.float32))
    with pytest.raises(ShapeError, match=r"array 1 has dtype float64 but the buffer has float32"):
        flatten_reference([arrays[0], np.zeros(2)])


def test_fp16_compress_reference_scales_before_rounding():
    x = np.array([1e5, -3.0, 0.1, 7e4], dtype=np.float32)
    h = compress_reference(x, scale=0.25)
    assert h.dtype == np.float16
    np.testing.assert_array_equal(h, (x * np.float32(0.25)).astype(np.float16))
    assert np.isfinite(h).all()  # 1e5 alone would overflow float16
    out = np.empty(4, dtype=np.float32)
    decompress_reference(h, out, scale=4.0)
    np.testing.assert_allclose(out, x, rtol=1e-3)
    with pytest.raises(ShapeError, match=r"compress needs equal shapes"):
        compress_reference(x, out=np.empty(3, np.float16))


@pytest.mark.parametrize("layout", ["contiguous", "transposed-view"])
def test_large_parameters_go_through_blocks_and_still_match_torch(layout):
    # 300 x 301 float64 is 706 KiB: three blocks of 256 KiB, the last one partial.
    rng = np.random.default_rng(7)
    base = rng.standard_normal((301, 300))
    param = base.copy() if layout == "contiguous" else base.copy().T
    grads = [rng.standard_normal(param.shape) for _ in range(2)]
    sgd_p = torch.tensor(param.copy(), requires_grad=True)
    adam_p = torch.tensor(param.copy(), requires_grad=True)
    sgd = torch.optim.SGD([sgd_p], lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01,
                          foreach=False)
    adam = torch.optim.AdamW([adam_p], lr=0.01, weight_decay=0.1, amsgrad=True, foreach=False)
    ours_sgd, ours_adam = param.copy(), param.copy()
    if layout != "contiguous":
        ours_sgd, ours_adam = np.asfortranarray(ours_sgd), np.asfortranarray(ours_adam)
    buf = np.zeros_like(param)
    m, v, vmax = np.zeros_like(param), np.zeros_like(param), np.zeros_like(param)
    for step, g in enumerate(grads, start=1):
        sgd_p.grad, adam_p.grad = torch.tensor(g), torch.tensor(g)
        sgd.step()
        adam.step()
        sgd_step_reference(ours_sgd, g, buf, lr=0.1, momentum=0.9, nesterov=True,
                           weight_decay=0.01, first=step == 1)
        adam_step_reference(ours_adam, g, m, v, vmax, step=step, lr=0.01, beta1=0.9,
                            beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True)
    np.testing.assert_allclose(ours_sgd, sgd_p.detach().numpy(), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(ours_adam, adam_p.detach().numpy(), rtol=1e-12, atol=1e-14)
