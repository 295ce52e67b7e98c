"""grad, grad_and_value, vjp, jvp, jacrev, jacfwd, hessian and functional_call against torch.func
and finite differences, alone and composed (per-sample gradients, Jacobians under vmap)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal import core
from shoal.core import func, nn
import shoal.core.nn.functional as F

# torch.func's first transform call sets itself up (about a second); done at import so that the
# first test's time is its own.
torch.func.grad(torch.sin)(torch.tensor(0.0))
torch.func.jvp(torch.sin, (torch.tensor(0.0),), (torch.tensor(1.0),))


def _pair(*shape: int, seed: int = 0) -> tuple:
    arr = np.random.default_rng(seed).standard_normal(shape)  # float64: exact comparisons
    return core.tensor(arr), torch.tensor(arr)


def _close(ours, theirs, tol: float = 1e-10) -> None:
    # float64 throughout: the same formulas in another summation order agree to ~1e-15 relative;
    # 1e-10 leaves room for the Jacobians' longer chains on values of order 10.
    if isinstance(theirs, (tuple, list)):
        assert len(ours) == len(theirs)
        for o, t in zip(ours, theirs):
            _close(o, t, tol)
        return
    if isinstance(theirs, dict):
        for k in theirs:
            _close(ours[k], theirs[k], tol)
        return
    assert tuple(ours.shape) == tuple(theirs.shape)
    np.testing.assert_allclose(ours.detach().numpy(), theirs.detach().numpy(), rtol=tol,
                               atol=tol)


def f_ours(x, y):
    return (core.tanh(x) * y).sum() + (x * x).mean()


def f_torch(x, y):
    return (torch.tanh(x) * y).sum() + (x * x).mean()


def vec_ours(x):
    return core.sin(x) * x.sum() + core.exp(x[:1])


def vec_torch(x):
    return torch.sin(x) * x.sum() + torch.exp(x[:1])


def test_grad_and_grad_and_value_with_argnums() -> None:
    (x, tx), (y, ty) = _pair(3, 2), _pair(3, 2, seed=1)
    _close(func.grad(f_ours)(x, y), torch.func.grad(f_torch)(tx, ty))
    _close(func.grad(f_ours, argnums=(0, 1))(x, y),
           torch.func.grad(f_torch, argnums=(0, 1))(tx, ty))
    g, v = func.grad_and_value(f_ours, argnums=1)(x, y)
    tg, tv = torch.func.grad_and_value(f_torch, argnums=1)(tx, ty)
    _close(g, tg)
    _close(v, tv)
    assert not v.requires_grad


def test_grad_with_aux_returns_the_aux_unchanged() -> None:
    x, tx = _pair(4)
    g, aux = func.grad(lambda a: ((a * a).sum(), a.mean()), has_aux=True)(x)
    tg, taux = torch.func.grad(lambda a: ((a * a).sum(), a.mean()), has_aux=True)(tx)
    _close(g, tg)
    _close(aux, taux)


def test_grad_refuses_what_torch_refuses() -> None:
    with pytest.raises(RuntimeError, match="scalar Tensor"):
        func.grad(lambda a: a * 2)(core.ones(3))
    with pytest.raises(RuntimeError, match="argnums must be int or Tuple"):
        func.grad(f_ours, argnums=[0])(core.ones(3), core.ones(3))
    with pytest.raises(RuntimeError, match="output of function f should be a tuple"):
        func.grad(lambda a: a.sum(), has_aux=True)(core.ones(3))


def test_grad_of_grad_is_the_second_derivative() -> None:
    x, tx = _pair(5)
    d2 = func.grad(lambda a: func.grad(lambda b: (b ** 3).sum())(a).sum())(x)
    _close(d2, 6 * tx)


def test_vjp_and_the_release_example_jacobian() -> None:
    """functorch's release example: the Jacobian of sin is vmap(vjp_fn)(unit vectors)."""
    x, tx = _pair(5)
    out, vjp_fn = func.vjp(core.sin, x)
    (jac,) = func.vmap(vjp_fn)(core.eye(5, dtype=core.float64))
    _, tvjp_fn = torch.func.vjp(torch.sin, tx)
    (tjac,) = torch.func.vmap(tvjp_fn)(torch.eye(5, dtype=torch.float64))
    _close(out, torch.sin(tx))
    _close(jac, tjac)
    _close(jac, torch.diag(torch.cos(tx)))


