"""Test helpers: compare autograd gradients with central finite differences, and ops with torch."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from shoal import core


def _project(out: Any, weights: np.ndarray) -> float:
    data = out.array if isinstance(out, core.Tensor) else out
    return float(np.sum(np.asarray(data, dtype=np.float64) * weights))


def gradcheck(
    fn: Callable[..., core.Tensor],
    *arrays: Any,
    wrt: Sequence[int] | None = None,
    eps: float = 1e-6,
    atol: float = 1e-6,
    rtol: float = 1e-5,
    seed: int = 0,
) -> None:
    """Check fn's gradients w.r.t. the float64 arrays `wrt` (default: all float arrays).

    The output is projected onto fixed random weights so that one backward checks the whole
    Jacobian-vector product; each input element is then perturbed by +-eps.
    """
    arrays = [np.array(a, dtype=np.float64) if _is_float(a) else a for a in arrays]
    if wrt is None:
        wrt = [i for i, a in enumerate(arrays) if _is_float(a)]
    tensors = [
        core.tensor(a, requires_grad=i in wrt) if isinstance(a, np.ndarray) else a
        for i, a in enumerate(arrays)
    ]
    out = fn(*tensors)
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal(out.shape)
    (out * core.tensor(weights)).sum().backward()
    with core.no_grad():
        for i in wrt:
            t = tensors[i]
            assert t.grad is not None, f"input {i} received no gradient"
            analytic = t.grad.numpy()
            assert analytic.shape == t.shape, f"grad shape {analytic.shape} != {t.shape}"
            numeric = np.zeros_like(analytic)
            flat = t.array.reshape(-1)  # a view: perturbing it perturbs the input
            for j in range(flat.size):
                orig = flat[j]
                flat[j] = orig + eps
                up = _project(fn(*tensors), weights)
                flat[j] = orig - eps
                down = _project(fn(*tensors), weights)
                flat[j] = orig
                numeric.reshape(-1)[j] = (up - down) / (2 * eps)
            np.testing.assert_allclose(
                analytic, numeric, atol=atol, rtol=rtol,
                err_msg=f"gradient of input {i} (shape {t.shape}) differs from finite differences",
            )


def _is_float(a: Any) -> bool:
    return isinstance(a, (np.ndarray, list, float)) and np.asarray(a).dtype.kind == "f"


def compare_with_torch(
    core_fn: Callable[..., Any],
    torch_fn: Callable[..., Any],
    *arrays: np.ndarray,
    wrt: Sequence[int] | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    seed: int = 1,
) -> None:
    """Run the same function in shoal and torch; compare outputs and input gradients."""
    import torch  # only called from tests that importorskip torch

    if wrt is None:
        wrt = [i for i, a in enumerate(arrays) if np.asarray(a).dtype.kind == "f"]
    cs = [core.tensor(a, requires_grad=i in wrt) for i, a in enumerate(arrays)]
    ts = [
        torch.tensor(np.asarray(a), requires_grad=i in wrt) for i, a in enumerate(arrays)
    ]
    c_out, t_out = core_fn(*cs), torch_fn(*ts)
    np.testing.assert_allclose(
        c_out.numpy(force=True), t_out.detach().numpy(), atol=atol, rtol=rtol,
        err_msg="forward values differ from torch",
    )
    if not wrt:
        return
    weights = np.random.default_rng(seed).standard_normal(c_out.shape).astype(
        np.asarray(c_out.array).dtype
    )
    (c_out * core.tensor(weights)).sum().backward()
    (t_out * torch.tensor(weights)).sum().backward()
    for i in wrt:
        np.testing.assert_allclose(
            cs[i].grad.numpy(), ts[i].grad.numpy(), atol=atol, rtol=rtol,
            err_msg=f"gradient of input {i} differs from torch",
        )


def load_torch_weights(ours: Any, theirs: Any) -> None:
    """Copy the torch module `theirs`'s state into the shoal module `ours`."""
    ours.load_state_dict({k: core.tensor(v.detach().numpy()) for k, v in
                          theirs.state_dict().items()})


def compare_module_with_torch(ours: Any, theirs: Any, x: np.ndarray, *, atol: float,
                              seed: int = 0, **kwargs: Any) -> None:
    """Call the shoal module `ours` and the torch module `theirs` (same weights) on `x` (and
    `kwargs`); compare the outputs, then, after one random cotangent (from `seed`) through
    both, the gradients of the input and of every parameter."""
    import torch  # only called from tests that importorskip torch

    t_in, c_in = torch.tensor(x, requires_grad=True), core.tensor(x, requires_grad=True)
    t_out, c_out = theirs(t_in, **kwargs), ours(c_in, **kwargs)
    np.testing.assert_allclose(c_out.detach().numpy(), t_out.detach().numpy(), atol=atol)
    g = np.random.default_rng(seed).standard_normal(tuple(t_out.shape))
    t_out.backward(torch.tensor(g))
    c_out.backward(core.tensor(g))
    np.testing.assert_allclose(c_in.grad.numpy(), t_in.grad.numpy(), atol=atol)
    mine = dict(ours.named_parameters())
    for name, p in theirs.named_parameters():
        np.testing.assert_allclose(mine[name].grad.numpy(), p.grad.numpy(), atol=atol,
                                   err_msg=f"gradient of {name}")


def fast_settings() -> Any:
    """Hypothesis settings for these cheap property tests: few examples, no deadline."""
    from hypothesis import HealthCheck, settings

    return settings(
        max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
