"""DistributedDataParallel's reducer logic with ranks as threads over an in-memory group.

The group here is a stand-in with the process group's call shapes (all_reduce and broadcast,
async Work with wait(timeout)), so these tests exercise bucketing, hooks, finalization,
rebuilds, error messages and join quickly; tests/multiproc/test_ddp_processes.py runs the same
training over the real tcp backend in spawned processes.
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any, Callable

import numpy as np
import pytest
from prometheus_client import REGISTRY

from shoal import core
from shoal.collectives.ddp import comm_hooks
from shoal.collectives.ddp.buckets import compute_bucket_assignment
from shoal.collectives.types import CollectiveMismatch, CollectiveTimeout, ReduceOp
from shoal.collectives.ddp.ddp import DDPError, DistributedDataParallel
from shoal.collectives.ddp.join import EarlyTermination
from shoal.core import nn
from shoal.core.autograd import Node
from shoal.core.tensor import Tensor

# ------------------------------------------------------------------ an in-memory group


class _Hub:
    """Where the W thread-ranks of one group meet; slots are matched by sequence number."""

    def __init__(self, world: int, timeout: float) -> None:
        self.world = world
        self.timeout = timeout
        self.cond = threading.Condition()
        self.slots: dict[int, dict] = {}

    def put(self, seq: int, rank: int, desc: tuple, array: Any) -> None:
        with self.cond:
            slot = self.slots.setdefault(seq, {"desc": {}, "data": {}, "read": 0})
            slot["desc"][rank] = desc
            slot["data"][rank] = array
            self.cond.notify_all()

    def take(self, seq: int, rank: int, timeout: float | None) -> list:
        timeout = self.timeout if timeout is None else timeout
        with self.cond:
            ok = self.cond.wait_for(
                lambda: len(self.slots.get(seq, {"desc": {}})["desc"]) == self.world, timeout
            )
            slot = self.slots.get(seq, {"desc": {}})
            if not ok:
                missing = sorted(set(range(self.world)) - set(slot["desc"]))
                raise CollectiveTimeout(
                    f"Rank {rank} timed out after {timeout}s in collective #{seq}: ranks "
                    f"{missing} never arrived."
                )
            descs = set(slot["desc"].values())
            if len(descs) != 1:
                raise CollectiveMismatch(
                    f"Rank {rank}: collective #{seq} differs across ranks: {slot['desc']}."
                )
            data = [slot["data"][r] for r in range(self.world)]
            slot["read"] += 1
            if slot["read"] == self.world:
                del self.slots[seq]
            return data


class _Work:
    def __init__(self, finish: Callable[[float | None], None]) -> None:
        self._finish = finish
        self._done = False
        self._lock = threading.Lock()

    def wait(self, timeout: float | None = None) -> bool:
        with self._lock:
            if not self._done:
                self._finish(timeout)
                self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


class FakeGroup:
    """One thread-rank's view of a _Hub: rank(), size(), all_reduce, broadcast."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self._hub = hub
        self._rank = rank
        self._seq = 0
        self.ops: list[tuple] = []

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._hub.world

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def all_reduce(self, array, op=ReduceOp.SUM, async_op=False):
        seq = self._next()
        desc = ("all_reduce", op, array.shape, str(array.dtype))
        self.ops.append(desc)
        self._hub.put(seq, self._rank, desc, array.copy())

        def finish(timeout):
            parts = self._hub.take(seq, self._rank, timeout)
            if op is ReduceOp.SUM:
                total = parts[0].copy()
                for p in parts[1:]:
                    total += p
            elif op is ReduceOp.MAX:
                total = np.maximum.reduce(parts)
            else:
                raise NotImplementedError(op)
            array[...] = total

        work = _Work(finish)
        if not async_op:
            work.wait()
        return work

    def broadcast(self, array, src=0, async_op=False):
        seq = self._next()
        desc = ("broadcast", src, array.shape, str(array.dtype))
        self.ops.append(desc)
        self._hub.put(seq, self._rank, desc, array.copy() if self._rank == src else None)

        def finish(timeout):
            parts = self._hub.take(seq, self._rank, timeout)
            array[...] = parts[src]

        work = _Work(finish)
        if not async_op:
            work.wait()
        return work


