"""core.autograd.GraphTask, the engine under distributed autograd: contributions fed in any
order give local autograd's gradients, each node runs once, None contributions complete the
graph without running nodes, leaves go to the sink and never to .grad."""

from __future__ import annotations

import numpy as np
import pytest

from shoal import core
from shoal.core.autograd import AutogradError, GraphTask


def _graph():
    rng = np.random.default_rng(0)
    w = core.Tensor(rng.standard_normal((3, 3)), requires_grad=True)
    x = core.Tensor(rng.standard_normal((2, 3)), requires_grad=True)
    h = (x @ w).tanh()       # "sent" once
    out = (h * h).sum()      # the local root
    return w, x, h, out


def _reference(seed_h):
    w, x, h, out = _graph()
    torch_like = out + (h * core.Tensor(seed_h)).sum()
    torch_like.backward()
    return w.grad.array, x.grad.array


def _sink_into(store):
    def sink(leaf, g, owned):
        store.setdefault(id(leaf), []).append(None if g is None else g.copy())
    return sink


@pytest.mark.parametrize("order", ["root_first", "send_first"])
def test_contributions_in_any_order_equal_local_autograd(order):
    w, x, h, out = _graph()
    seed_h = np.random.default_rng(1).standard_normal(h.shape)
    got: dict = {}
    task = GraphTask([h, out], False, _sink_into(got))
    feeds = [(out, np.ones(())), (h, seed_h)]
    if order == "send_first":
        feeds.reverse()
    task.feed(*feeds[0])
    assert not task.done and got == {}  # h's node waits for its second contribution
    task.feed(*feeds[1])
    assert task.done
    ref_w, ref_x = _reference(seed_h)
    assert len(got[id(w)]) == 1 and len(got[id(x)]) == 1  # each leaf finished once
    np.testing.assert_allclose(got[id(w)][0], ref_w, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got[id(x)][0], ref_x, rtol=0, atol=1e-12)
    assert w.grad is None and x.grad is None


def test_none_contributions_complete_without_running_nodes():
    w, x, h, out = _graph()
    got: dict = {}
    ran = []
    h.register_hook(lambda g: ran.append("h"))
    task = GraphTask([h], False, _sink_into(got))
    task.feed(h, None)
    assert task.done and ran == []
    assert got == {id(w): [None], id(x): [None]}


def test_a_freed_graph_is_an_error_and_retain_graph_keeps_it():
    w, x, h, out = _graph()
    GraphTask([out], True, _sink_into({})).feed(out, np.ones(()))
    GraphTask([out], False, _sink_into({})).feed(out, np.ones(()))
    with pytest.raises(AutogradError, match="backward through the graph a second time"):
        GraphTask([out], False, _sink_into({}))


def test_expects_names_the_tensors_in_the_graph():
    w, x, h, out = _graph()
    stray = core.Tensor(np.ones(2), requires_grad=True)
    task = GraphTask([out], False, _sink_into({}))
    assert task.expects(w) and task.expects(h) and not task.expects(stray)


def test_before_node_runs_before_each_node_and_sees_the_leaves_finished_so_far():
    # a = x * 2 is older than b = y * 3: b's node runs first, finishing y, and the callback
    # runs before a's node with y already in the sink and x not yet
    x = core.Tensor(np.ones(2), requires_grad=True)
    y = core.Tensor(np.ones(2), requires_grad=True)
    a = x * 2.0
    b = y * 3.0
    out = (a + b).sum()
    finished: dict = {}
    seen = []
    task = GraphTask([out], False, _sink_into(finished),
                     before_node=lambda: seen.append(sorted(
                         name for name, t in (("x", x), ("y", y)) if id(t) in finished)))
    task.feed(out, np.ones(()))
    assert task.done
    # nodes: sum, add, b's mul, a's mul - the callback before each of them
    assert seen == [[], [], [], ["y"]]
    np.testing.assert_array_equal(finished[id(x)][0], np.full(2, 2.0))
    np.testing.assert_array_equal(finished[id(y)][0], np.full(2, 3.0))
