"""DDP as a torch script uses it: communication hooks returning any future-like object, the
torch-style hook API (GradBucket, ProcessGroup.allreduce(...).get_future(), Future[...]) and
DistributedDataParallel's keyword arguments with torch's meaning.

Ranks are threads over real tcp process groups (HashStore rendezvous); the reference is the
gradient of the whole batch in one process, which is what torch's DDP leaves on every rank.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import shoal.collectives as dist
from shoal import core
from shoal.collectives import ProcessGroupTCP
from shoal.collectives.ddp.ddp import DDPError, DistributedDataParallel
from shoal.core import nn
from shoal.core.tensor import Tensor
from tests.support.thread_world import ThreadWorld

pytestmark = pytest.mark.timeout(60)
WORLD = 2
_build_lock = threading.Lock()


def _make_group(store, rank, size, *, name, global_ranks, timeout):
    return ProcessGroupTCP(store, rank, size, timeout=timeout, name=name, global_ranks=global_ranks)


@pytest.fixture
def job():
    world = ThreadWorld(_make_group, WORLD)
    yield world
    world.close()


def _model(seed: int = 0) -> nn.Module:
    with _build_lock:  # the seed is process-wide; threads build one at a time
        core.manual_seed(seed)
        return nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))


def _batch(rank: int):
    rng = np.random.default_rng(rank + 11)
    return Tensor(rng.standard_normal((3, 5))), Tensor(rng.standard_normal((3, 2)))


def _loss(out, y, scale=1.0):
    diff = (out - y) * float(np.sqrt(scale / out.numel()))
    return (diff * diff).sum()


def _reference_grads(build=_model) -> list[np.ndarray]:
    """One process, the whole batch: the averaged gradient every DDP rank must hold."""
    model = build()
    for rank in range(WORLD):
        x, y = _batch(rank)
        _loss(model(x), y, 1.0 / WORLD).backward()
    return [p.grad.array.copy() for p in model.parameters()]


def _grads_with_hook(job, hook, **ddp_kw) -> list[list[np.ndarray]]:
    def body(rank):
        ddp = DistributedDataParallel(_model(seed=rank), process_group=job.pgs[rank], **ddp_kw)
        ddp.register_comm_hook(job.pgs[rank], hook)
        x, y = _batch(rank)
        _loss(ddp(x), y).backward()
        return [p.grad.array.copy() for p in ddp.module.parameters()]

    return job.run(body)


class _DuckFuture:
    """A future of the user's own: only wait(), value() and then(), no shoal base class."""

    def __init__(self, work, value):
        self._work, self._value = work, value

    def wait(self):
        self._work.wait()
        return self._value

    def value(self):
        return self._value

    def then(self, fn):
        raise NotImplementedError


def _rpc_future_hook(group, bucket):
    # What the issue saw: an rpc_agent Future, completed once the all_reduce ends.
    from shoal.rpc_agent.futures import Future as RpcFuture

    # The sum goes into a copy, as a compressing hook's does: only the Future's value carries it.
    summed = bucket.buffer().array.copy()
    work = group.all_reduce(summed, async_op=True)
    fut = RpcFuture("bucket all_reduce")
    work.add_done_callback(lambda w: fut.set_result(Tensor(summed / group.size())))
    return fut


def _duck_future_hook(group, bucket):
    summed = bucket.buffer().array / group.size()
    return _DuckFuture(group.all_reduce(summed, async_op=True), summed)


@pytest.mark.parametrize("hook", [_rpc_future_hook, _duck_future_hook], ids=["rpc", "duck"])
def test_a_foreign_future_from_a_hook_is_used(job, hook):
    want = _reference_grads()
    for rank, grads in enumerate(_grads_with_hook(job, hook)):
        for i, (g, w) in enumerate(zip(grads, want)):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=f"rank {rank} param {i}")


def test_a_hook_result_without_value_is_refused(job):
    def returns_work(group, bucket):  # a Work waits but has no value()
        return group.all_reduce(bucket.buffer().array, async_op=True)

    def body(rank):
        ddp = DistributedDataParallel(_model(), process_group=job.pgs[rank])
        ddp.register_comm_hook(job.pgs[rank], returns_work)
        x, y = _batch(rank)
        with pytest.raises(DDPError, match=r"returned \w+ for bucket 0; it must return a Future "
                                           r"\(an object with wait\(\) and value\(\).*it has no "
                                           r"value\(\)\."):
            _loss(ddp(x), y).backward()

    job.run(body)


# ------------------------------------------------------------------ the torch-style hook API


def _torch_style_hook(state, bucket: dist.GradBucket) -> dist.Future[Tensor]:
    # Written as torch's tutorials write it: the process group's allreduce([t]) Work's future.
    tensor = bucket.buffer()
    tensor.data /= state.size()
    return state.allreduce([tensor]).get_future().then(lambda fut: fut.value()[0])


def test_a_torch_style_hook_averages(job):
    assert dist.Future[Tensor].__origin__ is dist.Future  # usable in annotations, evaluated
    assert dist.ddp.Future is dist.Future  # one Future for hooks and Work.get_future()
    want = _reference_grads()
    for rank, grads in enumerate(_grads_with_hook(job, _torch_style_hook)):
        for i, (g, w) in enumerate(zip(grads, want)):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=f"rank {rank} param {i}")


