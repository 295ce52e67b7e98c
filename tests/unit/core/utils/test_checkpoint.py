"""core.utils.checkpoint against no checkpointing (bitwise), and the bytes the graph holds with
and without it (torch's semantics: test_checkpoint_torch.py)."""

import tracemalloc

import numpy as np
import pytest

from shoal import core
from shoal.core import nn
from shoal.core.utils.checkpoint import CheckpointError, checkpoint, checkpoint_sequential

VARIANTS = [False, True]  # use_reentrant


def _mlp(width=16, depth=4, p=0.25):
    core.manual_seed(0)
    layers = [nn.Linear(8, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Dropout(p), nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, 3))
    return nn.Sequential(*layers)


def _grads(net, x, run):
    """Gradients of every parameter and of x after one backward from run(net, x)."""
    for p in net.parameters():
        p.grad = None
    x.grad = None
    core.manual_seed(7)  # the dropout masks: the same stream for every run
    out = run(net, x)
    (out * out).sum().backward()
    return [p.grad.array.copy() for p in net.parameters()] + [x.grad.array.copy()]


def _assert_bitwise(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and u.shape == v.shape
        assert np.array_equal(u, v), np.abs(u - v).max()


def _whole(net, x):
    return net(x)


@pytest.mark.parametrize("reentrant", VARIANTS)
def test_gradients_equal_no_checkpointing_bit_for_bit_with_dropout(reentrant):
    net = _mlp()
    x = core.randn(5, 8, requires_grad=True)
    plain = _grads(net, x, _whole)
    blocks = list(net.children())

    def per_layer(net, x):
        for layer in blocks:
            x = checkpoint(layer, x, use_reentrant=reentrant)
        return x

    _assert_bitwise(plain, _grads(net, x, per_layer))
    for segments in (1, 2, 3, len(blocks)):
        seq = _grads(net, x, lambda n, x: checkpoint_sequential(n, segments, x,
                                                                use_reentrant=reentrant))
        _assert_bitwise(plain, seq)


@pytest.mark.parametrize("reentrant", VARIANTS)
def test_without_preserved_rng_the_dropout_masks_differ(reentrant):
    # The control for the test above: it could not pass by dropout not mattering.
    net = _mlp(p=0.5)
    x = core.randn(5, 8, requires_grad=True)
    plain = _grads(net, x, _whole)
    loose = _grads(net, x, lambda n, x: checkpoint(n, x, use_reentrant=reentrant,
                                                   preserve_rng_state=False))
    assert not all(np.array_equal(u, v) for u, v in zip(plain, loose))


@pytest.mark.parametrize("reentrant", VARIANTS)
def test_backward_leaves_the_global_random_stream_where_forward_left_it(reentrant):
    net = _mlp()
    x = core.randn(5, 8, requires_grad=True)
    _grads(net, x, _whole)
    after_plain = core.rand(4).array
    _grads(net, x, lambda n, x: checkpoint(n, x, use_reentrant=reentrant))
    assert np.array_equal(after_plain, core.rand(4).array)


def test_a_residual_block_with_layer_norm_and_tuple_outputs_is_bitwise():
    core.manual_seed(1)
    norm, lin = nn.LayerNorm(8), nn.Linear(8, 8)

    def block(h, scale=1.0):
        y = h + lin(norm(h)).gelu() * scale
        return y, y.sum(dim=-1), "not a tensor"

    def run(ck):
        for p in (*norm.parameters(), *lin.parameters()):
            p.grad = None
        x = core.tensor(np.linspace(-1, 1, 24, dtype=np.float32).reshape(3, 8),
                        requires_grad=True)
        h = x * 2.0  # a non-leaf argument
        y, s, tag = checkpoint(block, h, scale=0.5) if ck else block(h, scale=0.5)
        assert tag == "not a tensor"
        (y.pow(2).sum() + s.sum()).backward()
        return [p.grad.array.copy() for p in (*norm.parameters(), *lin.parameters(), x)]

    _assert_bitwise(run(False), run(True))


def test_a_tensor_read_from_the_closure_gets_its_gradient_through_the_outer_graph():
    core.manual_seed(2)
    w = core.randn(4, 4, requires_grad=True)
    x = core.randn(3, 4, requires_grad=True)

    def run(ck):
        w.grad = x.grad = None
        scaled = w * 3.0  # recorded before the segment, read by it only through the closure
        y = checkpoint(lambda a: (a @ scaled).tanh(), x) if ck else (x @ scaled).tanh()
        y.sum().backward()
        return [w.grad.array.copy(), x.grad.array.copy()]

    _assert_bitwise(run(False), run(True))


def test_nested_checkpoints_and_a_second_backward_with_retain_graph():
    net = _mlp(p=0.0)
    x = core.randn(5, 8, requires_grad=True)
    plain = _grads(net, x, _whole)
    inner = list(net.children())

    def outer(h):
        h = checkpoint(nn.Sequential(*inner[:3]), h)
        return nn.Sequential(*inner[3:])(h)

    _assert_bitwise(plain, _grads(net, x, lambda n, x: checkpoint(outer, x)))
    y = checkpoint(outer, x)
    for p in net.parameters():
        p.grad = None
    y.sum().backward(retain_graph=True)
    once = [p.grad.array.copy() for p in net.parameters()]
    y.sum().backward()
    for a, p in zip(once, net.parameters()):
        assert np.array_equal(p.grad.array, a * 2)  # doubling is exact in binary floating point


@pytest.mark.parametrize("reentrant", VARIANTS)
def test_create_graph_through_a_checkpoint_is_refused_not_silently_first_order(reentrant):
    x = core.randn(3, requires_grad=True)
    y = checkpoint(lambda a: (a * a).sin(), x, use_reentrant=reentrant)
    with pytest.raises(core.AutogradError, match="first-order backward only"):
        core.autograd.grad(y.sum(), x, create_graph=True)


def test_recomputation_that_differs_from_forward_is_refused():
    x = core.randn(4, requires_grad=True)
    calls = []

    def changing(a):
        calls.append(1)
        return a[: 5 - len(calls)].exp()

    y = checkpoint(changing, x)
    with pytest.raises(CheckpointError, match="recomputed outputs"):
        y.sum().backward()


# -- memory: the activations are gone ------------------------------------------------------

def _numpy_bytes() -> int:
    """Bytes of numpy array data alive now, as tracemalloc tracks them (numpy reports every
    data buffer it allocates in its own tracemalloc domain)."""
    snap = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)])
    return sum(stat.size for stat in snap.statistics("filename"))


@pytest.mark.parametrize("reentrant", VARIANTS)
def test_activations_are_freed_after_forward_and_the_graph_holds_only_segment_ends(reentrant):
    depth, width, batch = 6, 128, 32
    core.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])
    x = core.randn(batch, width, requires_grad=True)
    activation = batch * width * 4  # one float32 activation

    def held(run):
        tracemalloc.start()
        try:
            before = _numpy_bytes()
            out = run()  # the graph is acyclic: what it drops is freed at once, no gc needed
            kept = _numpy_bytes() - before
        finally:
            tracemalloc.stop()
        out.sum().backward()
        return kept

    plain = held(lambda: net(x))
    ckpt = held(lambda: checkpoint_sequential(net, depth, x, use_reentrant=reentrant))
    # Without checkpointing each block keeps its Linear output and its ReLU output: 2
    # activations a block (the parameters were allocated before `before`).
    assert plain >= 2 * depth * activation
    # With one segment per block only the segments' outputs stay (depth - 1), plus the last
    # block's graph (its 2 activations): depth + 1 in all, a small allowance for Python's
    # bookkeeping arrays aside.
    assert ckpt <= (depth + 1) * activation + 4096
    assert ckpt < 0.7 * plain