def test_jvp_matches_torch_forward_mode() -> None:
    x, tx = _pair(4)
    t, tt = _pair(4, seed=5)
    out, jv = func.jvp(vec_ours, (x,), (t,))
    tout, tjv = torch.func.jvp(vec_torch, (tx,), (tt,))
    _close(out, tout)
    _close(jv, tjv)
    with pytest.raises(RuntimeError, match="Expected primals to be a tuple"):
        func.jvp(vec_ours, x, (t,))


@pytest.mark.parametrize("transform", ["jacrev", "jacfwd"])
def test_jacobians_match_torch(transform: str) -> None:
    x, tx = _pair(4)
    ours = getattr(func, transform)(vec_ours)(x)
    theirs = getattr(torch.func, transform)(vec_torch)(tx)
    _close(ours, theirs)
    (y, ty) = _pair(4, 3, seed=2)
    _close(getattr(func, transform)(f_ours, argnums=(0, 1))(y, y * 2),
           getattr(torch.func, transform)(f_torch, argnums=(0, 1))(ty, ty * 2))


def test_hessian_matches_torch_and_finite_differences() -> None:
    x, tx = _pair(3)

    def g_ours(a):
        return (core.tanh(a) * a.sum()).sum()

    def g_torch(a):
        return (torch.tanh(a) * a.sum()).sum()

    h = func.hessian(g_ours)(x)
    _close(h, torch.func.hessian(g_torch)(tx))
    eps = 1e-5  # central differences of the gradient: error ~eps**2 * |f'''| ~ 1e-10
    fd = np.stack([(func.grad(g_ours)(x + e).numpy() - func.grad(g_ours)(x - e).numpy())
                   / (2 * eps) for e in (core.eye(3, dtype=core.float64) * eps)])
    np.testing.assert_allclose(h.numpy(), fd, atol=1e-7)


def test_batched_jacobians_under_vmap() -> None:
    x, tx = _pair(6, 4)
    _close(func.vmap(func.jacrev(vec_ours))(x), torch.func.vmap(torch.func.jacrev(vec_torch))(tx))
    _close(func.vmap(func.jacfwd(vec_ours))(x), torch.func.vmap(torch.func.jacfwd(vec_torch))(tx))


def _models() -> tuple:
    core.manual_seed(0)
    ours = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    theirs = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(),
                                 torch.nn.Linear(7, 3)).double()
    with torch.no_grad():
        for (_, p), (_, tp) in zip(ours.named_parameters(), theirs.named_parameters()):
            tp.copy_(torch.tensor(p.detach().numpy()))
    return ours, theirs