@pytest.mark.parametrize("kind", ["ALLREDUCE", "FP16_COMPRESS"])
def test_builtin_comm_hooks_by_type(job, kind):
    want = _reference_grads()

    def body(rank):
        ddp = DistributedDataParallel(_model(seed=rank), process_group=job.pgs[rank])
        ddp._register_builtin_comm_hook(getattr(dist.BuiltinCommHookType, kind))
        x, y = _batch(rank)
        _loss(ddp(x), y).backward()
        return [p.grad.array.copy() for p in ddp.module.parameters()]

    tol = 1e-3 if kind == "FP16_COMPRESS" else 1e-7
    for rank, grads in enumerate(job.run(body)):
        for i, (g, w) in enumerate(zip(grads, want)):
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=f"rank {rank} param {i}")


def test_builtin_comm_hook_type_is_checked(job):
    def body(rank):
        ddp = DistributedDataParallel(_model(), process_group=job.pgs[rank])
        with pytest.raises(TypeError, match="needs a collectives.BuiltinCommHookType, got 'allreduce'"):
            ddp._register_builtin_comm_hook("allreduce")

    job.run(body)


# ------------------------------------------------------------------ torch's keyword arguments


def test_torch_argument_order_and_defaults(job):
    def body(rank):
        # torch's positional order: module, device_ids, output_device, dim, broadcast_buffers,
        # init_sync, process_group, bucket_cap_mb
        ddp = DistributedDataParallel(_model(seed=rank), None, None, 0, True, True, job.pgs[rank], None)
        assert ddp.bucket_bytes_cap == 25 * 1024 * 1024 and ddp.dim == 0
        assert ddp.device_ids is None and ddp.output_device is None
        ddp2 = DistributedDataParallel(_model(seed=rank), device_ids=[], process_group=job.pgs[rank])
        return [p.array.copy() for p in ddp.module.parameters()], ddp2.device_ids

    (p0, ids0), (p1, _) = job.run(body)
    assert ids0 is None
    for a, b in zip(p0, p1):
        np.testing.assert_array_equal(a, b)  # init_sync=True: rank 0's parameters everywhere


def test_init_sync_false_keeps_each_ranks_parameters(job):
    def body(rank):
        model = _model(seed=rank)
        before = [p.array.copy() for p in model.parameters()]
        DistributedDataParallel(model, process_group=job.pgs[rank], init_sync=False)
        return before, [p.array.copy() for p in model.parameters()]

    for before, after in job.run(body):
        for a, b in zip(before, after):
            np.testing.assert_array_equal(a, b)


def test_device_ids_on_a_host_model_are_refused_as_torch_refuses_them(job):
    torch = pytest.importorskip("torch")
    import torch.distributed as td

    td.init_process_group("gloo", store=td.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="DistributedDataParallel device_ids and output_device "
                                             "arguments only work with"):
            torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2), device_ids=[0])
    finally:
        td.destroy_process_group()

    def body(rank):
        for kwargs in ({"device_ids": [0]}, {"output_device": 0}):
            with pytest.raises(ValueError, match=r"^DistributedDataParallel device_ids and "
                                                 r"output_device arguments only work with a model "
                                                 r"on a CUDA device, but got .* module parameters "
                                                 r"on \['cpu'\]\."):
                DistributedDataParallel(_model(), process_group=job.pgs[rank], **kwargs)
        with pytest.raises(TypeError, match="dim must be an int, got str"):
            DistributedDataParallel(_model(), process_group=job.pgs[rank], dim="0")

    job.run(body)


def test_a_hook_future_that_never_completes_times_out_with_the_group():
    from shoal.rpc_agent.futures import Future as RpcFuture

    job = ThreadWorld(_make_group, WORLD, timeout=1.5)  # the groups' timeout bounds the wait
    try:
        def body(rank):
            ddp = DistributedDataParallel(_model(), process_group=job.pgs[rank])
            ddp.register_comm_hook(None, lambda state, bucket: RpcFuture("a hook's future"))
            x, y = _batch(rank)
            with pytest.raises(Exception, match=r"^Waited 1.5s for a hook's future; it is still pending"):
                _loss(ddp(x), y).backward()

        job.run(body, timeout=20)
    finally:
        job.close()


# ------------------------------------------------------------------ GradBucket

# Bias-free layers: torch's engine delivers a Linear's bias gradient before its weight's and
# shoal's the weight's first, so with biases the two lay buckets out in different orders (the
# layout follows arrival order). Weights of 80, 48 and 24 float32 bytes with a 64-byte cap give
# the buckets [weight 2, weight 1] and [weight 0] in both; 64 / 2**20 MiB is exact in binary.
_CAP_MB = 64 / (1024 * 1024)


def _chain(seed: int = 0) -> nn.Module:
    with _build_lock:
        core.manual_seed(seed)
        return nn.Sequential(nn.Linear(5, 4, bias=False), nn.ReLU(), nn.Linear(4, 3, bias=False),
                             nn.ReLU(), nn.Linear(3, 2, bias=False))


