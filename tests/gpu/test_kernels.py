"""Each CUDA kernel in core.kernels against its numpy reference (skipped without CUDA)."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.core import kernels as K
from shoal.core.errors import ShapeError

cp = pytest.importorskip("cupy")

TOL = {np.float16: 2e-3, np.float32: 2e-6, np.float64: 1e-13}
FLOATS = [np.float16, np.float32, np.float64]


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _close(gpu, ref, dtype, scale=1.0):
    tol = TOL[dtype]
    np.testing.assert_allclose(cp.asnumpy(gpu).astype(np.float64), ref.astype(np.float64),
                               rtol=tol * scale, atol=tol * scale)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", [
    dict(momentum=0.0),
    dict(momentum=0.9),
    dict(momentum=0.9, nesterov=True, weight_decay=0.01),
    dict(momentum=0.8, dampening=0.2, maximize=True, weight_decay=0.1),
])
def test_sgd_kernel_matches_reference(dtype, case):
    rng = np.random.default_rng(0)
    shape = (257, 33)
    param = _rand(rng, shape, dtype)
    buf = np.zeros(shape, dtype) if case["momentum"] else None
    gparam = cp.asarray(param)
    gbuf = cp.asarray(buf) if buf is not None else None
    for step in range(3):
        grad = _rand(rng, shape, dtype)
        if dtype == np.float16:
            # The kernel accumulates in float32; the reference does too when fed float32.
            p32, b32 = param.astype(np.float32), None if buf is None else buf.astype(np.float32)
            K.sgd_step_reference(p32, grad.astype(np.float32), b32, lr=0.1, first=step == 0, **case)
            param = p32.astype(dtype)
            buf = None if b32 is None else b32.astype(dtype)
        else:
            K.sgd_step_reference(param, grad, buf, lr=0.1, first=step == 0, **case)
        K.sgd_step(gparam, cp.asarray(grad), gbuf, lr=0.1, first=step == 0, **case)
        _close(gparam, param, dtype, scale=10)
    if buf is not None:
        _close(gbuf, buf, dtype, scale=10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_kernel_matches_reference(dtype, decoupled, amsgrad):
    rng = np.random.default_rng(1)
    shape = (1000, 7)
    param = _rand(rng, shape, dtype)
    m, v = np.zeros(shape, dtype), np.zeros(shape, dtype)
    vmax = np.zeros(shape, dtype) if amsgrad else None
    gp, gm, gv = cp.asarray(param), cp.asarray(m), cp.asarray(v)
    gvmax = cp.asarray(vmax) if amsgrad else None
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, decoupled=decoupled)
    for step in range(1, 4):
        grad = _rand(rng, shape, dtype)
        K.adam_step_reference(param, grad, m, v, vmax, step=step, **kw)
        K.adam_step(gp, cp.asarray(grad), gm, gv, gvmax, step=step, **kw)
    _close(gp, param, dtype, scale=10)
    _close(gm, m, dtype, scale=10)
    _close(gv, v, dtype, scale=10)


def test_adam_kernel_runs_on_float16_parameters():
    rng = np.random.default_rng(5)
    param = _rand(rng, (64,), np.float16)
    grad = _rand(rng, (64,), np.float16)
    ref = param.astype(np.float32)
    m32, v32 = np.zeros(64, np.float32), np.zeros(64, np.float32)
    K.adam_step_reference(ref, grad.astype(np.float32), m32, v32, None, step=1, lr=1e-2,
                          beta1=0.9, beta2=0.999, eps=1e-8)
    gp = cp.asarray(param)
    K.adam_step(gp, cp.asarray(grad), cp.zeros(64, cp.float16), cp.zeros(64, cp.float16), None,
                step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
    _close(gp, ref, np.float16, scale=5)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(256, 10), (3, 1000), (1, 1), (0, 5)])
def test_cross_entropy_kernels_match_reference(dtype, shape):
    rng = np.random.default_rng(2)
    n, c = shape
    logits = (_rand(rng, shape, np.float64) * 3).astype(dtype)
    target = rng.integers(0, c, size=n)
    if n > 2:
        target[1] = -100
    ref_logits = logits.astype(np.float64)
    loss, lse = K.cross_entropy_forward_reference(ref_logits, target)
    gloss, glse = K.cross_entropy_forward(cp.asarray(logits), cp.asarray(target))
    assert gloss.dtype == dtype
    _close(gloss, loss.astype(dtype), dtype, scale=10)
    weights = rng.standard_normal(n)
    grad = K.cross_entropy_backward_reference(ref_logits, target, lse, weights)
    ggrad = K.cross_entropy_backward(cp.asarray(logits), cp.asarray(target), glse,
                                     cp.asarray(weights))
    assert ggrad.dtype == dtype and ggrad.shape == shape
    _close(ggrad, grad.astype(dtype), dtype, scale=10)


def test_cross_entropy_kernel_marks_out_of_range_targets_nan():
    loss, _ = K.cross_entropy_forward(cp.zeros((2, 3), cp.float32), cp.asarray([0, 7]))
    host = cp.asnumpy(loss)
    assert np.isfinite(host[0]) and np.isnan(host[1])


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_kernels_match_reference(dtype, approximate):
    rng = np.random.default_rng(3)
    x = (_rand(rng, (513, 9), np.float64) * 3).astype(dtype)
    gout = _rand(rng, x.shape, dtype)
    y = K.gelu_forward_reference(x.astype(np.float64), approximate)
    dx = K.gelu_backward_reference(x.astype(np.float64), gout.astype(np.float64), approximate)
    gy = K.gelu_forward(cp.asarray(x), approximate)
    gdx = K.gelu_backward(cp.asarray(x), cp.asarray(gout), approximate)
    assert gy.dtype == dtype and gdx.dtype == dtype
    _close(gy, y.astype(dtype), dtype, scale=10)
    _close(gdx, dx.astype(dtype), dtype, scale=10)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int64, np.uint8])
def test_flatten_and_unflatten_kernels_match_reference(dtype):
    rng = np.random.default_rng(4)
    shapes = [(3, 4), (0,), (1000, 3), (1,), (2, 2, 2)]
    arrays = [(rng.standard_normal(s) * 50).astype(dtype) for s in shapes]
    garrays = [cp.asarray(a) for a in arrays]
    flat = K.flatten(garrays)
    np.testing.assert_array_equal(cp.asnumpy(flat), K.flatten_reference(arrays))
    targets = [cp.zeros_like(a) for a in garrays]
    K.unflatten(flat[::-1].copy(), targets)
    ref_targets = [np.zeros_like(a) for a in arrays]
    K.unflatten_reference(K.flatten_reference(arrays)[::-1].copy(), ref_targets)
    for t, r in zip(targets, ref_targets):
        np.testing.assert_array_equal(cp.asnumpy(t), r)


def test_flatten_kernel_rejects_non_contiguous_arrays():
    with pytest.raises(ShapeError, match="C-contiguous"):
        K.flatten([cp.zeros((4, 4), cp.float32)[:, ::2]])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fp16_kernels_match_reference(dtype):
    rng = np.random.default_rng(6)
    x = (rng.standard_normal(10_001) * 1e4).astype(dtype)
    h = K.compress(cp.asarray(x), scale=0.125)
    assert h.dtype == cp.float16
    ref_h = K.compress_reference(x, scale=0.125)
    # float32 sources round exactly as numpy does; float64 ones pass through float32 on the
    # device, which may round a tie differently: allow one float16 ulp there.
    rtol = 0 if dtype == np.float32 else 1e-3
    np.testing.assert_allclose(cp.asnumpy(h).astype(np.float64), ref_h.astype(np.float64),
                               rtol=rtol)
    out = cp.empty(x.shape, dtype)
    K.decompress(h, out, scale=8.0)
    ref = K.decompress_reference(cp.asnumpy(h), np.empty_like(x), 8.0)
    np.testing.assert_array_equal(cp.asnumpy(out), ref)


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_optimizers_on_cuda_parameters_match_the_cpu_path(kind):
    from shoal import core
    from shoal.core import nn
    from shoal.core import optim

    core.manual_seed(0)
    cpu_model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double()
    gpu_model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double()
    gpu_model.load_state_dict(cpu_model.state_dict())
    gpu_model.to("cuda")
    assert all(K.is_cuda_array(p.array) for p in gpu_model.parameters())
    make = {
        "sgd": lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
        "adam": lambda ps: optim.Adam(ps, lr=0.01, amsgrad=True),
        "adamw": lambda ps: optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    }[kind]
    cpu_opt, gpu_opt = make(cpu_model.parameters()), make(gpu_model.parameters())
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.standard_normal((5, 8))
        for model, opt, dev in ((cpu_model, cpu_opt, "cpu"), (gpu_model, gpu_opt, "cuda")):
            opt.zero_grad()
            (model(core.tensor(x, device=dev)) ** 2).mean().backward()
            opt.step()
    for (name, a), b in zip(cpu_model.state_dict().items(), gpu_model.state_dict().values()):
        np.testing.assert_allclose(cp.asnumpy(b.array), a.array, rtol=1e-10, atol=1e-12,
                                   err_msg=name)
