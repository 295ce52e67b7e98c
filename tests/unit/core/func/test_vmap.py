"""core.func.vmap against torch.func.vmap: values, in_dims/out_dims, nesting, errors, and that
the op runs once for the whole batch (the graph has the same size for any batch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal import core
from shoal.core import func
import shoal.core.nn.functional as F


def _pair(*shape: int, seed: int = 0) -> tuple:
    arr = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return core.tensor(arr), torch.tensor(arr)


def _same(ours: core.Tensor, theirs: torch.Tensor) -> None:
    # float32 ops on the same inputs: numpy's and torch's kernels differ only in summation order,
    # a few ulps of the values (|x| < 10 here).
    assert tuple(ours.shape) == tuple(theirs.shape)
    assert ours.dtype.name == str(theirs.dtype).removeprefix("torch.")
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-5)


CASES = {
    "broadcast with a wider unbatched operand": (lambda x, w: x * w, (4, 3), (2, 3)),
    "matmul vector by matrix": (lambda x, w: x @ w, (4, 3), (3, 5)),
    "matmul matrix by vector": (lambda x, w: w.t() @ x, (4, 3), (3, 2)),
    "sum over a dim, keepdim": (lambda x, w: (x * w).sum(0, keepdim=True), (4, 3), (3,)),
    "mean over everything": (lambda x, w: core.mean(x + w), (4, 3), (3,)),
    "softmax and log_softmax": (lambda x, w: x.softmax(-1) + F.log_softmax(x + w, dim=0),
                                (4, 3), (3,)),
    "reshape, transpose, permute": (
        lambda x, w: x.reshape(3, 2).transpose(0, 1).reshape(1, 2, 3).permute(2, 0, 1) + w[0],
        (5, 6), (2, 1)),
    "unsqueeze, squeeze, flatten": (
        lambda x, w: x.unsqueeze(-1).squeeze().flatten() * w.sum(), (4, 2, 3), (3,)),
    "indexing and slicing": (lambda x, w: x[1:, None, 0] * w, (4, 3, 2), (2,)),
    "cat and stack with an unbatched tensor": (
        lambda x, w: core.cat([core.stack([x, w * 2], 1), w[:, None]], 1),
        (4, 3), (3,)),
    "linear, relu, tanh, sigmoid, exp, log": (
        lambda x, w: core.log(core.exp(F.relu(F.linear(x, w)) + 1)).tanh().sigmoid(),
        (4, 3), (5, 3)),
    "max with dim": (lambda x, w: x.max(1)[0] + w.amax(), (4, 2, 3), (3,)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_vmap_matches_torch(name: str) -> None:
    fn, xs, ws = CASES[name]
    x, tx = _pair(*xs, seed=1)
    w, tw = _pair(*ws, seed=2)
    ours = func.vmap(fn, in_dims=(0, None))(x, w)
    theirs = torch.func.vmap(_torch_fn(fn), in_dims=(0, None))(tx, tw)
    _same(ours, theirs)


def _torch_fn(fn):
    """The same lambda run on torch: core's names used above are torch's names too."""
    def run(x, w):
        glob = fn.__globals__
        saved = glob["core"], glob["F"]
        glob["core"], glob["F"] = torch, torch.nn.functional
        try:
            return fn(x, w)
        finally:
            glob["core"], glob["F"] = saved

    return run


def test_in_dims_and_out_dims_move_the_mapped_dim() -> None:
    x, tx = _pair(3, 5, 2)
    y, ty = _pair(5, seed=3)
    ours = func.vmap(lambda a, b: a * b, in_dims=(1, 0), out_dims=1)(x, y)
    theirs = torch.func.vmap(lambda a, b: a * b, in_dims=(1, 0), out_dims=1)(tx, ty)
    _same(ours, theirs)


def test_nested_vmap_is_an_outer_product_of_batches() -> None:
    x, tx = _pair(4, 3)
    y, ty = _pair(5, 3, seed=4)
    ours = func.vmap(func.vmap(lambda a, b: (a * b).sum(), (None, 0)), (0, None))(x, y)
    theirs = torch.func.vmap(torch.func.vmap(lambda a, b: (a * b).sum(), (None, 0)),
                             (0, None))(tx, ty)
    _same(ours, theirs)


def test_dict_inputs_and_tuple_outputs() -> None:
    x, tx = _pair(4, 3)

    def f(d):
        return d["a"].sum(), d["a"] * 2

    ours = func.vmap(f)({"a": x})
    theirs = torch.func.vmap(f)({"a": tx})
    for o, t in zip(ours, theirs):
        _same(o, t)


def test_an_unbatched_output_is_broadcast_as_torch_does() -> None:
    x, tx = _pair(4, 3)
    w, tw = _pair(2)
    _same(func.vmap(lambda a: w * 1.0)(x), torch.func.vmap(lambda a: tw * 1.0)(tx))


def test_the_op_runs_once_for_the_whole_batch() -> None:
    """A Python loop over samples would record one node per sample per op: the graph vmap
    records has the same number of nodes for a batch of 2 and of 64."""
    def nodes(batch: int) -> int:
        x = core.randn(batch, 3, requires_grad=True)
        w = core.randn(4, 3)
        out = func.vmap(lambda a: F.linear(a, w).tanh().sum())(x)
        seen, todo = set(), [out.grad_fn]
        while todo:
            n = todo.pop()
            if n is None or id(n) in seen:
                continue
            seen.add(id(n))
            todo.extend(i.grad_fn for i in n.inputs if i is not None)
        return len(seen)

    assert nodes(2) == nodes(64)


def test_mismatched_batch_sizes_are_refused_as_torch_refuses() -> None:
    with pytest.raises(ValueError, match="same size in the mapped dimension"):
        func.vmap(lambda a, b: a + b)(core.ones(3), core.ones(4))
    with pytest.raises(ValueError, match="in_dim"):
        func.vmap(lambda a: a, in_dims=2)(core.ones(3, 2))


def test_data_dependent_python_control_flow_is_refused() -> None:
    with pytest.raises(RuntimeError, match=r"\.item\(\)"):
        func.vmap(lambda a: a.sum().item())(core.ones(3, 2))
    with pytest.raises(RuntimeError, match="bool"):
        func.vmap(lambda a: a if a.sum() > 0 else -a)(core.ones(3, 2))


def test_an_op_without_a_rule_names_itself() -> None:
    with pytest.raises(NotImplementedError, match="no batching rule for core op 'nonzero'"):
        func.vmap(lambda a: core.nonzero(a))(core.ones(3, 2))


def test_randomness_error_same_and_different() -> None:
    x = core.ones(4, 3)
    with pytest.raises(RuntimeError, match="randomness error mode"):
        func.vmap(lambda a: a + core.randn(3))(x)
    with pytest.raises(RuntimeError, match="randomness error mode"):
        func.vmap(lambda a: F.dropout(a, 0.5))(x)
    same = func.vmap(lambda a: a * core.rand(3), randomness="same")(x)
    assert np.all(same.numpy() == same.numpy()[0])
    different = func.vmap(lambda a: F.dropout(a, 0.5), randomness="different")(core.ones(64, 8))
    rows = {tuple(r) for r in different.numpy().tolist()}
    assert len(rows) > 1  # 64 independent masks of 8 coins: all equal with chance 2**-504
    with pytest.raises(RuntimeError, match="randomness"):
        func.vmap(lambda a: a, randomness="sometimes")


def test_vmap_over_an_op_and_a_module() -> None:
    x, tx = _pair(4, 3)
    _same(func.vmap(core.sin)(x), torch.func.vmap(torch.sin)(tx))
    layer = core.nn.Linear(3, 2)
    tlayer = torch.nn.Linear(3, 2)
    with torch.no_grad():
        tlayer.weight.copy_(torch.tensor(layer.weight.detach().numpy()))
        tlayer.bias.copy_(torch.tensor(layer.bias.detach().numpy()))
    _same(func.vmap(layer)(x).detach(), torch.func.vmap(tlayer)(tx).detach())


def test_chunk_size_gives_the_same_answer() -> None:
    x, tx = _pair(7, 3)
    _same(func.vmap(lambda a: a.softmax(0), chunk_size=3)(x), torch.softmax(tx, 1))


def test_an_op_held_in_a_local_variable_dispatches_too() -> None:
    """However the caller holds the op (a local variable or default argument bound before vmap
    started), the call reaches its batching rule."""
    cross_entropy, local_sum = F.cross_entropy, core.sum
    logits = np.random.default_rng(3).standard_normal((4, 2, 3)).astype(np.float32)
    target = np.array([[0, 1], [2, 2], [1, 0], [0, 0]])

    def f(x, t, loss=F.mse_loss):
        return cross_entropy(x, t) + local_sum(x) + loss(x, x * 2)

    def tf(x, t):
        return (torch.nn.functional.cross_entropy(x, t) + torch.sum(x)
                + torch.nn.functional.mse_loss(x, x * 2))

    _same(func.vmap(f)(core.tensor(logits), core.tensor(target)),
          torch.func.vmap(tf)(torch.tensor(logits), torch.tensor(target)))


def test_the_ops_run_their_own_code_again_when_vmap_returns() -> None:
    from shoal.core.ops import arith

    own = arith.add.__code__
    func.vmap(lambda a: a + 1)(core.ones(3))
    assert arith.add.__code__ is own
    with pytest.raises(RuntimeError):
        func.vmap(lambda a: a.item())(core.ones(3))
    assert arith.add.__code__ is own  # put back after an error too


def test_vmap_under_the_profiler_records_the_batched_ops() -> None:
    from shoal.core import profiler

    x = core.randn(6, 3)
    with profiler.profile() as prof:
        out = func.vmap(lambda a: (a * 2).sum())(x)
    np.testing.assert_allclose(out.numpy(), (x.numpy() * 2).sum(1), rtol=1e-6)
    names = [e.name for e in prof.events()]
    assert names.count("mul") == 1 and names.count("sum") == 1, names  # once for the batch
