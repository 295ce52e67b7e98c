"""The collectives torch has and shoal composes (ProcessGroup methods, ranks as threads over
real tcp groups): reference values from numpy, exact error messages for bad input. The same
calls are compared with torch's gloo in tests/multiproc/test_torch_names.py."""

from __future__ import annotations

import datetime

import numpy as np
import pytest

import shoal.collectives as dist
from shoal.collectives import ProcessGroupTCP
from shoal.core.errors import ShapeError
from shoal.core.tensor import Tensor
from tests.support.thread_world import ThreadWorld

pytestmark = pytest.mark.timeout(60)
W = 3


def _make_group(store, rank, size, *, name, global_ranks, timeout):
    return ProcessGroupTCP(store, rank, size, timeout=timeout, name=name, global_ranks=global_ranks)


@pytest.fixture(scope="module")
def job():
    world = ThreadWorld(_make_group, W)
    yield world
    world.close()


def test_bitwise_and_premul_reductions(job):
    data = [np.array([0b1100 + r, 0b1010 * (r + 1), 7 - r], np.int64) for r in range(W)]

    def body(r):
        pg = job.pgs[r]
        got = {}
        for name, uf in (("BAND", np.bitwise_and), ("BOR", np.bitwise_or), ("BXOR", np.bitwise_xor)):
            x = data[r].copy()
            pg.all_reduce(x, op=getattr(dist.ReduceOp, name))
            got[name] = (x, uf.reduce(data))
        f = np.arange(4.0) + r
        pg.all_reduce(f, op=dist.make_premul_sum(0.25))
        got["premul"] = (f, sum(np.arange(4.0) + q for q in range(W)) * 0.25)
        keep = np.arange(4.0) + r
        pg.reduce(keep, dst=1, op=dist.make_premul_sum(2.0))
        got["premul reduce"] = (keep, sum(np.arange(4.0) + q for q in range(W)) * 2.0
                                if r == 1 else np.arange(4.0) + r)  # the others keep theirs
        with pytest.raises(ValueError, match="^Cannot use ReduceOp.BAND with non-integral dtype float64"):
            pg.all_reduce(np.ones(2), op=dist.ReduceOp.BAND)
        with pytest.raises(ValueError, match=r"^ReduceOp.PREMUL_SUM needs its factor: pass "
                                             r"collectives.make_premul_sum\(factor\)"):
            pg.all_reduce(np.ones(2), op=dist.ReduceOp.PREMUL_SUM)
        with pytest.raises(ValueError, match="^ReduceOp.PREMUL_SUM needs a floating-point dtype, got int64"):
            pg.all_reduce(np.ones(2, np.int64), op=dist.make_premul_sum(2))
        return got

    for r, got in enumerate(job.run(body)):
        for name, (have, want) in got.items():
            np.testing.assert_allclose(have, want, err_msg=f"rank {r} {name}")


def test_single_tensor_forms_and_their_errors(job):
    def body(r):
        pg = job.pgs[r]
        inp = (np.arange(W * 2 * 2, dtype=np.float32).reshape(W * 2, 2) + 100 * r)
        out = np.empty_like(inp)
        pg.all_to_all_single(out, inp)
        want = np.concatenate([(np.arange(W * 2 * 2, dtype=np.float32).reshape(W * 2, 2)
                                + 100 * q)[2 * r:2 * r + 2] for q in range(W)])
        np.testing.assert_array_equal(out, want)
        big = np.arange(W * 4, dtype=np.float64) * (r + 1)
        mine = np.empty(4)
        pg.reduce_scatter_tensor(mine, big)
        total = sum(np.arange(W * 4, dtype=np.float64) * (q + 1) for q in range(W))
        np.testing.assert_array_equal(mine, total[4 * r:4 * r + 4])
        with pytest.raises(ShapeError, match=r"^reduce_scatter_tensor input is float64\[5\] but must "
                                             r"hold 3 x float64\[4\]"):
            pg.reduce_scatter_tensor(mine, np.ones(5))
        with pytest.raises(ValueError, match=r"^all_to_all_single output has 4 rows, which do not "
                                             r"split evenly over 3 ranks"):
            pg.all_to_all_single(np.empty((4, 2)), np.empty((4, 2)))
        with pytest.raises(ValueError, match=r"^all_to_all_single input split sizes must be 3 "
                                             r"non-negative row counts summing to 4, got \[1, 1\]"):
            pg.all_to_all_single(np.empty((4, 2)), np.empty((4, 2)), [2, 1, 1], [1, 1])

    job.run(body)


