"""The nccl backend's logic where NCCL is unavailable: ProcessGroupNCCL over a stand-in runtime.

The stand-in keeps NCCL's shape: "device" arrays (a numpy subclass) are touched only by work
queued on streams, each stream is a worker thread that runs its queue in order, events fire when
their stream reaches them, and a collective blocks its stream until every rank of the
communicator posted the same call (so a rank that never calls makes the others hang, as on a
GPU). What runs for real: ProcessGroupNCCL's ordering, staging of host arrays, Work and its
events, the bootstrap through a real store, the watchdog's diagnosis, aborts with a deadline,
async errors and the exit code. What it cannot show: cupy's pointer arithmetic and NCCL itself
(tests/gpu does, on a GPU).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import numpy as np
import pytest

from shoal.collectives.backends.nccl import bootstrap
from shoal.collectives.backends.nccl import runtime as nrt
from shoal.collectives.types import (
    ASYNC_ERROR_EXIT_CODE,
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    GroupDestroyed,
    ReduceOp,
)
from shoal.collectives.backends.nccl.group import ProcessGroupNCCL
from shoal.collectives.store.hash import HashStore
from shoal.core.errors import DeviceError, ShapeError
from tests.support.nccl_standin import Dev1, FakeRuntime, dev, new_worlds
from tests.support.threaded_ranks import form_groups
from tests.support.threaded_ranks import run_all as run_ranks

# ----------------------------------------------------------------------------- the stand-in


def eventually(predicate, within=5.0) -> bool:
    """True once `predicate()` holds, polling up to `within` seconds (the abort follows the error)."""
    end = time.monotonic() + within
    while not predicate():
        if time.monotonic() >= end:
            return False
        time.sleep(0.01)
    return True


def make_groups(world, timeout=10.0, version=22000, **kw):
    store, worlds = HashStore(), new_worlds()
    return form_groups(world, lambda r: ProcessGroupNCCL(
        store, r, world, timeout=timeout, device=r,
        runtime=FakeRuntime(worlds, version, device=r), **kw))


def run_all(pgs, fn, timeout=30.0):
    """As threaded_ranks.run_all, but a rank's exception fails the test."""
    out = run_ranks(pgs, fn, timeout)
    for r, v in enumerate(out):
        if isinstance(v, BaseException):
            raise AssertionError(f"rank {r} raised {v!r}") from v
    return out


@pytest.fixture
def trio():
    pgs = make_groups(3)
    yield pgs
    for pg in pgs:
        pg.shutdown()


@pytest.fixture(autouse=True)
def _dumps_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_DUMP_DIR", str(tmp_path))
    monkeypatch.delenv("SHOAL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)


# ----------------------------------------------------------------------------- results

def _data(r, shape=(3, 4), dtype=np.float32):
    return (np.arange(np.prod(shape)).reshape(shape) + 10 * r + 1).astype(dtype)


# NCCL >= 2.10 reduces AVG itself (the ProcessGroup contract covers that); older NCCL has no
# ncclAvg, and the backend sums then divides.
def test_reductions_match_numpy_on_device_and_host_arrays_before_nccl_avg():
    pgs = make_groups(3, version=20900)
    try:
        ref = [_data(r) for r in range(3)]
        expect = {ReduceOp.SUM: sum(ref), ReduceOp.PRODUCT: ref[0] * ref[1] * ref[2],
                  ReduceOp.MIN: np.minimum.reduce(ref), ReduceOp.MAX: np.maximum.reduce(ref),
                  ReduceOp.AVG: sum(ref) / 3}

        def body(pg, r):
            got = {}
            for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG):
                d, h = dev(_data(r)), _data(r)
                pg.all_reduce(d, op=op, async_op=True).synchronize()
                pg.all_reduce(h, op=op)  # host arrays: staged, and the call blocks
                got[op] = (np.array(d), h)
            red = dev(_data(r))
            pg.reduce(red, dst=1, op=ReduceOp.MAX, async_op=True).synchronize()
            return got, np.array(red)

        out = run_all(pgs, body)
        for r, (got, red) in enumerate(out):
            for op, (d, h) in got.items():
                np.testing.assert_allclose(d, expect[op], rtol=1e-6, err_msg=f"{op} device r{r}")
                np.testing.assert_allclose(h, expect[op], rtol=1e-6, err_msg=f"{op} host r{r}")
            np.testing.assert_array_equal(red, expect[ReduceOp.MAX] if r == 1 else _data(r))
    finally:
        for pg in pgs:
            pg.shutdown()