def run_ranks(world: int, fn: Callable[[FakeGroup], Any], timeout: float = 10.0) -> list:
    """Run fn(group) on `world` threads; return their results or raise the first failure."""
    hub = _Hub(world, timeout)
    results: list = [None] * world
    errors: list = [None] * world

    def body(rank: int) -> None:
        try:
            results[rank] = fn(FakeGroup(hub, rank))
        except BaseException as exc:  # noqa: BLE001  (reported to the test below)
            errors[rank] = exc
            errors[rank].__traceback_text__ = traceback.format_exc()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for rank, t in enumerate(threads):
        t.join(timeout * 4)
        assert not t.is_alive(), f"rank {rank} is still running after {timeout * 4}s"
    for rank, err in enumerate(errors):
        if err is not None:
            raise err
    return results


# ------------------------------------------------------------------ models and data


class MLP(nn.Module):
    def __init__(self, sizes=(6, 8, 8, 3), extra=False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(a, b, dtype=core.float64) for a, b in zip(sizes[:-1], sizes[1:])
        )
        if extra:
            self.extra = nn.Linear(sizes[-1], sizes[-1], dtype=core.float64)

    def forward(self, x, use_extra=False):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = x.tanh()
        if use_extra:
            x = self.extra(x)
        return x


# core's generator is process-wide: thread-ranks build their models one at a time.
_build_lock = threading.Lock()


def make_model(seed=0, cls=None, **kw):
    with _build_lock:
        core.manual_seed(seed)
        return (cls or MLP)(**kw)


def batch(step: int, rank: int, n: int = 4, d_in: int = 6, d_out: int = 3):
    rng = np.random.default_rng(1000 * step + rank)
    return Tensor(rng.standard_normal((n, d_in))), Tensor(rng.standard_normal((n, d_out)))


def mse(out, y, scale=1.0):
    # Scaled before the sum so that no op runs on the 0-d result.
    diff = (out - y) * float(np.sqrt(scale / out.numel()))
    return (diff * diff).sum()


def params_of(module) -> list[np.ndarray]:
    return [p.array.copy() for p in module.parameters()]


def reference(world, steps, micro=1, extra_rank=None, lr=0.1, momentum=0.9, seed=0, model_kw=None):
    """One process: each step averages the loss of every rank's shard (the whole batch)."""
    model = make_model(seed, **(model_kw or {}))
    opt = core.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for step in range(steps):
        opt.zero_grad()
        for m in range(micro):
            for rank in range(world):
                x, y = batch(step * micro + m, rank)
                use_extra = extra_rank is not None and rank == extra_rank
                loss = mse(model(x, use_extra=use_extra), y, 1.0 / world)
                loss.backward()
        opt.step()
    return params_of(model)


def train_ddp(group, steps, micro=1, extra_rank=None, lr=0.1, momentum=0.9, seed=0,
              model_kw=None, hook=None, **ddp_kw):
    model = make_model(seed + group.rank(), **(model_kw or {}))  # differs until DDP broadcasts
    ddp = DistributedDataParallel(model, process_group=group, **ddp_kw)
    if hook is not None:
        ddp.register_comm_hook(group, hook)
    opt = core.optim.SGD(ddp.parameters(), lr=lr, momentum=momentum)
    rank = group.rank()
    for step in range(steps):
        opt.zero_grad()
        for m in range(micro):
            x, y = batch(step * micro + m, rank)
            use_extra = extra_rank is not None and rank == extra_rank
            if m < micro - 1:
                with ddp.no_sync():
                    mse(ddp(x, use_extra=use_extra), y).backward()
            else:
                mse(ddp(x, use_extra=use_extra), y).backward()
        opt.step()
    return params_of(ddp)


def assert_params_close(got, want, tol):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=0, atol=tol, err_msg=f"parameter {i}")


# ------------------------------------------------------------------ bucket assignment


def test_bucket_assignment_reverse_order_small_first_bucket():
    f4 = np.dtype(np.float32)
    numels = [100, 300_000, 100, 300_000, 10]  # 400 B, 1.2 MB, 400 B, 1.2 MB, 40 B
    order = [4, 3, 2, 1, 0]
    buckets = compute_bucket_assignment(numels, [f4] * 5, order, [1 << 20, 2 << 20])
    # First bucket closes once it reaches 1 MiB (with parameter 3), later ones at 2 MiB.
    assert buckets == [[4, 3], [2, 1, 0]]


