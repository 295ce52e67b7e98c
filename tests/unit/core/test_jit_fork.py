"""core.jit.fork/wait: torch's answers, real concurrency, errors, nesting without deadlock."""

from __future__ import annotations

import threading
import numpy as np
import pytest
import torch

from shoal import core
from shoal.core import jit


@torch.jit.script
def _torch_fn(x):
    return torch.neg(x)


@torch.jit.script
def _torch_example(x):
    futures = [torch.jit.fork(_torch_fn, x) for _ in range(100)]
    results = [torch.jit.wait(fut) for fut in futures]
    return torch.sum(torch.stack(results))


def test_the_release_example_of_100_forks_gives_torch_s_answer() -> None:
    """PyTorch 1.6's fork/wait example (scripted in torch, plain Python here)."""
    def fn(x):
        return x.neg()  # core has the method; torch.neg is the function

    def example(x):
        futures = [jit.fork(fn, x) for _ in range(100)]
        results = [jit.wait(fut) for fut in futures]
        return core.sum(core.stack(results))

    ours, theirs = example(core.ones([])), _torch_example(torch.ones([]))
    assert ours.item() == theirs.item() == -100.0
    assert ours.dtype.name == str(theirs.dtype).removeprefix("torch.")


def test_fork_passes_keyword_arguments_and_returns_a_future() -> None:
    fut = jit.fork(lambda a, b=0: a + b, core.tensor(2), b=3)
    assert isinstance(fut, jit.Future)
    assert jit.wait(fut).item() == 5
    assert fut.done() and fut.value().item() == 5


def test_forked_calls_run_concurrently() -> None:
    """Two tasks that each wait for the other to have started can only both finish if they run
    at the same time (a sequential fork would time out here)."""
    started = [threading.Event(), threading.Event()]

    def task(me: int) -> int:
        started[me].set()
        assert started[1 - me].wait(timeout=10), "the other task never ran alongside"
        return me

    futures = [jit.fork(task, i) for i in range(2)]
    assert [jit.wait(f, timeout=20) for f in futures] == [0, 1]


def test_numpy_work_overlaps_across_forks() -> None:
    """The same matmuls forked give the same values as run in sequence."""
    mats = [core.randn(64, 64, dtype=core.float64) for _ in range(8)]
    futures = [jit.fork(lambda m: m @ m, m) for m in mats]
    for m, f in zip(mats, futures):
        np.testing.assert_array_equal(jit.wait(f).numpy(), (m @ m).numpy())


def test_an_exception_in_the_forked_call_is_raised_by_wait() -> None:
    def boom():
        raise ValueError("bad input 7")

    fut = jit.fork(boom)
    with pytest.raises(ValueError, match="bad input 7"):
        jit.wait(fut)


def test_nested_forks_deeper_than_the_pool_do_not_deadlock() -> None:
    def tree(depth: int) -> int:
        if depth == 0:
            return 1
        kids = [jit.fork(tree, depth - 1) for _ in range(2)]
        return sum(jit.wait(k, timeout=20) for k in kids)

    assert jit.wait(jit.fork(tree, 6), timeout=30) == 64


def test_wait_times_out_with_a_clear_error() -> None:
    started, gate = threading.Event(), threading.Event()

    def blocked() -> bool:
        started.set()
        return gate.wait(10)

    fut = jit.fork(blocked)
    try:
        assert started.wait(10)  # running in the pool, so wait cannot run it itself
        with pytest.raises(TimeoutError, match="did not finish within 0.05s"):
            jit.wait(fut, timeout=0.05)
    finally:
        gate.set()
    assert jit.wait(fut, timeout=10) is True


def test_then_chains_on_the_result_and_grad_mode_follows_the_forker() -> None:
    with core.no_grad():
        fut = jit.fork(core.is_grad_enabled)
    assert jit.wait(fut) is False
    assert jit.wait(jit.fork(core.is_grad_enabled)) is True
    chained = jit.fork(lambda: 20).then(lambda f: f.value() + 1)
    assert chained.wait(timeout=10) == 21