def test_work_numbering_callbacks_and_history(trio):
    def body(pg, r):
        seen = []
        works = [pg.all_reduce(dev(np.ones(8, np.float32)), async_op=True) for _ in range(4)]
        works[-1].add_done_callback(lambda w: seen.append(w.seq))
        for w in works:
            w.synchronize()
        late = []
        works[0].add_done_callback(lambda w: late.append(w.seq))  # already done: runs at once
        return [w.seq for w in works], seen, late, [w.is_success() for w in works], \
            [rec.state for rec in pg.ledger.history]

    for seqs, seen, late, ok, states in run_all(trio, body):
        assert seqs == [1, 2, 3, 4] and seen == [4] and late == [1] and all(ok)
        assert states == ["completed"] * 4


def test_callbacks_run_in_the_callers_thread_not_the_watchdogs():
    pg = make_groups(1)[0]
    try:
        threads = []
        work = pg.all_reduce(dev(np.ones(3)), async_op=True)
        work.add_done_callback(lambda w: threads.append(threading.current_thread().name))
        end = time.monotonic() + 5
        while not work.done and time.monotonic() < end:  # the watchdog finishes it...
            time.sleep(0.01)
        assert work.done and threads == []  # ...but leaves the callback to a caller
        assert work.is_completed()
        assert threads == [threading.current_thread().name]
    finally:
        pg.shutdown()


# ----------------------------------------------------------------------------- validation

def test_bad_calls_are_refused_before_anything_runs(trio):
    pg = trio[0]
    with pytest.raises(ValueError, match="cannot receive from any rank"):
        pg.recv(np.zeros(2), src=None)
    with pytest.raises(TypeError, match="all_reduce: NCCL cannot reduce int16 arrays"):
        pg.all_reduce(np.zeros(2, np.int16))
    with pytest.raises(TypeError, match="complex arrays \\(complex64\\) with SUM and AVG only, not PRODUCT"):
        pg.all_reduce(np.zeros(2, np.complex64), op=ReduceOp.PRODUCT)
    with pytest.raises(DeviceError, match="array on cuda:99, but rank 0's nccl group 'default' runs on cuda:0"):
        pg.all_reduce(dev(np.zeros(2), Dev1))
    with pytest.raises(ShapeError, match="own block must keep its size"):
        pg.all_to_all([np.zeros(1)] * 3, [np.zeros(2)] * 3)
    assert pg.ledger.seq == 0  # nothing was numbered, so the ranks stay in step


def test_reduce_spec_table():
    v = 22000
    assert nrt.reduce_spec(np.float32, ReduceOp.SUM, v) == nrt.WireSpec(7, 1, nrt.NCCL_SUM, False)
    assert nrt.reduce_spec(np.bool_, ReduceOp.SUM, v).op == nrt.NCCL_MAX
    assert nrt.reduce_spec(np.bool_, ReduceOp.PRODUCT, v).op == nrt.NCCL_MIN
    assert nrt.reduce_spec(np.complex128, ReduceOp.AVG, v) == nrt.WireSpec(8, 2, nrt.NCCL_AVG, False)
    assert nrt.reduce_spec(np.float16, ReduceOp.AVG, 20900) == nrt.WireSpec(6, 1, nrt.NCCL_SUM, True)
    with pytest.raises(TypeError, match="cannot reduce uint16"):
        nrt.reduce_spec(np.uint16, ReduceOp.MAX, v)
    uid = bytes(range(64)) + bytes(range(192, 256))
    signed = nrt.unique_id_from_bytes(uid)
    assert min(signed) == -64 and max(signed) == 63  # signed chars, as cupy hands them out
    assert nrt.unique_id_to_bytes(signed) == uid
    with pytest.raises(ValueError, match="has 128 bytes, but the store held 3"):
        nrt.unique_id_from_bytes(b"abc")


# ----------------------------------------------------------------------------- forming the group

def test_init_names_the_rank_that_never_arrived():
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="Rank 0 of nccl group 'default' waited .*rank 1 never arrived"):
        ProcessGroupNCCL(HashStore(), 0, 2, timeout=0.5, runtime=FakeRuntime(new_worlds()))
    assert time.monotonic() - t0 < 4