def _bucket_record(bucket, params, as_array) -> dict:
    """What a hook can learn from a GradBucket, in plain values (torch's or shoal's)."""
    buffer = as_array(bucket.buffer())
    grads = [as_array(g) for g in bucket.gradients()]
    return {
        "index": bucket.index(),
        "is_last": bucket.is_last(),
        "params": [next(i for i, q in enumerate(params) if q is p) for p in bucket.parameters()],
        "shapes": [g.shape for g in grads],
        "buffer shape": buffer.shape,
        "views of the buffer": all(np.shares_memory(g, buffer) for g in grads),
        "buffer is the gradients end to end": bool(np.array_equal(
            np.concatenate([g.reshape(-1) for g in grads]), buffer)),
        "gradients": [g.copy() for g in grads],
    }


def _torch_bucket_records(rank: int) -> list[dict]:
    """torch's DDP (gloo, one rank) on rank `rank`'s batch with shoal's initial weights: the
    buckets its hook sees in the second iteration, once the layout follows arrival order
    (torch's first iteration reduces all parameters as one bucket)."""
    torch = pytest.importorskip("torch")

    model = torch.nn.Sequential(torch.nn.Linear(5, 4, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(4, 3, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(3, 2, bias=False))
    with torch.no_grad():
        for mine, theirs in zip(_chain().parameters(), model.parameters()):
            theirs.copy_(torch.from_numpy(np.array(mine.array, np.float32)))
    params = list(model.parameters())
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=_CAP_MB)
    records: list[dict] = []

    def hook(state, bucket):  # torch checks the parameter's name
        records.append(_bucket_record(bucket, params, lambda t: t.detach().numpy()))
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, hook)
    x, y = (torch.from_numpy(t.array.astype(np.float32)) for t in _batch(rank))
    for _ in range(2):
        records.clear()
        model.zero_grad()
        _loss(ddp(x), y).backward()
    return sorted(records, key=lambda r: r["index"])


def test_gradbucket_is_reachable_under_torchs_name():
    from shoal.collectives.ddp.buckets import GradBucket

    assert dist.GradBucket is GradBucket
    assert {"index", "buffer", "gradients", "parameters", "is_last", "set_buffer"} <= set(
        vars(dist.GradBucket))


def test_a_hook_sees_the_buckets_torch_shows_its_hooks(job):
    """index(), is_last(), parameters(), gradients() and buffer() against torch's DDP on the
    same weights and batch; set_buffer() replaces what buffer() returns, and a hook that
    reduces its replacement buffer leaves the whole batch's gradient on every rank."""
    torch_td = pytest.importorskip("torch.distributed")
    torch_td.init_process_group("gloo", store=torch_td.HashStore(), rank=0, world_size=1)
    try:
        theirs = [_torch_bucket_records(rank) for rank in range(WORLD)]
    finally:
        torch_td.destroy_process_group()

    def body(rank):
        ddp = DistributedDataParallel(_chain(seed=rank), process_group=job.pgs[rank],
                                      bucket_cap_mb=_CAP_MB)
        params = list(ddp.module.parameters())
        records: list[dict] = []

        def hook(group, bucket: dist.GradBucket) -> dist.Future[Tensor]:
            records.append(_bucket_record(bucket, params, lambda t: t.array))
            averaged = bucket.buffer().array / group.size()
            bucket.set_buffer(averaged)
            assert np.shares_memory(bucket.buffer().array, averaged)
            with pytest.raises(ValueError, match=r"^Bucket \d holds \d+ elements of float32; a "
                                                 r"replacement buffer of shape \(3,\)"):
                bucket.set_buffer(np.zeros(3, np.float32))
            work = group.allreduce([bucket.buffer()])
            return work.get_future().then(lambda fut: fut.value()[0])

        ddp.register_comm_hook(job.pgs[rank], hook)
        x, y = _batch(rank)
        rounds = []
        for _ in range(2):
            records.clear()
            ddp.module.zero_grad()
            _loss(ddp(x), y).backward()
            rounds.append(sorted(records, key=lambda r: r["index"]))
        return rounds, [p.grad.array.copy() for p in params]

    want = _reference_grads(_chain)
    for rank, (rounds, grads) in enumerate(job.run(body)):
        for i, (g, w) in enumerate(zip(grads, want)):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=f"rank {rank} param {i}")
        assert [(r["params"], r["is_last"]) for r in theirs[rank]] == [([2, 1], False),
                                                                       ([0], True)]
        for round_no, ours in enumerate(rounds):
            assert len(ours) == len(theirs[rank]), (rank, round_no, ours)
            for mine, ref in zip(ours, theirs[rank]):
                where = f"rank {rank} round {round_no} bucket {ref['index']}"
                for key in ("index", "is_last", "params", "shapes", "buffer shape",
                            "views of the buffer", "buffer is the gradients end to end"):
                    assert mine[key] == ref[key], (where, key, mine[key], ref[key])
                for g, r in zip(mine["gradients"], ref["gradients"]):
                    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6, err_msg=where)