def test_bucket_assignment_separates_dtypes_and_keeps_launch_order():
    f4, f8 = np.dtype(np.float32), np.dtype(np.float64)
    buckets = compute_bucket_assignment([10, 10, 10], [f4, f8, f4], [2, 1, 0], [1 << 20])
    assert buckets == [[2, 0], [1]]


def test_bucket_assignment_rejects_bad_limits_and_orders():
    f4 = np.dtype(np.float32)
    with pytest.raises(ValueError, match="positive byte counts"):
        compute_bucket_assignment([1], [f4], [0], [0])
    with pytest.raises(ValueError, match="lists a parameter twice"):
        compute_bucket_assignment([1, 1], [f4, f4], [0, 0], [10])


# ------------------------------------------------------------------ equivalence

STEPS = 3


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_matches_one_process_on_the_whole_batch(world):
    want = reference(world, STEPS)
    got = run_ranks(world, lambda g: train_ddp(g, STEPS, bucket_cap_mb=0.0005))
    for rank_params in got:
        assert_params_close(rank_params, want, 1e-6)


@pytest.mark.parametrize(
    "kw",
    [
        dict(gradient_as_bucket_view=True),
        dict(static_graph=True),
        dict(micro=3),
        dict(micro=2, gradient_as_bucket_view=True),
        dict(hook=comm_hooks.allreduce_hook),
    ],
    ids=["bucket_view", "static_graph", "no_sync", "no_sync_bucket_view", "allreduce_hook"],
)
def test_ddp_variants_match_one_process(kw):
    micro = kw.get("micro", 1)
    want = reference(2, STEPS, micro=micro)
    got = run_ranks(2, lambda g: train_ddp(g, STEPS, bucket_cap_mb=0.0005, **kw))
    for rank_params in got:
        assert_params_close(rank_params, want, 1e-6)


@pytest.mark.parametrize(
    "hook,tol",
    [(comm_hooks.fp16_compress_hook, 2e-3), (comm_hooks.bf16_compress_hook, 2e-2)],
    ids=["fp16", "bf16"],
)
def test_compression_hooks_match_to_their_precision(hook, tol):
    want = reference(2, STEPS)
    got = run_ranks(2, lambda g: train_ddp(g, STEPS, hook=hook))
    for rank_params in got:
        assert_params_close(rank_params, want, tol)
    assert_params_close(got[1], got[0], 0)  # every replica took the same step


def test_unused_parameters_are_reduced_as_zeros():
    # Rank 1 routes through `extra`, rank 0 does not: extra's average is rank 1's gradient / 2.
    kw = dict(extra_rank=1, model_kw=dict(extra=True))
    want = reference(2, STEPS, **kw)
    got = run_ranks(2, lambda g: train_ddp(g, STEPS, find_unused_parameters=True, **kw))
    for rank_params in got:
        assert_params_close(rank_params, want, 1e-6)


def test_parameters_unused_everywhere_keep_no_gradient():
    def body(group):
        ddp = DistributedDataParallel(
            make_model(extra=True), process_group=group, find_unused_parameters=True
        )
        x, y = batch(0, group.rank())
        mse(ddp(x), y).backward()
        return [p.grad is None for p in ddp.module.extra.parameters()], [
            p.grad is None for p in ddp.module.layers.parameters()
        ]

    for extra_none, used_none in run_ranks(2, body):
        assert extra_none == [True, True]
        assert not any(used_none)


# ------------------------------------------------------------------ reentrant backward


def checkpoint(fn, x):
    """Recompute fn in backward and run a nested backward through it (torch's reentrant kind)."""
    with core.no_grad():
        out = fn(x)
    result = Tensor(out.array)

    def backward(g):
        with core.enable_grad():
            inner = Tensor(x.array, requires_grad=True)
            y = fn(inner)
        y.backward(Tensor(g))
        return (inner.grad.array,)

    result.requires_grad = True
    result.grad_fn = Node("CheckpointBackward", backward, (x,))
    return result