def test_init_stuck_inside_nccl_is_bounded():
    # Rank 1 announces itself in the store (the real bootstrap calls) but never reaches NCCL.
    store = HashStore()
    prefix = bootstrap.join_generation(store, "default", 1, 2)
    bootstrap.announce(store, prefix, 1, device=1)
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="in ncclCommInitRank for the other 1 rank"):
        ProcessGroupNCCL(store, 0, 2, timeout=0.5, device=0, runtime=FakeRuntime(new_worlds()))
    assert time.monotonic() - t0 < 4


def test_two_ranks_on_one_gpu_are_refused():
    store, worlds, errors = HashStore(), new_worlds(), []

    def join(r):
        try:
            ProcessGroupNCCL(store, r, 2, timeout=5, device=0, runtime=FakeRuntime(worlds))
        except CollectiveError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(errors) == 2 and all("Ranks 0 and 1 of nccl group 'default' both use CUDA device 0" in e
                                    for e in errors)


def test_local_rank_picks_the_device(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    pg = ProcessGroupNCCL(HashStore(), 0, 1, timeout=5, runtime=FakeRuntime(new_worlds()))
    assert pg.device == 1
    pg.shutdown()
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(DeviceError, match="given CUDA device 5 \\(from LOCAL_RANK\\), but this machine has 4"):
        ProcessGroupNCCL(HashStore(), 0, 1, timeout=5, runtime=FakeRuntime(new_worlds()))


# ----------------------------------------------------------------------------- the watchdog

def test_timeout_names_the_missing_rank_aborts_and_fails_later_calls(tmp_path):
    pgs = make_groups(2, timeout=10)
    try:
        t0 = time.monotonic()
        work = pgs[0].all_reduce(dev(np.ones(4, np.float32)), async_op=True, timeout=0.5)
        with pytest.raises(CollectiveTimeout, match=r"Rank 0 timed out after 0.5s in all_reduce #1 "
                           r"of group 'default': rank 1 never arrived\. This rank's recent "
                           r"collectives are in .*shoal-collectives-default-rank0"):
            work.synchronize()
        assert time.monotonic() - t0 < 5
        assert pgs[0].failed and eventually(lambda: pgs[0].runtime.comm.aborted)
        assert list(tmp_path.glob("shoal-collectives-default-rank0-*.json"))
        with pytest.raises(CollectiveError, match="all_reduce cannot run: nccl group 'default' failed earlier: rank 0 timed out"):
            pgs[0].all_reduce(np.ones(1))
    finally:
        for pg in pgs:
            pg.shutdown()


def test_mismatched_collectives_are_named():
    pgs = make_groups(2, timeout=10)
    try:
        out = run_all(pgs, lambda pg, r: pg.all_reduce(dev(np.ones(4)), async_op=True, timeout=1.0)
                      if r == 0 else pg.broadcast(dev(np.ones(4)), src=0, async_op=True, timeout=30))
        with pytest.raises(CollectiveMismatch, match=r"rank 1 called broadcast\(float64\[4\], src=0\) "
                           r"as collective #1 but this rank called all_reduce\(float64\[4\], op=SUM\)"):
            out[0].synchronize()
    finally:
        for pg in pgs:
            pg.shutdown()


def test_unmatched_recv_times_out_and_an_abort_that_hangs_is_given_up():
    pgs = make_groups(2, timeout=10, abort_timeout=0.3)
    try:
        pgs[0].runtime.comm.abort_hangs = True
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeout, match=r"Rank 0 timed out after 0.5s in recv p2p#1 of "
                           r"group 'default': its point-to-point peer never matched it"):
            pgs[0].recv(dev(np.zeros(3)), src=1, async_op=True, timeout=0.5).synchronize()
        assert time.monotonic() - t0 < 0.5 + 0.3 + 3
        assert not pgs[0].runtime.comm.aborted  # the abort never returned; we went on without it
    finally:
        for pg in pgs:
            pg.shutdown()