def test_torch_style_methods_return_works_with_futures(job):
    def body(r):
        pg = job.pgs[r]
        t = Tensor(np.arange(3.0) + r)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        opts.timeout = datetime.timedelta(seconds=20)
        fut = pg.allreduce([t], opts).get_future()
        value = fut.wait(timeout=20)
        assert isinstance(fut, dist.Future) and value[0] is t
        np.testing.assert_array_equal(t.array, np.arange(3.0) + W - 1)
        outs = [np.empty(2) for _ in range(W)]
        pg.allgather([outs], [np.full(2, float(r))]).wait()
        assert [o.tolist() for o in outs] == [[float(q)] * 2 for q in range(W)]
        chained = pg.allreduce([np.ones(2)]).get_future().then(lambda f: f.value()[0] * 10)
        np.testing.assert_array_equal(chained.wait(timeout=20), np.full(2, 10.0 * W))
        parts = [np.arange(3.0) * r, np.ones((2, 2), np.float32) * r, np.array([r], np.int64)]
        pg.allreduce(parts)  # several tensors: coalesced
        total = sum(range(W))
        assert parts[0].tolist() == (np.arange(3.0) * total).tolist()
        assert parts[1].dtype == np.float32 and parts[1].tolist() == [[total] * 2] * 2
        assert parts[2].tolist() == [total]
        with pytest.raises(TypeError, match="AllreduceOptions has no option 'rootRank'"):
            dist.AllreduceOptions(rootRank=0)

    job.run(body)


def test_object_collectives_on_a_group(job):
    def body(r):
        pg = job.pgs[r]
        got = [None] * W if r == 2 else None
        pg.gather_object({"r": r, "pad": "z" * r * 50}, got, dst=2)
        if r == 2:
            assert got == [{"r": q, "pad": "z" * q * 50} for q in range(W)]
        out = [None]
        pg.scatter_object_list(out, [("to", q, [0] * q) for q in range(W)] if r == 0 else None, src=0)
        assert out == [("to", r, [0] * r)]
        if r == 1:
            with pytest.raises(ValueError, match="^gather_object needs an object_gather_list of 3 slots"):
                pg.gather_object(1, [None], dst=1)

    job.run(body)


def test_torch_list_forms_of_the_rooted_methods(job):
    def body(r):
        pg = job.pgs[r]
        b = np.full(2, float(r))
        pg.broadcast([b], dist.BroadcastOptions(rootRank=2)).get_future().wait(timeout=20)
        assert b.tolist() == [2.0, 2.0]
        red = np.full(2, float(r + 1))
        opts = dist.ReduceOptions(rootRank=1, reduceOp=dist.ReduceOp.PRODUCT)
        pg.reduce([red], opts).wait()
        assert red.tolist() == ([6.0, 6.0] if r == 1 else [r + 1.0] * 2)
        outs = [[np.empty(1) for _ in range(W)]] if r == 0 else []
        pg.gather(outs, [np.array([10.0 * r])], dist.GatherOptions(rootRank=0)).wait()
        if r == 0:
            assert [o.tolist() for o in outs[0]] == [[0.0], [10.0], [20.0]]
        got = np.empty(1)
        ins = [[np.array([100.0 + q]) for q in range(W)]] if r == 1 else []
        pg.scatter([got], ins, dist.ScatterOptions(rootRank=1)).wait()
        assert got.tolist() == [100.0 + r]
        mine = np.empty(2)
        pg.reduce_scatter([mine], [[np.full(2, float(q + r)) for q in range(W)]],
                          dist.ReduceScatterOptions(reduceOp=dist.ReduceOp.MAX)).wait()
        assert mine.tolist() == [float(r + W - 1)] * 2
        with pytest.raises(ValueError, match="broadcast takes a list of one tensor on the host, got 2"):
            pg.broadcast([b, b], dist.BroadcastOptions())

    job.run(body)


def _future_value(work):
    """The value of `work.get_future()`, which must be a collectives.Future that completes."""
    fut = work.get_future()
    assert isinstance(fut, dist.Future)
    return fut.wait(timeout=20)


def test_allreduce_coalesced_reduces_each_tensor_and_its_future_holds_them(job):
    """torch's pg.allreduce_coalesced(tensors, opts): every tensor reduced in place (mixed
    dtypes and shapes), the Future's value the list of those tensors, as gloo's."""
    def body(r):
        pg = job.pgs[r]
        parts = [np.arange(3.0) * (r + 1), Tensor(np.full((2, 2), r + 1.0, np.float32)),
                 np.array([r, -r], np.int64)]
        opts = dist.AllreduceCoalescedOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        value = _future_value(pg.allreduce_coalesced(parts, opts))
        assert len(value) == 3 and all(v is p for v, p in zip(value, parts))
        np.testing.assert_array_equal(parts[0], np.arange(3.0) * W)
        assert parts[1].array.dtype == np.float32 and parts[1].array.tolist() == [[W * 1.0] * 2] * 2
        assert parts[2].tolist() == [W - 1, 0]
        summed = [np.ones(2) * r, np.arange(2, dtype=np.int32) + r]
        _future_value(pg.allreduce_coalesced(summed))  # no opts: SUM, as torch's default
        total = sum(range(W))
        assert summed[0].tolist() == [total] * 2 and summed[1].tolist() == [total, total + W]

    job.run(body)


