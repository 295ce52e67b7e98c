"""Autograd semantics: accumulation, retain_graph, hooks, post-accumulate timing, grad modes."""

import sys
import threading

import numpy as np
import pytest

from shoal import core
import shoal.core.nn.functional as F
from shoal.core import AutogradError


def _leaf(*shape, seed=0):
    return core.tensor(np.random.default_rng(seed).standard_normal(shape), requires_grad=True)


def test_gradients_accumulate_across_backward_calls_in_place():
    x = _leaf(3)
    (x * 2).sum().backward()
    first = x.grad
    (x * 3).sum().backward()
    assert x.grad is first  # accumulated into the same tensor, as torch does
    np.testing.assert_allclose(x.grad.numpy(), np.full(3, 5.0))


def test_a_tensor_used_twice_gets_both_contributions():
    x = _leaf(4)
    y = x * x + x.exp() * x
    y.sum().backward()
    xv = x.detach().numpy()
    np.testing.assert_allclose(x.grad.numpy(), 2 * xv + np.exp(xv) * (1 + xv))


def test_leaf_grads_never_alias_each_other_or_the_seed_gradient():
    a, b = _leaf(3), _leaf(3, seed=1)
    seed = core.ones(3)
    (a + b).backward(seed)
    assert not np.shares_memory(a.grad.array, b.grad.array)
    assert not np.shares_memory(a.grad.array, seed.array)
    a.grad.array += 1
    np.testing.assert_array_equal(b.grad.numpy(), np.ones(3))
    np.testing.assert_array_equal(seed.numpy(), np.ones(3))
    c = _leaf(2, 3)
    c.T.sum().backward()  # a transposed, broadcast gradient becomes a dense .grad
    assert c.grad.array.flags.c_contiguous and c.grad.array.flags.writeable


def test_fresh_gradients_are_adopted_without_a_copy():
    w = _leaf(4, 3)
    seen = []
    orig = F.linear

    x = core.ones(2, 3)
    out = orig(x, w)
    # Capture the array the linear backward produces by hooking the leaf before accumulation.
    w.register_hook(lambda g: seen.append(g.array))
    out.sum().backward()
    assert w.grad.array is seen[0]


def test_second_backward_without_retain_graph_raises_and_changes_nothing():
    x = _leaf(3)
    y = (x * 2).sum()
    y.backward()
    before = x.grad.numpy().copy()
    with pytest.raises(AutogradError, match="backward through the graph a second time.*retain_graph=True"):
        y.backward()
    np.testing.assert_array_equal(x.grad.numpy(), before)


def test_retain_graph_allows_a_second_backward():
    x = _leaf(3)
    y = (x.tanh() * 2).sum()
    y.backward(retain_graph=True)
    once = x.grad.numpy().copy()
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * once)


def test_backward_argument_checks():
    x = _leaf(3)
    with pytest.raises(AutogradError, match=r"needs a scalar output, got shape \(3,\)"):
        (x * 2).backward()
    with pytest.raises(AutogradError, match=r"grad has shape \(2,\) but the output has shape \(3,\)"):
        (x * 2).backward(core.ones(2))
    with pytest.raises(AutogradError, match="does not require grad"):
        core.ones(3).sum().backward()
    with pytest.raises(AutogradError, match="only floating point tensors can require gradients"):
        core.tensor([1, 2], requires_grad=True)
    (x * 2).backward(core.tensor([1.0, 0.0, 2.0]))
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 0.0, 4.0])


def test_deep_graph_needs_no_recursion():
    x = _leaf(1)
    y = x
    for _ in range(sys.getrecursionlimit() * 3):
        y = y * 1.0 + 0.0
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [1.0])


def test_register_hook_replaces_and_observes_gradients():
    x = _leaf(3)
    y = x * 2
    seen = []
    y.register_hook(lambda g: seen.append(g.numpy().copy()))
    handle = y.register_hook(lambda g: g * 10)
    y.sum().backward()
    np.testing.assert_allclose(seen[0], np.ones(3))
    np.testing.assert_allclose(x.grad.numpy(), np.full(3, 20.0))
    handle.remove()
    x.grad = None
    y2 = x * 2
    h2 = y2.register_hook(lambda g: g * 10)
    h2.remove()
    y2.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.full(3, 2.0))


def test_leaf_hook_runs_before_accumulation():
    x = _leaf(2)
    x.register_hook(lambda g: g * 0 + 7)
    (x * 3).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [7.0, 7.0])


def test_retain_grad_keeps_non_leaf_gradients():
    x = _leaf(3)
    y = x * 3
    y.retain_grad()
    z = y * y
    z.sum().backward()
    np.testing.assert_allclose(y.grad.numpy(), 2 * y.detach().numpy())
    assert z.grad is None


def test_post_accumulate_hook_fires_once_with_the_finished_gradient():
    w = _leaf(3)
    calls = []
    w.register_post_accumulate_grad_hook(lambda t: calls.append(t.grad.numpy().copy()))
    # w is used by three ops: the hook must wait for all of them.
    loss = (w * 2).sum() + (w * w).sum() + w.exp().sum()
    loss.backward()
    wv = w.detach().numpy()
    assert len(calls) == 1
    np.testing.assert_allclose(calls[0], 2 + 2 * wv + np.exp(wv))


