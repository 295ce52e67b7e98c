"""The tcp backend with cupy arrays (staged through pinned host memory): every collective equals
numpy, async ops see what the caller's stream produced, and results are on the device after
wait(). Ranks are threads of this process sharing one GPU, which the tcp backend allows.

all_reduce, reduce and broadcast stage cupy arrays in the tcp backend as it is; the other
collectives need /tmp/gpu_patches/collectives_pg_tcp.py.diff (collectives/_pg_staging.py).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from shoal.collectives.types import ReduceOp
from shoal.collectives.store.hash import HashStore

cp = pytest.importorskip("cupy")
W = 3


@pytest.fixture
def groups():
    from shoal.collectives.backends.tcp.group import ProcessGroupTCP

    store, pgs, errors = HashStore(), [None] * W, []

    def join(r):
        try:
            pgs[r] = ProcessGroupTCP(store, r, W, timeout=30)
        except Exception as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    yield pgs
    for pg in pgs:
        pg.shutdown()


def run_all(pgs, fn):
    out = [None] * len(pgs)

    def body(r):
        try:
            out[r] = fn(pgs[r], r)
        except BaseException as exc:  # noqa: BLE001  (reported below with the rank)
            out[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(len(pgs))]
    for t in threads:
        t.start()
    for r, t in enumerate(threads):
        t.join(60)
        assert not t.is_alive(), f"rank {r} hung"
    for r, v in enumerate(out):
        if isinstance(v, BaseException):
            raise AssertionError(f"rank {r} raised {v!r}") from v
    return out


def test_reductions_with_cupy_arrays(groups):
    def body(pg, r):
        res = {}
        for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG):
            x = cp.arange(1 << 16, dtype=cp.float64) % 7 + r + 1
            pg.all_reduce(x, op=op)
            res[op] = cp.asnumpy(x)
        b = cp.full(5, r, cp.int32)
        pg.broadcast(b, src=2)
        red = cp.full(3, r + 1.0)
        pg.reduce(red, dst=1, op=ReduceOp.PRODUCT)
        res["b"], res["red"] = cp.asnumpy(b), cp.asnumpy(red)
        return res

    base = np.arange(1 << 16) % 7
    xs = [base + r + 1.0 for r in range(W)]
    expect = {ReduceOp.SUM: sum(xs), ReduceOp.PRODUCT: xs[0] * xs[1] * xs[2],
              ReduceOp.MIN: np.minimum.reduce(xs), ReduceOp.MAX: np.maximum.reduce(xs),
              ReduceOp.AVG: sum(xs) / W}
    for r, res in enumerate(run_all(groups, body)):
        for op, value in expect.items():
            np.testing.assert_allclose(res[op], value, rtol=1e-12, err_msg=f"{op} rank {r}")
        np.testing.assert_array_equal(res["b"], [2] * 5)
        np.testing.assert_array_equal(res["red"], [6.0] * 3 if r == 1 else [r + 1.0] * 3)


def test_async_op_waits_for_the_producing_stream(groups):
    def body(pg, r):
        side = cp.cuda.Stream(non_blocking=True)
        with side:
            x = cp.zeros(1 << 22, cp.float32)
            for _ in range(20):  # enough queued work that a copy not ordered after it sees zeros
                x += 0.5
            work = pg.all_reduce(x, async_op=True)
        work.wait()
        return float(cp.asnumpy(x[-1]))

    assert run_all(groups, body) == [30.0] * W


def test_data_movement_with_cupy_arrays(groups):
    def body(pg, r):
        res = {}
        outs = [cp.zeros(4, cp.float32) for _ in range(W)]
        pg.all_gather(outs, cp.full(4, float(r), cp.float32))
        into = cp.zeros((W, 2), cp.int64)
        pg.all_gather_into_tensor(into, cp.array([r, -r], cp.int64))
        rs = cp.zeros(2)
        pg.reduce_scatter(rs, [cp.full(2, 10.0 * r + q) for q in range(W)])
        a2a = [cp.zeros(2, cp.int32) for _ in range(W)]
        pg.all_to_all(a2a, [cp.array([r, q], cp.int32) for q in range(W)])
        g = [cp.zeros(1) for _ in range(W)] if r == 0 else None
        pg.gather(cp.array([2.0 * r]), g, dst=0)
        s = cp.zeros(3, cp.float16)
        pg.scatter(s, [cp.full(3, q + 0.5, cp.float16) for q in range(W)] if r == 1 else None, src=1)
        ring = cp.zeros(6)
        sw = pg.send(cp.full(6, float(r)), dst=(r + 1) % W, async_op=True)
        rw = pg.recv(ring, src=(r - 1) % W, async_op=True)
        sw.wait()
        rw.wait()
        res.update(outs=[cp.asnumpy(o) for o in outs], into=cp.asnumpy(into), rs=cp.asnumpy(rs),
                   a2a=[cp.asnumpy(o) for o in a2a], g=None if g is None else [cp.asnumpy(v) for v in g],
                   s=cp.asnumpy(s), ring=cp.asnumpy(ring))
        return res

    for r, res in enumerate(run_all(groups, body)):
        for q in range(W):
            np.testing.assert_array_equal(res["outs"][q], [q] * 4)
            np.testing.assert_array_equal(res["into"][q], [q, -q])
            np.testing.assert_array_equal(res["a2a"][q], [q, r])
        np.testing.assert_array_equal(res["rs"], [30.0 + 3 * r] * 2)
        if r == 0:
            np.testing.assert_array_equal(np.concatenate(res["g"]), [0.0, 2.0, 4.0])
        np.testing.assert_array_equal(res["s"], [r + 0.5] * 3)
        np.testing.assert_array_equal(res["ring"], [float((r - 1) % W)] * 6)