class Checkpointed(nn.Module):
    """A block used twice through two checkpoints: its parameters' hooks fire twice."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8, dtype=core.float64)
        self.block = nn.Linear(8, 8, dtype=core.float64)
        self.out = nn.Linear(8, 3, dtype=core.float64)

    def forward(self, x, use_extra=False):
        h = self.inp(x).tanh()
        h = checkpoint(lambda t: self.block(t).tanh(), h)
        h = checkpoint(lambda t: self.block(t).tanh(), h)
        return self.out(h)


def test_static_graph_allows_reentrant_backward():
    def train(group=None):
        model = make_model(cls=Checkpointed)
        net = DistributedDataParallel(model, process_group=group, static_graph=True) if group else model
        opt = core.optim.SGD(net.parameters(), lr=0.1)
        for step in range(STEPS):
            opt.zero_grad()
            ranks = [group.rank()] if group else range(2)
            for rank in ranks:
                x, y = batch(step, rank)
                mse(net(x), y, 1.0 if group else 0.5).backward()
            opt.step()
        return params_of(net)

    want = train()
    for got in run_ranks(2, train):
        assert_params_close(got, want, 1e-6)


def test_reentrant_backward_without_static_graph_names_the_parameter():
    def body(group):
        ddp = DistributedDataParallel(make_model(cls=Checkpointed), process_group=group)
        x, y = batch(0, group.rank())
        with pytest.raises(DDPError, match=r"marked as ready twice.*static_graph=True") as info:
            mse(ddp(x), y).backward()
        assert "'block.weight'" in str(info.value) or "'block.bias'" in str(info.value)

    run_ranks(2, body)


# ------------------------------------------------------------------ usage errors


def test_unused_parameter_without_the_flag_is_explained():
    def body(group):
        ddp = DistributedDataParallel(make_model(extra=True), process_group=group)
        x, y = batch(0, group.rank())
        with pytest.raises(DDPError, match=r"find_unused_parameters=True.*'extra.weight'"):
            mse(ddp(x), y).backward()

    run_ranks(2, body, timeout=5)


def test_backward_that_skips_the_forward_output_is_caught_at_the_next_forward():
    # A loss built from a parameter directly fires hooks but never reaches DDP's outputs.
    def body(group):
        ddp = DistributedDataParallel(make_model(), process_group=group)
        x, y = batch(0, group.rank())
        ddp(x)
        (ddp.module.layers[0].weight * 1.0).sum().backward()
        with pytest.raises(DDPError, match=r"Expected to have finished reduction in the prior"):
            ddp(x)

    run_ranks(2, body, timeout=5)


def test_two_forwards_then_one_backward_still_reduce():
    def body(group):
        ddp = DistributedDataParallel(make_model(), process_group=group)
        x, y = batch(0, group.rank())
        out = ddp(x) + ddp(x)
        mse(out, y).backward()
        return [p.grad.array.copy() for p in ddp.parameters()]

    g0, g1 = run_ranks(2, body)
    assert_params_close(g0, g1, 0)


def test_comm_hook_registration_rules():
    def body(group):
        ddp = DistributedDataParallel(make_model(), process_group=group)
        ddp.register_comm_hook(group, comm_hooks.allreduce_hook)
        with pytest.raises(DDPError, match="only be called once"):
            ddp.register_comm_hook(group, comm_hooks.allreduce_hook)

    run_ranks(2, body)


def test_comm_hook_must_return_a_future():
    def body(group):
        ddp = DistributedDataParallel(make_model(), process_group=group)
        ddp.register_comm_hook(None, lambda state, bucket: bucket.buffer())
        x, y = batch(0, group.rank())
        with pytest.raises(DDPError, match="must return a Future"):
            mse(ddp(x), y).backward()

    run_ranks(1, body)


def test_mismatched_parameters_are_named_at_construction():
    def body(group):
        sizes = (6, 8, 3) if group.rank() == 0 else (6, 9, 3)
        with pytest.raises(DDPError, match=r"at parameter 0: rank 0 has 'layers.0.weight' of shape "
                                           r"\(8, 6\).*rank 1 has 'layers.0.weight' of shape \(9, 6\)"):
            DistributedDataParallel(make_model(sizes=sizes), process_group=group)

    run_ranks(2, body)


def test_construction_broadcasts_rank0_parameters():
    def body(group):
        model = make_model(seed=group.rank())
        DistributedDataParallel(model, process_group=group)
        return params_of(model)

    p0, p1 = run_ranks(2, body)
    assert_params_close(p1, p0, 0)
    assert_params_close(p0, params_of(make_model(seed=0)), 0)


# ------------------------------------------------------------------ rebuild, metrics


class Reordered(nn.Module):
    """Parameters defined in an order unlike their use, so arrival order differs from reverse."""

    def __init__(self) -> None:
        super().__init__()
        self.late = nn.Linear(8, 3, dtype=core.float64)
        self.early = nn.Linear(6, 8, dtype=core.float64)

    def forward(self, x):
        return self.late(self.early(x).tanh())


def test_buckets_are_rebuilt_once_from_the_arrival_order():
    def body(group):
        ddp = DistributedDataParallel(
            make_model(cls=Reordered), process_group=group, bucket_cap_mb=1e-9
        )
        initial = ddp.bucket_indices
        layouts = []
        for step in range(3):
            x, y = batch(step, group.rank())
            mse(ddp(x), y).backward()
            layouts.append(ddp.bucket_indices)
        return initial, layouts

    for initial, layouts in run_ranks(2, body):
        # names: 0 late.weight, 1 late.bias, 2 early.weight, 3 early.bias
        assert initial == [[3], [2], [1], [0]]  # reverse definition order
        # The first round already reduced in the rebuilt layout (it reduces after backward),
        # so a restarted process reduces every round exactly as the run it continues.
        first_two = {tuple(b) for b in layouts[0][:2]}
        assert first_two == {(0,), (1,)}  # late's gradients arrive first
        assert layouts[2] == layouts[1] == layouts[0]  # rebuilt once


def test_metrics_count_buckets_and_waits():
    def sample(name):
        return REGISTRY.get_sample_value(name) or 0.0

    before_b = sample("shoal_ddp_bucket_allreduce_seconds_count")
    before_w = sample("shoal_ddp_comm_wait_seconds_count")

    def body(group):
        ddp = DistributedDataParallel(make_model(), process_group=group, bucket_cap_mb=1e-9)
        x, y = batch(0, group.rank())
        mse(ddp(x), y).backward()
        return len(ddp.bucket_indices)

    buckets = run_ranks(2, body)[0]
    assert sample("shoal_ddp_bucket_allreduce_seconds_count") - before_b == 2 * buckets
    assert sample("shoal_ddp_comm_wait_seconds_count") - before_w == 2


def test_the_wait_for_the_last_bucket_reduced_inline_counts_as_exposed():
    """The last bucket is reduced in backward's own thread once backward is over: nothing can
    hide it, so a rank whose peer is 60 ms late waits those 60 ms in the exposed-wait metric
    (it read about 0 when only finalize's own wait was timed)."""
    def sample(name):
        return REGISTRY.get_sample_value(name) or 0.0

    def body(group):
        ddp = DistributedDataParallel(make_model(), process_group=group)  # one bucket
        x, y = batch(0, group.rank())
        mse(ddp(x), y).backward()  # the first round reduces after backward; the rest inline
        loss = mse(ddp(x), y)
        if group.rank() == 1:
            time.sleep(0.06)
        before = sample("shoal_ddp_comm_wait_seconds_sum")
        loss.backward()
        return len(ddp.bucket_indices), before

    results = run_ranks(2, body)
    assert [n for n, _ in results] == [1, 1]
    grown = sample("shoal_ddp_comm_wait_seconds_sum") - min(b for _, b in results)
    assert grown >= 0.05, grown


# ------------------------------------------------------------------ join


def train_uneven(group, batches, divide_by_initial=True, throw=False, join=True, lr=0.1,
                 hook=None, **ddp_kw):
    model = make_model(seed=group.rank())
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.0005, **ddp_kw)
    if hook is not None:
        ddp.register_comm_hook(group, hook)
    opt = core.optim.SGD(ddp.parameters(), lr=lr)
    n = batches[group.rank()]

    def loop():
        for step in range(n):
            opt.zero_grad()
            x, y = batch(step, group.rank())
            mse(ddp(x), y).backward()
            opt.step()

    if join:
        with ddp.join(divide_by_initial_world_size=divide_by_initial,
                      throw_on_early_termination=throw):
            loop()
    else:
        loop()
    return params_of(ddp)


