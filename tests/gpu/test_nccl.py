"""The nccl backend on real GPUs, against numpy: every collective at world size 1 on one GPU
(in place and out of place, device and host arrays, Work and stream semantics), and the whole
catalogue at world size 2 in spawned processes where the machine has two GPUs."""

from __future__ import annotations

import multiprocessing
import queue
import traceback

import numpy as np
import pytest

from shoal.collectives.types import ReduceOp
from shoal.collectives.store.hash import HashStore

cp = pytest.importorskip("cupy")
CTX = multiprocessing.get_context("spawn")


def _device_count() -> int:
    try:
        return cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001
        return 0


# ----------------------------------------------------------------------------- spawned ranks

def _child(target, rank, world, port, args, out):
    try:
        out.put((rank, "ok", target(rank, world, port, *args)))
    except BaseException as exc:  # noqa: BLE001  (the parent reports it with the rank)
        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_ranks(target, world, args=(), timeout=90.0, env=None):
    """Run `target(rank, world, store_port, *args)` in `world` spawned processes; their results.

    The test process hosts the TCPStore (bound to port 0, reported back); a rank that raises,
    exits early or outlives `timeout` fails the test naming the rank and its exit code.
    """
    import os

    from shoal.collectives.store.tcp import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=30,
                     wait_for_workers=False)
    out = CTX.Queue()
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        procs = [CTX.Process(target=_child, args=(target, r, world, store.port, args, out), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    results: dict = {}
    try:
        while len(results) < world:
            try:
                rank, status, value = out.get(timeout=timeout)
            except queue.Empty:
                codes = {r: p.exitcode for r, p in enumerate(procs)}
                missing = sorted(set(range(world)) - set(results))
                pytest.fail(f"ranks {missing} sent no result within {timeout:g}s (exit codes {codes})")
            if status == "error":
                pytest.fail(f"rank {rank} failed: {value}")
            results[rank] = value
        for r, p in enumerate(procs):
            p.join(30)
            assert not p.is_alive(), f"rank {r} did not exit"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        store.close()
    return [results[r] for r in range(world)]


# ----------------------------------------------------------------------------- world size 1

@pytest.fixture
def pg():
    from shoal.collectives.backends.nccl.group import ProcessGroupNCCL

    group = ProcessGroupNCCL(HashStore(), 0, 1, timeout=30, device=0)
    yield group
    group.shutdown()


REDUCIBLE = [np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8, np.bool_,
             np.complex64]


@pytest.mark.parametrize("dtype", REDUCIBLE)
def test_all_reduce_every_op_at_world_one(pg, dtype):
    rng = np.random.default_rng(0)
    ref = (rng.standard_normal((33, 7)) * 4).astype(dtype)
    for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG):
        if op is ReduceOp.AVG and np.dtype(dtype).kind not in "fc":
            continue
        if np.dtype(dtype).kind == "c" and op not in (ReduceOp.SUM, ReduceOp.AVG):
            continue
        d = cp.asarray(ref)
        pg.all_reduce(d, op=op, async_op=True).synchronize()
        np.testing.assert_array_equal(cp.asnumpy(d), ref, err_msg=f"{op} on {np.dtype(dtype)}")
        h = ref.copy()
        pg.all_reduce(h, op=op)  # a host array: staged through pinned memory, the call blocks
        np.testing.assert_array_equal(h, ref)


def test_data_movement_at_world_one(pg):
    x = cp.arange(24, dtype=cp.float32).reshape(4, 6)
    pg.broadcast(x, src=0)
    outs = [cp.zeros((4, 6), cp.float32)]
    pg.all_gather(outs, x)
    into = cp.zeros((1, 4, 6), cp.float32)
    pg.all_gather_into_tensor(into, x)
    host_outs = [np.zeros((4, 6), np.float32)]
    pg.all_gather(host_outs, cp.asnumpy(x))
    rs = cp.zeros(6, cp.float64)
    pg.reduce_scatter(rs, [cp.arange(6, dtype=cp.float64)])
    a2a = [cp.zeros(5, cp.int64)]
    pg.all_to_all(a2a, [cp.arange(5, dtype=cp.int64)])
    gathered = [cp.zeros(3, cp.int32)]
    pg.gather(cp.array([1, 2, 3], cp.int32), gathered, dst=0)
    scattered = cp.zeros(2, cp.float16)
    pg.scatter(scattered, [cp.array([0.5, 1.5], cp.float16)], src=0)
    red = cp.full(4, 3.0)
    pg.reduce(red, dst=0, op=ReduceOp.MAX)
    cp.cuda.get_current_stream().synchronize()  # wait() ordered the stream; now the host reads
    expect = np.arange(24, dtype=np.float32).reshape(4, 6)
    np.testing.assert_array_equal(cp.asnumpy(x), expect)
    np.testing.assert_array_equal(cp.asnumpy(outs[0]), expect)
    np.testing.assert_array_equal(cp.asnumpy(into[0]), expect)
    np.testing.assert_array_equal(host_outs[0], expect)
    np.testing.assert_array_equal(cp.asnumpy(rs), np.arange(6.0))
    np.testing.assert_array_equal(cp.asnumpy(a2a[0]), np.arange(5))
    np.testing.assert_array_equal(cp.asnumpy(gathered[0]), [1, 2, 3])
    np.testing.assert_array_equal(cp.asnumpy(scattered), [0.5, 1.5])
    np.testing.assert_array_equal(cp.asnumpy(red), np.full(4, 3.0))
    pg.barrier()
    assert pg.all_gather_object({"a": 1}) == [{"a": 1}]
    pg.monitored_barrier(timeout=5)


def test_work_orders_the_callers_stream_and_synchronizes_the_host(pg):
    from shoal.core.tensor import Tensor

    n = 1 << 22
    x = cp.ones(n, cp.float32)
    t = Tensor(cp.full(8, 2.0, cp.float32))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x *= 3  # produced on a side stream: the group's stream must wait for it
        work = pg.all_reduce(x, op=ReduceOp.AVG, async_op=True)
        work.wait()  # the caller's stream now waits for the collective; the host does not
        y = x + 1
    done = []
    work.add_done_callback(lambda w: done.append(w.seq))
    work.synchronize(timeout=30)
    stream.synchronize()
    assert work.is_completed() and work.is_success() and work.exception() is None
    assert done == [work.seq]
    np.testing.assert_array_equal(cp.asnumpy(y[:4]), [4.0] * 4)
    assert pg.all_reduce(t, async_op=True).result() == [t]  # core.Tensors work in place
    seqs = [rec.seq for rec in pg.ledger.history]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_refusals(pg):
    from shoal.core.errors import DeviceError

    with pytest.raises(TypeError, match="NCCL cannot reduce int16"):
        pg.all_reduce(cp.zeros(3, cp.int16))
    if _device_count() > 1:
        with cp.cuda.Device(1):
            other = cp.zeros(3)
        with pytest.raises(DeviceError, match="array on cuda:1, but rank 0's nccl group"):
            pg.all_reduce(other)


def test_init_process_group_nccl_at_world_one():
    from shoal import collectives

    pg = collectives.init_process_group("nccl", store=HashStore(), rank=0, world_size=1, timeout=30)
    try:
        x = cp.arange(4, dtype=cp.float32)
        collectives.all_reduce(x)
        assert collectives.get_backend() == "nccl"
        np.testing.assert_array_equal(cp.asnumpy(x), np.arange(4))
        assert pg.device == cp.cuda.Device().id
    finally:
        collectives.destroy_process_group()


# ----------------------------------------------------------------------------- world size 2

def _catalogue(rank, world, port):
    import cupy as cp
    import numpy as np

    from shoal.collectives.types import ReduceOp as Op
    from shoal.collectives.backends.nccl.group import ProcessGroupNCCL
    from shoal.collectives.store.tcp import TCPStore

    store = TCPStore("127.0.0.1", port, is_master=False, timeout=30)
    pg = ProcessGroupNCCL(store, rank, world, timeout=30, device=rank)
    res = {}
    x = cp.arange(6, dtype=cp.float32) + 10 * rank
    for op in Op:
        y = x.copy()
        pg.all_reduce(y, op=op)
        res[op.name] = cp.asnumpy(y)
    b = cp.full(3, rank, cp.int64)
    pg.broadcast(b, src=1)
    outs = [cp.zeros(6, cp.float32) for _ in range(world)]
    pg.all_gather(outs, x)
    rs = cp.zeros(2, cp.float32)
    pg.reduce_scatter(rs, [cp.full(2, 10.0 * rank + q, cp.float32) for q in range(world)])
    a2a = [cp.zeros(2, cp.int32) for _ in range(world)]
    pg.all_to_all(a2a, [cp.array([rank, q], cp.int32) for q in range(world)])
    g = [cp.zeros(1) for _ in range(world)] if rank == 0 else None
    pg.gather(cp.array([rank * 2.0]), g, dst=0)
    s = cp.zeros(1)
    pg.scatter(s, [cp.array([q + 0.5]) for q in range(world)] if rank == 1 else None, src=1)
    ring = cp.zeros(4)
    peer = 1 - rank
    if rank == 0:
        pg.send(cp.full(4, 7.0), dst=peer)
        pg.recv(ring, src=peer)
    else:
        pg.recv(ring, src=peer)
        pg.send(cp.full(4, 9.0), dst=peer)
    host = np.full(3, rank + 1.0)
    pg.all_reduce(host, op=Op.PRODUCT)
    pg.barrier()
    objs = pg.all_gather_object({"rank": rank})
    cp.cuda.get_current_stream().synchronize()
    res.update(b=cp.asnumpy(b), outs=[cp.asnumpy(o) for o in outs], rs=cp.asnumpy(rs),
               a2a=[cp.asnumpy(o) for o in a2a], g=None if g is None else [cp.asnumpy(v) for v in g],
               s=cp.asnumpy(s), ring=cp.asnumpy(ring), host=host, objs=objs)
    pg.shutdown()
    store.close()
    return res


@pytest.mark.skipif(_device_count() < 2, reason="needs two GPUs (NCCL wants one device per rank)")
def test_catalogue_at_world_two_matches_numpy():
    out = run_ranks(_catalogue, 2)
    xs = [np.arange(6, dtype=np.float32) + 10 * r for r in range(2)]
    expect = {"SUM": xs[0] + xs[1], "PRODUCT": xs[0] * xs[1], "MIN": np.minimum(*xs),
              "MAX": np.maximum(*xs), "AVG": (xs[0] + xs[1]) / 2}
    for r, res in enumerate(out):
        for name, value in expect.items():
            np.testing.assert_allclose(res[name], value, rtol=1e-6, err_msg=f"{name} rank {r}")
        np.testing.assert_array_equal(res["b"], [1, 1, 1])
        for q in range(2):
            np.testing.assert_array_equal(res["outs"][q], xs[q])
            np.testing.assert_array_equal(res["a2a"][q], [q, r])
        np.testing.assert_array_equal(res["rs"], [10.0 + 2 * r] * 2)
        if r == 0:
            np.testing.assert_array_equal(np.concatenate(res["g"]), [0.0, 2.0])
        np.testing.assert_array_equal(res["s"], [r + 0.5])
        np.testing.assert_array_equal(res["ring"], [9.0 if r == 0 else 7.0] * 4)
        np.testing.assert_array_equal(res["host"], [2.0] * 3)
        assert res["objs"] == [{"rank": 0}, {"rank": 1}]