def test_per_sample_gradients_equal_the_loop_and_torch_func() -> None:
    model, tmodel = _models()
    params = {k: v.detach() for k, v in model.named_parameters()}
    tparams = {k: v.detach() for k, v in tmodel.named_parameters()}
    x, tx = _pair(8, 5, seed=3)
    y = core.tensor(np.arange(8) % 3)
    ty = torch.tensor(np.arange(8) % 3)

    def loss(p, xi, yi):
        return F.cross_entropy(func.functional_call(model, p, (xi[None],)), yi[None])

    def tloss(p, xi, yi):
        return torch.nn.functional.cross_entropy(
            torch.func.functional_call(tmodel, p, (xi[None],)), yi[None])

    ours = func.vmap(func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    theirs = torch.func.vmap(torch.func.grad(tloss), in_dims=(None, 0, 0))(tparams, tx, ty)
    _close(ours, theirs)
    for i in range(8):
        model.zero_grad()
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        for k, p in model.named_parameters():
            np.testing.assert_allclose(ours[k].numpy()[i], p.grad.numpy(), rtol=1e-10,
                                       atol=1e-12)


def test_per_sample_mse_gradients_with_a_minibatch_per_sample() -> None:
    model, tmodel = _models()
    params = dict(model.named_parameters())
    tparams = dict(tmodel.named_parameters())
    x, tx = _pair(4, 2, 5, seed=6)
    t, tt = _pair(4, 2, 3, seed=7)

    def loss(p, xi, ti):
        return F.mse_loss(func.functional_call(model, p, xi), ti)

    def tloss(p, xi, ti):
        return torch.nn.functional.mse_loss(torch.func.functional_call(tmodel, p, xi), ti)

    _close(func.vmap(func.grad(loss), in_dims=(None, 0, 0))(params, x, t),
           torch.func.vmap(torch.func.grad(tloss), in_dims=(None, 0, 0))(tparams, tx, tt))


def test_functional_call_leaves_the_module_as_it_was() -> None:
    model, tmodel = _models()
    before = {k: v for k, v in model.named_parameters()}
    x, tx = _pair(2, 5)
    zeros = {k: core.zeros_like(v) for k, v in before.items()}
    tzeros = {k: torch.zeros_like(v) for k, v in tmodel.named_parameters()}
    _close(func.functional_call(model, zeros, (x,)), torch.func.functional_call(tmodel, tzeros,
                                                                                (tx,)))
    assert all(p is before[k] for k, p in model.named_parameters())
    with pytest.raises(RuntimeError, match="Missing key"):
        func.functional_call(model, {"0.weight": zeros["0.weight"]}, (x,), strict=True)
    with pytest.raises(ValueError, match="multiple dictionaries"):
        func.functional_call(model, ({"0.bias": zeros["0.bias"]}, {"0.bias": zeros["0.bias"]}),
                             (x,))


def test_vmap_over_models_ensembles_with_stacked_parameters() -> None:
    model, _ = _models()
    stacked = {k: core.stack([v.detach() * (i + 1) for i in range(3)])
               for k, v in model.named_parameters()}
    x, _ = _pair(2, 5)
    out = func.vmap(lambda p: func.functional_call(model, p, (x,)))(stacked)
    for i in range(3):
        single = {k: v[i] for k, v in stacked.items()}
        np.testing.assert_allclose(out[i].detach().numpy(),
                                   func.functional_call(model, single, (x,)).detach().numpy(),
                                   rtol=1e-12)


def test_batched_maml_meta_gradient_matches_torch() -> None:
    """grad of a vmap of an inner SGD step taken with grad: MAML over four tasks at once."""
    model, tmodel = _models()
    params = {k: v.detach() for k, v in model.named_parameters()}
    tparams = {k: v.detach() for k, v in tmodel.named_parameters()}
    rng = np.random.default_rng(9)
    data = [rng.standard_normal((4, 6, 5)), rng.standard_normal((4, 6, 3)),
            rng.standard_normal((4, 6, 5)), rng.standard_normal((4, 6, 3))]

    def meta_grad(lib, funcs, mod):
        mse = lib.nn.functional.mse_loss

        def inner(p, x, y):
            return mse(funcs.functional_call(mod, p, (x,)), y)

        def task(p, xs, ys, xq, yq):
            g = funcs.grad(inner)(p, xs, ys)
            return inner({k: p[k] - 0.1 * g[k] for k in p}, xq, yq)

        return funcs.grad(lambda p, *d: funcs.vmap(task, in_dims=(None, 0, 0, 0, 0))(p, *d)
                          .mean())

    ours = meta_grad(core, func, model)(params, *map(core.tensor, data))
    theirs = meta_grad(torch, torch.func, tmodel)(tparams, *map(torch.tensor, data))
    _close(ours, theirs)


def test_stack_module_state_runs_an_ensemble_under_vmap() -> None:
    models = [_models()[0] for _ in range(3)]
    for i, m in enumerate(models):
        for p in m.parameters():
            p.data = p.data * (i + 1)
    params, buffers = func.stack_module_state(models)
    assert params["0.weight"].shape == (3, 7, 5) and params["0.weight"].requires_grad
    x, _ = _pair(2, 5)
    out = func.vmap(lambda p, b: func.functional_call(models[0], (p, b), (x,)))(params, buffers)
    for i, m in enumerate(models):
        np.testing.assert_allclose(out[i].detach().numpy(), m(x).detach().numpy(), rtol=1e-12)
    with pytest.raises(RuntimeError, match="at least one model"):
        func.stack_module_state([])


@pytest.mark.parametrize("transform", ["jacrev", "jacfwd"])
def test_jacobians_of_several_outputs_and_inputs(transform: str) -> None:
    x, tx = _pair(3)
    y, ty = _pair(2, seed=4)

    def f(lib):
        return lambda a, b: (lib.sin(a) * b.sum(), (a[:2] * b).sum())

    ours = getattr(func, transform)(f(core), argnums=(0, 1))(x, y)
    theirs = getattr(torch.func, transform)(f(torch), argnums=(0, 1))(tx, ty)
    _close(ours, theirs)
