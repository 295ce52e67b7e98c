"""Each batching rule against torch.func.vmap on the same data: one function per rule family,
run with the batch in front of one argument and with the other argument batched too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal import core
from shoal.core import func

# (name, fn(lib, F, x, w), x's per-sample shape, w's shape). x is batched; w is batched in the
# second run when `both` holds. F is the library's nn.functional.
RULES = [
    ("var and std-like reductions", lambda L, F, x, w: x.var(1) + (x * w).var(0, keepdim=True).sum(), (3, 4), (3, 4), True),
    ("logsumexp over a tuple", lambda L, F, x, w: L.logsumexp(x + w, (0, 1)), (3, 4), (4,), True),
    ("amax/amin over tuples", lambda L, F, x, w: L.amax(x, (0, 1)) - L.amin(x * w, 1), (3, 4), (4,), True),
    ("argmax with and without dim", lambda L, F, x, w: L.argmax(x + w, 1) + L.argmax(x), (3, 4), (4,), True),
    ("max/min returning indices", lambda L, F, x, w: L.max(x, 0)[1] * 10 + L.min(x - w, 0)[1] + L.max(x, -1, keepdim=True)[0].sum(), (3, 4), (4,), True),
    ("squeeze a dim, expand", lambda L, F, x, w: x.unsqueeze(1).squeeze(1).expand(2, 3, 4) + w, (3, 4), (4,), True),
    ("split and chunk", lambda L, F, x, w: x.split(1, 0)[1] + x.chunk(2, 1)[0].sum() * w[:1], (3, 4), (4,), True),
    ("where, clamp with tensors", lambda L, F, x, w: L.where(x > 0, x, w).clamp(min=-w.abs()), (3, 4), (4,), True),
    ("pow with a batched exponent", lambda L, F, x, w: x.abs() ** w, (3, 4), (4,), True),
    ("indexing with None and Ellipsis", lambda L, F, x, w: x[..., None, 1:3] * w[None, :2], (3, 4), (4,), True),
    ("T, mT, t and permute", lambda L, F, x, w: x.mT @ w[:, None] + x.t().sum() + x.T.sum(), (3, 4), (3,), True),
    ("flatten a range", lambda L, F, x, w: x.reshape(2, 3, 2).flatten(1) * w, (3, 4), (6,), True),
    ("dtype casts", lambda L, F, x, w: (x.double() + w.to(L.float64)).float(), (3, 4), (4,), True),
    ("gelu, sigmoid, softmax dim 0", lambda L, F, x, w: F.gelu(x) + L.sigmoid(w) + x.softmax(0), (3, 4), (4,), True),
    ("mse_loss reductions", lambda L, F, x, w: F.mse_loss(x, w.expand(3, 4)) + F.mse_loss(x, w.expand(3, 4), reduction="sum") + F.mse_loss(x, w.expand(3, 4), reduction="none").mean(), (3, 4), (4,), True),
    ("layer_norm", lambda L, F, x, w: F.layer_norm(x, (4,), w, w * 0.5), (3, 4), (4,), False),
    ("conv2d over one image", lambda L, F, x, w: F.conv2d(x, w, padding=1), (2, 5, 5), (3, 2, 3, 3), False),
    ("conv2d and pools over a mini-batch", lambda L, F, x, w: F.max_pool2d(F.conv2d(x, w), 2) + F.avg_pool2d(F.conv2d(x, w), 2), (2, 2, 6, 6), (3, 2, 3, 3), False),
    ("matmul batched on both sides", lambda L, F, x, w: x @ w + (w.mT @ x.mT).sum(), (3, 4), (4, 2), True),
    ("stack of batched and unbatched", lambda L, F, x, w: L.stack([x, w.expand(3, 4)], -1).sum(0), (3, 4), (4,), True),
    ("cat along the last dim", lambda L, F, x, w: L.cat([x, w.expand(3, 4)], 1), (3, 4), (4,), True),
    ("linear with a batched weight", lambda L, F, x, w: F.linear(x, w, w[:, 0]), (3, 4), (5, 4), True),
]


def _run(lib, fn, in_dims, x, w):
    F = lib.nn.functional
    return (func if lib is core else torch.func).vmap(lambda a, b: fn(lib, F, a, b),
                                                     in_dims=in_dims)(x, w)


@pytest.mark.parametrize("name", [r[0] for r in RULES])
def test_rule_matches_torch(name: str) -> None:
    _, fn, xs, ws, both = next(r for r in RULES if r[0] == name)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, *xs))
    w = rng.standard_normal((5, *ws) if both else ws)
    for in_dims, wv in (((0, None), w[0] if both else w),) + (((0, 0), w),) * both:
        ours = _run(core, fn, in_dims, core.tensor(x), core.tensor(wv))
        theirs = _run(torch, fn, in_dims, torch.tensor(x), torch.tensor(wv))
        assert ours.dtype.name == str(theirs.dtype).removeprefix("torch."), name
        # float64 on both sides, the same formulas: a few ulp (values of order 10)
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-10, atol=1e-10,
                                   err_msg=f"{name} in_dims={in_dims}")


def test_class_losses_per_sample_match_torch() -> None:
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 6, 3))
    target = rng.integers(0, 3, (4, 6))
    target[0, 1] = -100  # an ignored target changes the mean's denominator
    probs = rng.random((4, 6, 3))
    for kwargs in ({}, {"reduction": "sum"}, {"reduction": "none"}, {"label_smoothing": 0.1}):
        ours = func.vmap(lambda a, t: core.nn.functional.cross_entropy(a, t, **kwargs))(
            core.tensor(logits), core.tensor(target))
        theirs = torch.func.vmap(lambda a, t: torch.nn.functional.cross_entropy(a, t, **kwargs))(
            torch.tensor(logits), torch.tensor(target))
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-10, err_msg=str(kwargs))
    ours = func.vmap(core.nn.functional.cross_entropy)(core.tensor(logits), core.tensor(probs))
    theirs = torch.func.vmap(torch.nn.functional.cross_entropy)(torch.tensor(logits),
                                                                torch.tensor(probs))
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-10)
    logp = torch.log_softmax(torch.tensor(logits), -1)
    ours = func.vmap(core.nn.functional.nll_loss)(core.tensor(logp.numpy()), core.tensor(target))
    theirs = torch.func.vmap(torch.nn.functional.nll_loss)(logp, torch.tensor(target))
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-10)


def test_embedding_and_one_hot_take_batched_indices() -> None:
    idx = np.array([[0, 2], [1, 1], [3, 0]])
    table = np.random.default_rng(2).standard_normal((4, 3))
    ours = func.vmap(lambda i: core.nn.functional.embedding(i, core.tensor(table)))(core.tensor(idx))
    theirs = torch.func.vmap(lambda i: torch.nn.functional.embedding(i, torch.tensor(table)))(
        torch.tensor(idx))
    np.testing.assert_allclose(ours.numpy(), theirs.numpy())
    hot = func.vmap(lambda i: core.nn.functional.one_hot(i, 4))(core.tensor(idx))
    np.testing.assert_array_equal(hot.numpy(), np.eye(4, dtype=np.int64)[idx])


EVERYDAY = [
    ("cumsum, cumprod, logcumsumexp", lambda L, x, w: L.cumsum(x, 1) + L.cumprod(x * 0.5, 0) + L.logcumsumexp(x + w, -1)),
    ("cummax and cummin indices", lambda L, x, w: L.cummax(x, 0)[0] + L.cummin(x, 1)[1]),
    ("sort, argsort, topk", lambda L, x, w: L.sort(x + w, 1)[0] + L.argsort(x, 0) + L.topk(x, 2, dim=0)[0].sum()),
    ("std, var, nansum, nanmean", lambda L, x, w: L.std(x, 1) + L.var(x, 0).sum() + L.nansum(x) + L.nanmean(x, 1)),
    ("einsum explicit and implicit", lambda L, x, w: L.einsum("ij,j->i", x, w) + L.einsum("ij,ij", x, x)),
    ("einsum with an ellipsis", lambda L, x, w: L.einsum("...j,j->...", x, w)),
    ("tril, triu, diagonal, trace", lambda L, x, w: L.tril(x).sum(0) + L.triu(x, 1).sum(0) + L.diagonal(x, 1)[:1] + L.trace(x[:, :3])),
    ("dot, vdot, outer", lambda L, x, w: L.outer(x[0], w) + L.dot(x[1], w) + L.vdot(w, w)),
    ("gather by a batched index", lambda L, x, w: L.gather(x, 1, (w.abs() * 3).long().clamp(max=3)[None, :].expand(3, 4))),
    ("flip, roll, movedim, swapaxes", lambda L, x, w: L.flip(x, (0,)) + L.roll(x, 1, 1) + L.roll(x, 2) + L.movedim(x[None], 0, 2).sum(-1) + L.swapaxes(x.reshape(4, 3), 0, 1)),
]


@pytest.mark.parametrize("name", [r[0] for r in EVERYDAY])
def test_everyday_rule_matches_torch(name: str) -> None:
    fn = next(r[1] for r in EVERYDAY if r[0] == name)
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((5, 3, 4)), rng.standard_normal((5, 4))
    ours = func.vmap(lambda a, b: fn(core, a, b))(core.tensor(x), core.tensor(w))
    theirs = torch.func.vmap(lambda a, b: fn(torch, a, b))(torch.tensor(x), torch.tensor(w))
    assert ours.dtype.name == str(theirs.dtype).removeprefix("torch."), name
    # float64, the same formulas; cumprod and logcumsumexp of values of order 1: a few ulp
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-10, atol=1e-10, err_msg=name)


def test_batch_norm_in_eval_mode_and_refused_in_training() -> None:
    rng = np.random.default_rng(4)
    mean, var = rng.standard_normal(3), rng.random(3) + 0.5
    ours, theirs = core.nn.BatchNorm2d(3).double(), torch.nn.BatchNorm2d(3).double()
    with torch.no_grad():
        theirs.running_mean.copy_(torch.tensor(mean))
        theirs.running_var.copy_(torch.tensor(var))
    ours.running_mean.array[...] = mean
    ours.running_var.array[...] = var
    ours.eval()
    theirs.eval()
    x = rng.standard_normal((4, 2, 3, 5, 5))
    np.testing.assert_allclose(func.vmap(ours)(core.tensor(x)).detach().numpy(),
                               torch.func.vmap(theirs)(torch.tensor(x)).detach().numpy(),
                               rtol=1e-12, atol=1e-12)
    ours.train()
    with pytest.raises(NotImplementedError, match="batch_norm in training mode"):
        func.vmap(ours)(core.tensor(x))
