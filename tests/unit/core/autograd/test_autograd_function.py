"""core.autograd.Function against torch.autograd.Function: the same classes, written once over
either library, give the same values, gradients, node names and errors."""

import warnings

import numpy as np
import pytest
import torch

from shoal import core
from shoal.core.autograd.function import once_differentiable

# float64 throughout: both sides then run the same arithmetic to the last bit or two.
TOL = dict(rtol=1e-12, atol=1e-12)


def _pair(*shape, seed=0):
    data = np.random.default_rng(seed).standard_normal(shape)
    return (core.tensor(data, requires_grad=True),
            torch.tensor(data, requires_grad=True))


def _functions(lib):
    """The same custom Functions, over core or torch (`lib` is the module)."""
    base = lib.autograd.Function

    class Exp(base):
        @staticmethod
        def forward(ctx, x):
            out = x.exp()
            ctx.save_for_backward(out)
            return out

        @staticmethod
        def backward(ctx, g):
            (out,) = ctx.saved_tensors
            return g * out

    class Scale(base):  # a non-tensor argument: its gradient is None
        @staticmethod
        def forward(ctx, x, k):
            ctx.k = k
            return x * k

        @staticmethod
        def backward(ctx, g):
            return g * ctx.k, None

    class MulAdd(base):  # two tensor inputs, needs_input_grad decides what to compute
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(x, y)
            return x * y + x

        @staticmethod
        def backward(ctx, g):
            x, y = ctx.saved_tensors
            gx = g * (y + 1) if ctx.needs_input_grad[0] else None
            gy = g * x if ctx.needs_input_grad[1] else None
            return gx, gy

    class SplitTwo(base):  # two outputs: backward receives both gradients at once
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2, x * x

        @staticmethod
        def backward(ctx, g1, g2):
            (x,) = ctx.saved_tensors
            return g1 * 2 + g2 * 2 * x

    class ArgSort(base):  # an integer output and a marked one: no gradient flows there
        @staticmethod
        def forward(ctx, x):
            idx = lib.tensor(np.argsort(x.detach().numpy()))
            marked = x * 1
            ctx.mark_non_differentiable(marked)
            ctx.set_materialize_grads(False)
            return x * 3, idx, marked

        @staticmethod
        def backward(ctx, g, g_idx, g_marked):
            assert g_marked is None and g_idx is None  # not materialized
            return g * 3

    class Cube(base):  # torch's newer style: forward without ctx, then setup_context
        @staticmethod
        def forward(x):
            return x * x * x

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 3 * g * x * x

    return dict(Exp=Exp, Scale=Scale, MulAdd=MulAdd, SplitTwo=SplitTwo, ArgSort=ArgSort,
                Cube=Cube)


C, T = _functions(core), _functions(torch)


def _close(a, b):
    np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), **TOL)


@pytest.mark.parametrize("name", ["Exp", "Cube"])
def test_single_output_values_gradients_and_node_names_match_torch(name):
    x, tx = _pair(3, 4)
    y, ty = C[name].apply(x), T[name].apply(tx)
    _close(y, ty)
    assert y.grad_fn.name() == ty.grad_fn.name() == f"{name}Backward"
    (y * y).sum().backward()
    (ty * ty).sum().backward()
    _close(x.grad, tx.grad)


def test_non_tensor_arguments_and_needs_input_grad_match_torch():
    x, tx = _pair(2, 3)
    y, ty = _pair(2, 3, seed=1)
    y.requires_grad_(False)
    ty.requires_grad_(False)
    out, tout = C["MulAdd"].apply(C["Scale"].apply(x, 2.5), y), \
        T["MulAdd"].apply(T["Scale"].apply(tx, 2.5), ty)
    _close(out, tout)
    out.sum().backward()
    tout.sum().backward()
    _close(x.grad, tx.grad)
    assert y.grad is None and ty.grad is None


def test_multiple_outputs_run_backward_once_with_both_gradients():
    x, tx = _pair(5)
    a, b = C["SplitTwo"].apply(x)
    ta, tb = T["SplitTwo"].apply(tx)
    (a.sum() + (b * b).sum()).backward()
    (ta.sum() + (tb * tb).sum()).backward()
    _close(x.grad, tx.grad)
    # Only one output used: the other's gradient is materialized as zeros (torch's default).
    x.grad = None
    tx.grad = None
    C["SplitTwo"].apply(x)[1].sum().backward()
    T["SplitTwo"].apply(tx)[1].sum().backward()
    _close(x.grad, tx.grad)


def test_non_differentiable_outputs_and_unmaterialized_grads_match_torch():
    x, tx = _pair(4)
    y, idx, marked = C["ArgSort"].apply(x)
    ty, tidx, tmarked = T["ArgSort"].apply(tx)
    assert (idx.requires_grad, marked.requires_grad) == (tidx.requires_grad,
                                                         tmarked.requires_grad) == (False, False)
    assert idx.dtype == core.int64 and tidx.dtype == torch.int64
    y.sum().backward()
    ty.sum().backward()
    _close(x.grad, tx.grad)