def test_allgather_base_fills_the_output_rank_by_rank(job):
    def body(r):
        pg = job.pgs[r]
        out = np.empty((W, 2, 2), np.float32)
        mine = np.arange(4, dtype=np.float32).reshape(2, 2) + 10 * r
        value = _future_value(pg._allgather_base(out, mine))
        want = np.stack([np.arange(4, dtype=np.float32).reshape(2, 2) + 10 * q for q in range(W)])
        np.testing.assert_array_equal(out, want)
        # gloo's future holds the output's per-rank blocks, nccl's the output itself: both
        # concatenate to the gathered values
        np.testing.assert_array_equal(np.concatenate([np.asarray(v).reshape(-1) for v in value]),
                                      want.reshape(-1))
        with pytest.raises(ShapeError, match=r"^all_gather_into_tensor output is float32\[5\] "
                                             r"but must hold 3 x float32\[2, 2\]"):
            pg._allgather_base(np.empty(5, np.float32), mine)

    job.run(body)


def test_reduce_scatter_base_leaves_each_rank_its_reduced_block(job):
    def body(r):
        pg = job.pgs[r]
        big = np.arange(W * 2, dtype=np.float64) * (r + 1)
        mine = np.empty(2)
        value = _future_value(pg._reduce_scatter_base(mine, big))
        total = sum(np.arange(W * 2, dtype=np.float64) * (q + 1) for q in range(W))
        np.testing.assert_array_equal(mine, total[2 * r:2 * r + 2])
        assert value[0] is mine
        low = np.empty(2)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        pg._reduce_scatter_base(low, big, opts).wait()
        np.testing.assert_array_equal(low, np.arange(W * 2, dtype=np.float64)[2 * r:2 * r + 2])

    job.run(body)


def test_alltoall_sends_block_j_to_rank_j(job):
    def body(r):
        pg = job.pgs[r]
        ins = [np.full(2, 10.0 * r + j) for j in range(W)]
        outs = [np.empty(2) for _ in range(W)]
        value = _future_value(pg.alltoall(outs, ins, dist.AllToAllOptions()))
        assert [o.tolist() for o in outs] == [[10.0 * q + r] * 2 for q in range(W)]
        assert len(value) == W and all(v is o for v, o in zip(value, outs))
        with pytest.raises(TypeError, match=r"^all_to_all output_list\[0\] is float32\[2\] but "
                                            r"input_list\[0\] is float64\[2\]"):
            pg.alltoall([np.empty(2, np.float32) for _ in range(W)], ins)
        # result=: the Work and its Future hold what the caller names (all_to_all_single's
        # whole output tensor), while the blocks still land in output_list.
        whole = np.empty(2 * W)
        views = [whole[2 * q:2 * q + 2] for q in range(W)]
        work = pg.all_to_all(views, ins, result=[whole])
        assert len(work.result()) == 1 and work.result()[0] is whole
        assert _future_value(work)[0] is whole
        assert whole.tolist() == [10.0 * q + r for q in range(W) for _ in range(2)]
        with pytest.raises(TypeError, match=r"^all_to_all result must be a list of what the Work "
                                            r"should hold, got ndarray\.$"):
            pg.all_to_all(views, ins, result=whole)

    job.run(body)


def test_alltoall_base_with_uneven_splits(job):
    """Rank r sends (r + j + 1) rows to rank j; rank j receives (q + j + 1) rows from each q."""
    def rows(q):
        return sum(q + j + 1 for j in range(W))

    def payload(q):
        return np.arange(rows(q) * 2, dtype=np.float32).reshape(rows(q), 2) + 1000 * q

    def body(r):
        pg = job.pgs[r]
        in_splits = [r + j + 1 for j in range(W)]
        out_splits = [q + r + 1 for q in range(W)]
        out = np.empty((sum(out_splits), 2), np.float32)
        value = _future_value(pg.alltoall_base(out, payload(r), out_splits, in_splits))
        want = []
        for q in range(W):
            start = sum(q + j + 1 for j in range(r))
            want.append(payload(q)[start:start + q + r + 1])
        np.testing.assert_array_equal(out, np.concatenate(want))
        assert len(value) == 1 and value[0] is out
        even_in = np.arange(W * 2, dtype=np.int64) + 100 * r
        even_out = np.empty(W * 2, np.int64)
        pg.alltoall_base(even_out, even_in, [], []).wait()  # empty splits: equal blocks
        assert even_out.tolist() == [x for q in range(W) for x in (100 * q + 2 * r,
                                                                   100 * q + 2 * r + 1)]
        with pytest.raises(ValueError, match=r"^all_to_all_single output split sizes must be 3 "
                                             r"non-negative row counts summing to 6, "
                                             r"got \[1, 1, 1\]"):
            pg.alltoall_base(np.empty(6), np.empty(6), [1, 1, 1], [2, 2, 2])
        with pytest.raises(TypeError, match=r"^all_to_all_single output is float32\[6\] but "
                                            r"input is float64\[6\]; both must share one dtype"):
            pg.alltoall_base(np.empty(6, np.float32), np.empty(6), [], [])

    job.run(body)