def test_post_accumulate_hooks_fire_as_soon_as_each_leaf_is_done():
    """DDP's overlap: a layer's hook fires before earlier layers' gradients are computed."""
    core.manual_seed(0)
    sizes = [6, 5, 4, 3, 2]
    weights = [core.randn(o, i, requires_grad=True) for i, o in zip(sizes, sizes[1:])]
    biases = [core.zeros(o, requires_grad=True) for o in sizes[1:]]
    events = []
    for layer, (w, b) in enumerate(zip(weights, biases)):
        for name, p in (("w", w), ("b", b)):
            def hook(t, layer=layer, name=name):
                # Snapshot which earlier layers already have gradients at this moment.
                done_before = [i for i, q in enumerate(weights) if q.grad is not None]
                events.append((layer, name, done_before))
            p.register_post_accumulate_grad_hook(hook)
    h = core.randn(8, sizes[0])
    for w, b in zip(weights, biases):
        h = F.linear(h, w, b).tanh()
    h.sum().backward()
    layers = [e[0] for e in events]
    assert layers == sorted(layers, reverse=True), events  # last layer first
    for layer, name, done_before in events:
        assert all(i >= layer for i in done_before), events  # nothing earlier computed yet


def test_post_accumulate_hook_only_on_leaves_and_removable():
    w = _leaf(2)
    with pytest.raises(AutogradError, match="only works on leaf tensors"):
        (w * 2).register_post_accumulate_grad_hook(lambda t: None)
    with pytest.raises(AutogradError, match="does not require grad"):
        core.ones(2).register_post_accumulate_grad_hook(lambda t: None)
    calls = []
    handle = w.register_post_accumulate_grad_hook(lambda t: calls.append(1))
    (w * 2).sum().backward()
    handle.remove()
    (w * 2).sum().backward()
    assert calls == [1]


def test_no_grad_enable_grad_and_thread_locality():
    x = _leaf(2)
    with core.no_grad():
        assert not core.is_grad_enabled()
        y = x * 2
        with core.enable_grad():
            z = x * 2
        other = []
        t = threading.Thread(target=lambda: other.append(core.is_grad_enabled()))
        t.start()
        t.join(5)
    assert core.is_grad_enabled() and other == [True]
    assert not y.requires_grad and y.grad_fn is None
    assert z.requires_grad and z.grad_fn is not None

    @core.no_grad()
    def f(t):
        return t * 3

    assert not f(x).requires_grad and core.is_grad_enabled()


def test_detach_shares_data_and_cuts_the_graph():
    x = _leaf(3)
    y = x * 2
    d = y.detach()
    assert np.shares_memory(d.array, y.array) and not d.requires_grad and d.is_leaf
    (y * d).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * d.numpy())


def test_graph_metadata():
    x = _leaf(2)
    y = (x @ core.ones(2, 2)).relu()
    assert x.is_leaf and not y.is_leaf
    assert y.grad_fn.name() == "ReluBackward"
    assert y.requires_grad and not core.ones(1).requires_grad
    assert "grad_fn=<ReluBackward>" in repr(y)


def test_in_place_updates_need_no_grad_on_leaves():
    w = _leaf(3)
    for op in (lambda: w.add_(1.0), lambda: w.mul_(2.0), lambda: w.zero_(), lambda: w.copy_(core.ones(3))):
        with pytest.raises(AutogradError, match="a leaf Variable that requires grad is being used"):
            op()
    with core.no_grad():
        w.copy_(core.ones(3))
        w.mul_(2.0).add_(core.ones(3), alpha=0.5).sub_(1.0)
        w.addcmul_(core.ones(3), core.ones(3), value=2.0)
        w.addcdiv_(core.ones(3), core.full((3,), 2.0), value=2.0)
    np.testing.assert_allclose(w.detach().numpy(), np.full(3, 4.5))
    assert w.array.dtype == np.float64


def test_autograd_grad_returns_gradients_without_touching_dot_grad():
    x, w = _leaf(3), _leaf(3, seed=1)
    y = (x * w).sum()
    gx, gw = core.autograd.grad(y, [x, w], retain_graph=True)
    np.testing.assert_allclose(gx.numpy(), w.detach().numpy())
    np.testing.assert_allclose(gw.numpy(), x.detach().numpy())
    assert x.grad is None and w.grad is None
    h = x * 2
    (gh,) = core.autograd.grad((h * h).sum(), [h])  # a non-leaf input
    np.testing.assert_allclose(gh.numpy(), 2 * h.detach().numpy())
    unused = _leaf(2)
    with pytest.raises(AutogradError, match="input 1 .* was not used"):
        core.autograd.grad((x * 3).sum(), [x, unused])
    gx2, none = core.autograd.grad((x * 3).sum(), [x, unused], allow_unused=True)
    assert none is None and np.allclose(gx2.numpy(), 3.0)


def test_backward_from_several_roots_at_once():
    x = _leaf(3)
    a = x * 2
    b = a * 3  # b depends on a: a's seed and b's contribution must both land before a runs
    core.autograd.backward([a, b], [core.ones(3).array, core.ones(3).array])
    np.testing.assert_allclose(x.grad.numpy(), np.full(3, 2.0 + 6.0))


def test_grad_mode_helpers_like_torch():
    @core.no_grad
    def bare(t):
        return t * 2

    x = _leaf(2)
    assert not bare(x).requires_grad
    with core.set_grad_enabled(False):
        assert not (x * 2).requires_grad
    assert core.is_grad_enabled()
    core.set_grad_enabled(False)
    try:
        assert not core.is_grad_enabled()
    finally:
        core.set_grad_enabled(True)
    rows = list(core.arange(6).reshape(3, 2))
    assert len(rows) == 3 and rows[2].tolist() == [4, 5]


def test_backward_releases_activations_unless_the_graph_is_retained():
    import gc
    import weakref

    x = _leaf(4, 4)
    h = (x * 2).tanh()
    ref = weakref.ref(h)
    loss = (h * 3).sum()
    del h
    loss.backward(retain_graph=True)
    gc.collect()
    assert ref() is not None  # kept: a second backward may need it
    loss.backward()
    gc.collect()
    assert ref() is None  # freed with the graph, though `loss` is still alive