def test_async_error_fails_outstanding_work():
    pgs = make_groups(2, timeout=30)
    try:
        works = [pgs[0].all_reduce(dev(np.ones(4)), async_op=True) for _ in range(2)]
        pgs[0].runtime.comm.async_err = "NCCL_ERROR_SYSTEM_ERROR: unhandled system error"
        for seq, w in enumerate(works, 1):
            with pytest.raises(CollectiveError, match=f"Rank 0's all_reduce #{seq} of group 'default' "
                               "failed: NCCL reported an asynchronous error on rank 0: "
                               "NCCL_ERROR_SYSTEM_ERROR.*the NCCL communicator was aborted"):
                w.synchronize(timeout=5)
        assert eventually(lambda: pgs[0].runtime.comm.aborted)
    finally:
        for pg in pgs:
            pg.shutdown()


def test_destroyed_group_refuses_and_fails_pending_work():
    pgs = make_groups(2, timeout=30)
    work = pgs[0].all_reduce(dev(np.ones(2)), async_op=True)
    pgs[0].shutdown()
    with pytest.raises(GroupDestroyed, match="destroyed while this collective was still running"):
        work.synchronize(timeout=5)
    with pytest.raises(GroupDestroyed, match="after it was destroyed"):
        pgs[0].all_reduce(np.ones(2))
    pgs[1].shutdown()
    assert pgs[1]._comm is None


def _exit_code_child(dump_dir):
    os.environ["SHOAL_ASYNC_ERROR_HANDLING"] = "1"
    os.environ["SHOAL_DUMP_DIR"] = dump_dir
    pgs = make_groups(2, timeout=30)
    pgs[0].all_reduce(dev(np.ones(4)), async_op=True, timeout=0.5)
    time.sleep(30)  # the watchdog ends the process long before this
    os._exit(3)


def test_async_error_handling_ends_the_process_with_its_exit_code(tmp_path):
    proc = multiprocessing.get_context("spawn").Process(target=_exit_code_child, args=(str(tmp_path),))
    proc.start()
    proc.join(25)
    if proc.is_alive():
        proc.kill()
        pytest.fail("the rank with SHOAL_ASYNC_ERROR_HANDLING=1 did not end within 25s")
    assert proc.exitcode == ASYNC_ERROR_EXIT_CODE, f"exit code {proc.exitcode}"
    assert list(tmp_path.glob("shoal-collectives-default-rank0-*.json"))


# ----------------------------------------------------------------------------- DDP on this backend

def test_ddp_over_the_nccl_backend_matches_one_process_on_the_whole_batch():
    from shoal import core
    from shoal.collectives.ddp import comm_hooks
    from shoal.collectives.ddp.ddp import DistributedDataParallel
    from shoal.core import nn
    from shoal.core.tensor import Tensor

    def model(seed):
        core.manual_seed(seed)
        return nn.Sequential(nn.Linear(6, 16, dtype=core.float64), nn.Tanh(),
                             nn.Linear(16, 3, dtype=core.float64))

    def batch(step, rank):
        rng = np.random.default_rng([step, rank])
        return Tensor(rng.standard_normal((4, 6))), Tensor(rng.standard_normal((4, 3)))

    def loss(out, y, scale=1.0):
        d = out - y
        return (d * d).mean() * scale

    def train(pg, rank, hook, m):
        ddp = DistributedDataParallel(m, process_group=pg, bucket_cap_mb=0.0005)
        if hook:
            ddp.register_comm_hook(pg, getattr(comm_hooks, hook))
        opt = core.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            opt.zero_grad()
            x, y = batch(step, rank)
            loss(ddp(x), y).backward()
            opt.step()
        assert len(ddp.bucket_indices) > 1
        return [np.array(p.array) for p in m.parameters()]

    ref = model(0)
    opt = core.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        opt.zero_grad()
        for r in range(2):
            x, y = batch(step, r)
            loss(ref(x), y, 0.5).backward()
        opt.step()
    for hook, tol in ((None, 1e-12), ("fp16_compress_hook", 2e-3)):
        # Built here, one after the other: seeding is process-wide. DDP broadcasts rank 0's.
        models = [model(seed=r) for r in range(2)]
        pgs = make_groups(2)
        try:
            finals = run_all(pgs, lambda pg, r: train(pg, r, hook, models[r]))
        finally:
            for pg in pgs:
                pg.shutdown()
        for final in finals:
            for i, (p, q) in enumerate(zip(ref.parameters(), final)):
                np.testing.assert_allclose(q, np.array(p.array), rtol=tol, atol=tol,
                                           err_msg=f"{hook} parameter {i}")