def test_backward_runs_inside_the_engine_as_a_named_node_with_profiler_events():
    x, _ = _pair(3)
    with core.profiler.profile() as prof:
        C["Exp"].apply(x).sum().backward()
    names = [e.name for e in prof.events()]
    assert "ExpBackward" in names


def _errors(lib):
    base = lib.autograd.Function

    class TooFew(base):
        @staticmethod
        def forward(ctx, x, k):
            return x * k

        @staticmethod
        def backward(ctx, g):
            return g

    class GradForNumber(base):
        @staticmethod
        def forward(ctx, x, k):
            return x * k

        @staticmethod
        def backward(ctx, g):
            return g, g

    class WrongShape(base):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g[:1]

    class NoBackward(base):
        @staticmethod
        def forward(ctx, x):
            return x * 2

    class NoForward(base):
        pass

    return TooFew, GradForNumber, WrongShape, NoBackward, NoForward


@pytest.mark.parametrize("case, exc, match", [
    (0, RuntimeError, r"function TooFewBackward returned an incorrect number of gradients "
                      r"\(expected 2, got 1\)"),
    (1, RuntimeError, "returned a gradient different than None at position 2, but the "
                      "corresponding forward input was not a Variable"),
    (2, RuntimeError, r"Function WrongShapeBackward returned an invalid gradient at index 0 - "
                      r"got \[1\] but expected shape compatible with \[2\]"),
    (3, NotImplementedError, "You must implement either the backward or vjp method"),
])
def test_backward_errors_match_torch(case, exc, match):
    for lib in (torch, core):
        fn = _errors(lib)[case]
        x = lib.ones(2, requires_grad=True)
        args = (x, 2.0) if case < 2 else (x,)
        with pytest.raises(exc, match=match):
            fn.apply(*args).sum().backward()


def test_forward_errors_and_legacy_calls_match_torch():
    for lib, fns in ((torch, T), (core, C)):
        no_forward = _errors(lib)[4]
        with pytest.raises(NotImplementedError, match="You must implement the forward function"):
            no_forward.apply(lib.ones(2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch warns on instantiation
            legacy = fns["Exp"]()
        with pytest.raises(RuntimeError, match="Legacy autograd function"):
            legacy(lib.ones(2))


def test_saved_tensors_are_freed_after_backward_and_refuse_access_as_torch():
    for lib, fns in ((torch, T), (core, C)):
        x = lib.ones(2, requires_grad=True)
        y = fns["Exp"].apply(x)
        y.sum().backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            y.grad_fn.saved_tensors  # noqa: B018 - the access is the test


def test_an_in_place_update_of_a_saved_tensor_is_caught_as_torch():
    for lib, fns in ((torch, T), (core, C)):
        x = lib.ones(2, requires_grad=True)
        y = x * 1
        z = fns["MulAdd"].apply(y, x)
        with lib.no_grad():
            y.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.sum().backward()


def test_returned_saved_tensor_is_not_overwritten_by_accumulation():
    """A backward that returns a tensor it still holds: the engine must not add into it."""

    class Keep(core.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.keep = core.ones(2)
            return x * 1

        @staticmethod
        def backward(ctx, g):
            return ctx.keep

    x = core.ones(2, requires_grad=True)
    fn = Keep.apply(x)
    ctx = fn.grad_fn
    (fn.sum() + (x * 3).sum()).backward()
    np.testing.assert_array_equal(ctx.keep.numpy(), np.ones(2))
    np.testing.assert_array_equal(x.grad.numpy(), np.full(2, 4.0))


def test_no_graph_without_an_input_that_requires_grad_or_under_no_grad():
    x = core.ones(2)
    assert C["Exp"].apply(x).grad_fn is None
    with core.no_grad():
        assert C["Exp"].apply(core.ones(2, requires_grad=True)).requires_grad is False


def test_once_differentiable_refuses_a_second_differentiation_as_torch():
    def make(lib, decorator):
        class Square(lib.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x * x

            @staticmethod
            @decorator
            def backward(ctx, g):
                (x,) = ctx.saved_tensors
                return 2 * g * x

        return Square

    for lib, deco in ((torch, torch.autograd.function.once_differentiable),
                      (core, once_differentiable)):
        sq = make(lib, deco)
        x = lib.ones(3, requires_grad=True)
        (g,) = lib.autograd.grad(sq.apply(x).sum(), x, create_graph=True)
        assert g.grad_fn is None  # the seed needs no grad: nothing to differentiate
        np.testing.assert_array_equal(g.detach().numpy(), np.full(3, 2.0))
    # With a seed that requires grad, torch's result stands on a DelayedError node whose
    # backward raises this message (torch's first use of it takes over a second to load, so
    # only core runs this part).
    x = core.ones(3, requires_grad=True)
    v = core.ones(3, requires_grad=True)
    (g,) = core.autograd.grad(make(core, once_differentiable).apply(x), x, grad_outputs=v,
                              create_graph=True)
    assert g.grad_fn.name() == "DelayedError"
    with pytest.raises(RuntimeError, match="trying to differentiate twice a function that was "
                                           "marked with @once_differentiable"):
        g.sum().backward()