def reference_uneven(batches, divide_by_initial=True, lr=0.1):
    model = make_model()
    opt = core.optim.SGD(model.parameters(), lr=lr)
    world = len(batches)
    for step in range(max(batches)):
        active = [r for r in range(world) if batches[r] > step]
        div = world if divide_by_initial else len(active)
        opt.zero_grad()
        for rank in active:
            x, y = batch(step, rank)
            mse(model(x), y, 1.0 / div).backward()
        opt.step()
    return params_of(model)


@pytest.mark.parametrize("divide_by_initial", [True, False])
def test_join_uneven_inputs_end_identical_and_correct(divide_by_initial):
    batches = [3, 5, 8]
    got = run_ranks(3, lambda g: train_uneven(g, batches, divide_by_initial))
    want = reference_uneven(batches, divide_by_initial)
    for rank_params in got:
        assert_params_close(rank_params, want, 1e-6)


@pytest.mark.parametrize(
    "batches,kw",
    [
        ([0, 1, 3], {}),
        ([2, 4, 3], {"static_graph": True}),
        ([2, 4, 3], {"find_unused_parameters": True}),
        ([2, 4, 3], {"hook": comm_hooks.allreduce_hook}),
        ([1, 3, 2], {"gradient_as_bucket_view": True}),
    ],
    ids=["rank_without_data", "static_graph", "find_unused", "comm_hook", "bucket_view"],
)
def test_join_shadows_every_kind_of_iteration(batches, kw):
    got = run_ranks(3, lambda g: train_uneven(g, batches, **kw))
    want = reference_uneven(batches)
    for rank_params in got:
        assert_params_close(rank_params, want, 1e-6)


