"""autograd.grad(create_graph=True) against torch: gradient penalties, Hessian-vector products,
MAML's inner step, every op with a double-backward formula, and the refusal for the others."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from shoal import core
import shoal.core.nn.functional as F

# float64: both sides compute the same sums in a different order, so a few ulps apart.
TOL = dict(rtol=1e-10, atol=1e-12)


@pytest.fixture(autouse=True, scope="module")
def _torch_double_backward_loaded():
    """torch's first double backward in a process loads code lazily (about a second): pay it
    once here rather than inside whichever test runs first."""
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    y = (torch.tanh(torch.ones(2, 2, dtype=torch.float64) @ x) ** 3).sum() + (x.exp() * x).sum()
    (g,) = torch.autograd.grad(y, x, create_graph=True)
    torch.autograd.grad(g, x, grad_outputs=torch.ones_like(g))


def _data(*shape, seed=0, positive=False):
    d = np.random.default_rng(seed).standard_normal(shape)
    return np.abs(d) + 0.5 if positive else d


def _both(d, grad=True):
    return core.tensor(d, requires_grad=grad), torch.tensor(d, requires_grad=grad)


def _close(a, b):
    np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), **TOL)


def _mlp_params(seed=0):
    shapes = [(8, 5), (8,), (3, 8), (3,)]
    return [_both(_data(*s, seed=seed + i)) for i, s in enumerate(shapes)]


def _mlp(lib_f, act, x, w1, b1, w2, b2):
    return lib_f.linear(act(lib_f.linear(x, w1, b1)), w2, b2)


@pytest.mark.parametrize("act", ["tanh", "sigmoid", "relu"])
def test_gradient_penalty_of_a_small_mlp_matches_torch(act):
    params = _mlp_params()
    x, tx = _both(_data(6, 5, seed=9))
    y, ty = _mlp(F, getattr(core, act), x, *[p[0] for p in params]), \
        _mlp(TF, getattr(torch, act), tx, *[p[1] for p in params])
    loss, tloss = (y * y).mean(), (ty * ty).mean()
    (gx,) = core.autograd.grad(loss, x, create_graph=True)
    (tgx,) = torch.autograd.grad(tloss, tx, create_graph=True)
    _close(gx, tgx)
    penalty = (gx.norm(2, dim=1) - 1) ** 2
    tpenalty = (tgx.norm(2, dim=1) - 1) ** 2
    penalty.mean().backward()
    tpenalty.mean().backward()
    for p, tp in params:
        _close(p.grad, tp.grad)
    _close(x.grad, tx.grad)


def test_hessian_vector_product_matches_torch():
    x, tx = _both(_data(4, seed=1))
    a, ta = _both(_data(4, 4, seed=2), grad=False)
    v, tv = _both(_data(4, seed=3), grad=False)

    def f(lib, x, a):
        return (lib.tanh(a @ x) ** 3).sum() + (x.exp() * x).sum() / 3

    (g,) = core.autograd.grad(f(core, x, a), x, create_graph=True)
    (tg,) = torch.autograd.grad(f(torch, tx, ta), tx, create_graph=True)
    (hv,) = core.autograd.grad(g, x, grad_outputs=v, retain_graph=True)
    (thv,) = torch.autograd.grad(tg, tx, grad_outputs=tv, retain_graph=True)
    _close(hv, thv)
    # The same through (g * v).sum() and backward(), into .grad.
    (g * v).sum().backward()
    (tg * tv).sum().backward()
    _close(x.grad, tx.grad)


def test_maml_inner_step_matches_torch():
    params = _mlp_params(seed=4)
    x, tx = _both(_data(5, 5, seed=11), grad=False)
    t, tt = _both(_data(5, 3, seed=12), grad=False)
    ps, tps = [p[0] for p in params], [p[1] for p in params]
    loss = F.mse_loss(_mlp(F, core.tanh, x, *ps), t)
    tloss = TF.mse_loss(_mlp(TF, torch.tanh, tx, *tps), tt)
    grads = core.autograd.grad(loss, ps, create_graph=True)
    tgrads = torch.autograd.grad(tloss, tps, create_graph=True)
    fast = [p - 0.1 * g for p, g in zip(ps, grads)]
    tfast = [p - 0.1 * g for p, g in zip(tps, tgrads)]
    F.mse_loss(_mlp(F, core.tanh, x, *fast), t).backward()
    TF.mse_loss(_mlp(TF, torch.tanh, tx, *tfast), tt).backward()
    for p, tp in params:
        _close(p.grad, tp.grad)


def _ops(lib):
    """Expressions of x (positive entries) and y that reach each op with a formula."""
    return {
        "add_sub_neg_broadcast": lambda x, y: (x + y[0] - (-x) * 2 - 1.5 + x.sum(0)).sum(),
        "mul_div": lambda x, y: (x * y / (y + 3) * 2 / x.sum()).sum(),
        "pow_scalar": lambda x, y: (x ** 3 + x ** 0.5 + x ** 0).sum(),
        "pow_tensor": lambda x, y: (x ** y + 2 ** y).sum(),
        "exp_log_sqrt": lambda x, y: (x.exp() * x.log() + x.sqrt() * y).sum(),
        "tanh_sigmoid_relu": lambda x, y: (lib.tanh(x * y) * lib.sigmoid(y) * lib.relu(y)).sum(),
        "matmul_shapes": lambda x, y: ((x @ y.T) ** 2).sum() + ((x[0] @ y.T) ** 2).sum()
        + ((x[0] @ y[0]) ** 2),
        "sum_mean_dims": lambda x, y: (x.sum(1) ** 2).sum() + (x.mean(0, keepdim=True) * y).sum()
        + x.mean() ** 2,
        "reshape_transpose_permute_expand": lambda x, y: (
            (x.reshape(-1) ** 2).sum() + (x.transpose(0, 1) @ y).sum() ** 2
            + (x.permute(1, 0) ** 3).sum() + (x[:1].expand(3, 4) * y).sum() ** 2),
        "softmax_log_softmax_clone_to": lambda x, y: (
            (lib.softmax(x * y, -1) * y).sum() + (lib.log_softmax(x.clone() * y, 0) ** 2).sum()
            + (x.to(lib.float32).to(lib.float64) ** 2).sum()),
    }


@pytest.mark.parametrize("name", list(_ops(core)))
def test_each_op_with_a_formula_gives_torch_second_derivatives(name):
    x, tx = _both(_data(3, 4, seed=5, positive=True))
    y, ty = _both(_data(3, 4, seed=6))
    out, tout = _ops(core)[name](x, y), _ops(torch)[name](tx, ty)
    grads = core.autograd.grad(out, [x, y], create_graph=True, allow_unused=True)
    tgrads = torch.autograd.grad(tout, [tx, ty], create_graph=True, allow_unused=True)
    _close_all(grads, tgrads)
    # Second order: a weighted sum of the gradients, differentiated again.
    w = _data(3, 4, seed=7)
    s = sum((g * core.tensor(w) * (i + 1)).sum() for i, g in enumerate(grads) if g is not None)
    ts = sum((g * torch.tensor(w) * (i + 1)).sum() for i, g in enumerate(tgrads) if g is not None)
    assert s.requires_grad == ts.requires_grad  # no graph where the gradients are constants
    if ts.requires_grad:
        _close_all(core.autograd.grad(s, [x, y], allow_unused=True),
                   torch.autograd.grad(ts, [tx, ty], allow_unused=True))


def _close_all(grads, tgrads):
    for a, b in zip(grads, tgrads):
        assert (a is None) == (b is None)
        if a is not None:
            _close(a, b)


def test_a_function_whose_backward_is_written_in_core_ops_is_differentiable_twice():
    def make(lib):
        class Cube(lib.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x ** 3

            @staticmethod
            def backward(ctx, g):
                (x,) = ctx.saved_tensors
                return 3 * g * x * x

        return Cube

    x, tx = _both(_data(4, seed=8))
    (g,) = core.autograd.grad(make(core).apply(x).sum(), x, create_graph=True)
    (tg,) = torch.autograd.grad(make(torch).apply(tx).sum(), tx, create_graph=True)
    _close(g, tg)
    (g * g).sum().backward()
    (tg * tg).sum().backward()
    _close(x.grad, tx.grad)


def test_backward_with_create_graph_leaves_differentiable_grads():
    x, tx = _both(_data(3, seed=10))
    core.autograd.backward((x ** 3).sum(), create_graph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's note on the grad-param cycle
        (tx ** 3).sum().backward(create_graph=True)
    assert x.grad.requires_grad and tx.grad.requires_grad
    _close(x.grad, tx.grad)
    (gg,) = core.autograd.grad(x.grad.sum(), x)
    (tgg,) = torch.autograd.grad(tx.grad.sum(), tx)
    _close(gg, tgg)


def test_create_graph_through_an_op_without_a_formula_raises_naming_it():
    x = core.ones(2, 3, requires_grad=True)
    with pytest.raises(NotImplementedError,
                       match="double backward through CrossEntropyBackward is not supported yet"):
        core.autograd.grad(F.cross_entropy(x, core.tensor([0, 2])), x, create_graph=True)


def test_first_order_grad_is_unchanged_and_refuses_inputs_without_grad_as_torch():
    x, tx = _both(_data(3, seed=2))
    (g,) = core.autograd.grad((x * x).sum(), x)
    (tg,) = torch.autograd.grad((tx * tx).sum(), tx)
    assert g.grad_fn is None and tg.grad_fn is None
    _close(g, tg)
    for lib in (core, torch):
        with pytest.raises(RuntimeError, match="One of the differentiated Tensors does not "
                                               "require grad"):
            lib.autograd.grad((lib.ones(2, requires_grad=True) * 2).sum(), [lib.ones(2)])
        with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar "
                                               "outputs"):
            lib.autograd.grad(lib.ones(2, requires_grad=True) * 2,
                              [lib.ones(2, requires_grad=True)], create_graph=True)


def test_tensor_backward_with_create_graph_accumulates_a_differentiable_grad_as_torch():
    """x.grad from backward(create_graph=True) has a graph; backward through it accumulates the
    second derivative into x.grad (3x^2 + 6x), as torch does. Exact: small integers and halves."""
    x = core.tensor([1.5, -2.0], requires_grad=True)
    (x * x * x).sum().backward(create_graph=True)
    assert x.grad.requires_grad
    x.grad.sum().backward()
    tx = torch.tensor([1.5, -2.0], requires_grad=True)
    (tx * tx * tx).sum().backward(create_graph=True)
    tx.grad.sum().backward()
    assert x.grad.detach().numpy().tolist() == tx.grad.detach().numpy().tolist() == [15.75, 0.0]