def test_join_throw_on_early_termination_raises_on_every_rank():
    def body(group):
        with pytest.raises(EarlyTermination, match="exhausted"):
            train_uneven(group, [2, 4], throw=True)

    run_ranks(2, body)


def test_uneven_inputs_without_join_end_in_a_collective_error():
    def body(group):
        if group.rank() == 0:
            train_uneven(group, [2, 4], join=False)
            return
        with pytest.raises(CollectiveTimeout, match="never arrived"):
            train_uneven(group, [2, 4], join=False)

    run_ranks(2, body, timeout=2)


# ------------------------------------------------------------------ buffers and eval


class WithBuffer(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", Tensor(np.ones(3)))

    def forward(self, x, use_extra=False):
        return super().forward(x) * self.scale


@pytest.mark.parametrize("broadcast", [True, False])
def test_buffers_follow_rank0_at_each_forward_when_asked(broadcast):
    def body(group):
        model = make_model(cls=WithBuffer)
        ddp = DistributedDataParallel(model, process_group=group, broadcast_buffers=broadcast)
        model.scale.array[...] = 1.0 + group.rank()  # the replicas drift apart
        x, y = batch(0, group.rank())
        mse(ddp(x), y).backward()
        return model.scale.array.copy()

    s0, s1 = run_ranks(2, body)
    np.testing.assert_array_equal(s0, np.ones(3))
    np.testing.assert_array_equal(s1, np.ones(3) * (1.0 if broadcast else 2.0))


def test_forward_without_grad_communicates_nothing():
    def body(group):
        ddp = DistributedDataParallel(make_model(cls=WithBuffer), process_group=group)
        before = len(group.ops)
        if group.rank() == 0:  # evaluation on one rank only must not wait for the others
            with core.no_grad():
                out = ddp(batch(0, 0)[0])
            assert not out.requires_grad
        return len(group.ops) - before

    assert run_ranks(2, body, timeout=3) == [0, 0]


# ------------------------------------------------------------------ gradient buffers


def test_gradients_handed_out_are_never_overwritten_and_buffers_are_reused():
    def body(group):
        ddp = DistributedDataParallel(make_model(), process_group=group)
        opt = core.optim.SGD(ddp.parameters(), lr=0.1)
        addresses = []
        kept = snapshot = None
        for step in range(8):
            opt.zero_grad()
            x, y = batch(step, group.rank())
            mse(ddp(x), y).backward()
            opt.step()
            addresses.append({b.buffer.ctypes.data for b in ddp.reducer._buckets})
            if step == 4:
                kept = ddp.module.layers[0].weight.grad.array  # a user keeps one gradient
                snapshot = kept.copy()
        np.testing.assert_array_equal(kept, snapshot)
        return addresses

    for addresses in run_ranks(2, body):
        # From the rebuild on (step 1), two buffers alternate, until the gradient kept at
        # step 4 pins its buffer and step 6 reduces into a new one instead.
        assert addresses[3] == addresses[1] and addresses[4] == addresses[2]
        assert addresses[5] == addresses[3]
        assert not addresses[6] & addresses[4]
